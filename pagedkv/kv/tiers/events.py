"""KV events: every change of what the cache holds, published over ZeroMQ so a router or a
cache index outside the process can follow each replica's cache (vLLM's event shapes).

Wire format (vLLM's ``ZmqEventPublisher``, msgpack, structs as arrays with the type tag
first, trailing defaults omitted):

* PUB socket, multipart ``(topic, seq, payload)``: ``seq`` is the batch's sequence number,
  8 bytes big-endian, starting at 0 and increasing by one per batch (one batch per engine
  step that changed something); ``payload`` is ``[ts, [event, ...]]`` (``ts``: seconds since
  the epoch, float).
* events: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``. Hashes are the 32-byte block keys (bytes); ``token_ids`` are
  the tokens of every block in ``block_hashes`` in order; ``parent_block_hash`` is the
  parent of the first; ``medium`` is the tier (``pool``, ``host``, ``disk``); ``extra_keys``
  has one entry per block: ``[typed extra keys as text]`` (model, revision, adapter, salt,
  tenant, multimodal items: what the hash covers besides the tokens).
* ROUTER replay socket: a client (DEALER, sending an empty delimiter frame first) sends a
  start sequence number (8 bytes big-endian);
  it receives ``(seq, payload)`` for every buffered batch from there (the last
  ``buffer_steps``), then ``(-1 as 8 signed bytes, b"")``.

See ``docs/kv_events.md`` for a subscriber.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.kv.tiers.index import TierEntry

logger = logging.getLogger("pagedkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = "kv-events"


def _tokens(token_bytes: bytes) -> list[int]:
    import numpy as np

    return np.frombuffer(token_bytes, dtype="<i8").tolist()


class KVEventRecorder:
    """Collects one step's events (merging consecutive blocks of one chain into one
    ``BlockStored``) and hands them to a publisher as a batch on ``flush``."""

    def __init__(self, block_size: int, publisher: Any) -> None:
        self.block_size = block_size
        self.publisher = publisher
        self._events: list[list[Any]] = []

    def stored(self, medium: str, entry: TierEntry) -> None:
        last = self._events[-1] if self._events else None
        extra = [entry.extra_bytes.decode("utf-8", "replace")]
        if (last is not None and last[0] == "BlockStored" and last[6] == medium
                and last[1][-1] == entry.parent_hash):
            last[1].append(entry.block_hash)
            last[3].extend(_tokens(entry.token_bytes))
            last[8].append(extra)
            return
        self._events.append(["BlockStored", [entry.block_hash], entry.parent_hash,
                             _tokens(entry.token_bytes), self.block_size, None, medium, None, [extra]])

    def removed(self, medium: str, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved" and last[2] == medium:
            last[1].append(block_hash)
            return
        self._events.append(["BlockRemoved", [block_hash], medium])

    def cleared(self) -> None:
        self._events.append(["AllBlocksCleared"])

    def flush(self) -> None:
        """Publish the events recorded since the last flush as one batch (if any)."""
        if self._events:
            events, self._events = self._events, []
            self.publisher.publish(events)


def replay_endpoint_for(endpoint: str) -> str | None:
    """The default replay endpoint: ``tcp://host:port`` -> ``tcp://host:port+1``."""
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + 1}"
    return None


class ZmqEventPublisher:
    """Binds a PUB socket at ``endpoint`` and (if given) a ROUTER replay socket at
    ``replay_endpoint``; a daemon thread encodes and sends the batches queued by
    ``publish`` and answers replay requests from the last ``buffer_steps`` batches.
    Raises ``ConfigError`` if an endpoint cannot be bound (in use, malformed)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 topic: str = DEFAULT_TOPIC) -> None:
        import msgpack
        import zmq

        self._zmq, self._pack = zmq, msgpack.Packer(use_bin_type=True).pack
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"kv_events: cannot bind {endpoint} / replay {replay_endpoint}: {e}") from None
        self._topic = topic.encode()
        self._queue: queue.Queue = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self.num_published = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[list[Any]]) -> None:
        """Queue one batch (sent in order by the publisher thread)."""
        self._queue.put((time.time(), events))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            seq = next(self._seq)
            payload = self._pack([ts, events])
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError as e:  # keep the sequence: a subscriber replays the gap
                logger.warning("kv_events: send of batch %d failed: %s", seq, e)
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv_events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A published payload as ``(ts, [event dicts])`` with named fields (for subscribers
    and tests): ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash", ...}``."""
    import msgpack

    ts, events = msgpack.unpackb(payload, raw=False)
    names = {
        "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                        "medium", "lora_name", "extra_keys"),
        "BlockRemoved": ("block_hashes", "medium"),
        "AllBlocksCleared": (),
    }
    out = []
    for ev in events:
        fields = names.get(ev[0], ())
        out.append({"type": ev[0], **dict(zip(fields, ev[1:]))})
    return ts, out
