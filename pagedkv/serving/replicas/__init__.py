"""Data-parallel replicas on Ray Serve behind one OpenAI-compatible ingress (docs/replicas.md).

``pagedkv serve --data-parallel-size N`` runs N engine replicas as Ray Serve deployments
(:mod:`pagedkv.serving.replicas.replica`, each the one-engine server of
:mod:`pagedkv.serving` on its own port) and one ingress
(:mod:`pagedkv.serving.replicas.ingress`) that routes each request with a policy of
:mod:`pagedkv.serving.replicas.router` (``round-robin``, ``least-loaded``, ``prefix-aware``)
over per-replica prefix indexes (:mod:`pagedkv.serving.replicas.index`, fed by KV events:
:mod:`pagedkv.serving.replicas.events`).

Importing this package imports no Ray: only :mod:`pagedkv.serving.replicas.replica` and
:mod:`pagedkv.serving.replicas.launch` do, and only ``serve --data-parallel-size N`` (N > 1)
loads them.
"""
