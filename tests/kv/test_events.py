"""KV events (pagedkv/kv/tiers/events.py) without sockets: the recorder's merging of one
chain's stored blocks and of removals per medium, batches per flush, the replay endpoint
rule and decoding a payload (trailing defaults omitted)."""

import msgpack
import numpy as np

from pagedkv.kv.tiers.events import END_SEQ, KVEventRecorder, decode_batch, replay_endpoint_for
from pagedkv.kv.tiers.index import TierEntry


class ListPublisher:
    def __init__(self):
        self.batches = []

    def publish(self, events):
        self.batches.append(events)


def _e(name, parent, toks, extra=b"salt=s"):
    return TierEntry(name * 32, parent and parent * 32, np.array(toks, dtype="<i8").tobytes(), extra)


def test_one_chain_is_one_block_stored_event():
    pub = ListPublisher()
    rec = KVEventRecorder(2, pub)
    rec.stored("pool", _e(b"a", None, [1, 2]))
    rec.stored("pool", _e(b"b", b"a", [3, 4]))
    rec.stored("host", _e(b"c", b"b", [5, 6]))  # another medium: a new event
    rec.stored("host", _e(b"x", b"q", [7, 8], b""))  # another chain: a new event
    rec.flush()
    (batch,) = pub.batches
    assert batch == [
        ["BlockStored", [b"a" * 32, b"b" * 32], None, [1, 2, 3, 4], 2, None, "pool", None, [["salt=s"], ["salt=s"]]],
        ["BlockStored", [b"c" * 32], b"b" * 32, [5, 6], 2, None, "host", None, [["salt=s"]]],
        ["BlockStored", [b"x" * 32], b"q" * 32, [7, 8], 2, None, "host", None, [[""]]],
    ]


def test_removals_merge_per_medium_and_a_clear_splits_them():
    pub = ListPublisher()
    rec = KVEventRecorder(4, pub)
    rec.removed("pool", b"1")
    rec.removed("pool", b"2")
    rec.removed("disk", b"3")
    rec.cleared()
    rec.removed("disk", b"4")
    rec.flush()
    rec.flush()  # nothing new: no empty batch
    assert pub.batches == [[["BlockRemoved", [b"1", b"2"], "pool"], ["BlockRemoved", [b"3"], "disk"],
                            ["AllBlocksCleared"], ["BlockRemoved", [b"4"], "disk"]]]
    rec.removed("pool", b"5")
    rec.flush()
    assert pub.batches[1] == [["BlockRemoved", [b"5"], "pool"]]


def test_replay_endpoint_is_the_next_port():
    assert replay_endpoint_for("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert replay_endpoint_for("tcp://*:9") == "tcp://*:10"
    assert replay_endpoint_for("ipc:///tmp/kv") is None
    assert replay_endpoint_for("tcp://host") is None
    assert END_SEQ == b"\xff" * 8


def test_decode_batch_names_the_fields():
    payload = msgpack.packb([12.5, [["BlockStored", [b"h"], None, [1, 2], 2, None, "pool"],
                                    ["BlockRemoved", [b"h"], "host"], ["AllBlocksCleared"]]])
    ts, events = decode_batch(payload)
    assert ts == 12.5
    assert events == [
        {"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "pool"},
        {"type": "BlockRemoved", "block_hashes": [b"h"], "medium": "host"},
        {"type": "AllBlocksCleared"},
    ]
