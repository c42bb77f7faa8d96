"""A replica's KV events (docs/kv_events.md) feeding its prefix index in the router.

One :class:`EventFeed` per replica subscribes to the replica's ZeroMQ PUB socket and applies
``BlockStored`` / ``BlockRemoved`` of the ``pool`` medium and ``AllBlocksCleared`` to the
replica's :class:`pagedkv.serving.replicas.index.PrefixIndex` (through ``Router.update_index``, under
the router's lock). A missed batch is not replayed: the index is a routing hint, and the
router's own inserts and the LRU capacity bound any drift.
"""

from __future__ import annotations

import logging
import threading

import msgpack
import zmq

from pagedkv.serving.replicas.router import ReplicaView, Router

logger = logging.getLogger("pagedkv.serving.replicas")
TOPIC = b"kv-events"


class EventFeed:
    """Subscribes to ``endpoint`` (``tcp://host:port``) in a daemon thread until :meth:`close`."""

    def __init__(self, router: Router, replica: ReplicaView, endpoint: str) -> None:
        self.router, self.replica, self.endpoint = router, replica, endpoint
        self.batches = 0
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        replica.events = True
        self._thread = threading.Thread(target=self._run, name=f"pagedkv-kv-events-{replica.rank}", daemon=True)
        self._thread.start()

    def apply(self, payload: bytes) -> None:
        """Apply one batch (``[ts, [event, ...]]``, msgpack) to the index."""
        _, events = msgpack.unpackb(payload)
        for ev in events:
            if ev[0] == "BlockStored" and ev[6] == "pool":
                self.router.update_index(self.replica, stored=ev[1])
            elif ev[0] == "BlockRemoved" and ev[2] == "pool":
                self.router.update_index(self.replica, removed=ev[1])
            elif ev[0] == "AllBlocksCleared":
                self.router.update_index(self.replica, cleared=True)
        self.batches += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                _, _, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                self.apply(payload)
            except Exception:  # a malformed batch must not stop the feed
                logger.exception("replica %d: bad KV event batch", self.replica.rank)
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.replica.events = False
