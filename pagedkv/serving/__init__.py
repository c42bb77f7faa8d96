"""Data-parallel replicas on Ray Serve behind one OpenAI-compatible ingress (docs/replicas.md).

``pagedkv serve --data-parallel-size N`` runs N engine replicas as Ray Serve deployments
(:mod:`pagedkv.serving.replica`) and one ingress (:mod:`pagedkv.serving.ingress`) that routes
each request with a policy of :mod:`pagedkv.serving.router` (``round-robin``,
``least-loaded``, ``prefix-aware``) over per-replica prefix indexes
(:mod:`pagedkv.serving.index`, fed by KV events: :mod:`pagedkv.serving.events`).

Importing this package imports no Ray: only :mod:`pagedkv.serving.replica` and
:mod:`pagedkv.serving.launch` do, and only ``serve --data-parallel-size N`` (N > 1) loads them.
"""
