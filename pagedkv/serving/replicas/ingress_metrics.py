"""``GET /metrics`` of the ingress: every replica's Prometheus metrics, labelled, plus sums.

Each sample of replica ``i`` gets the label ``replica="i"``; each series also appears once with
``replica="all"``: the sum over the replicas that answered (the mean for the ratios
``*_usage_percent`` and ``*_hit_rate``). So ``metric{replica="all"}`` is the service and
``metric{replica!="all"}`` the replicas (summing every series double counts). The router's own
counters follow (``pagedkv_router_*``, per replica).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.serving.replicas.router import ReplicaView

_MEAN_SUFFIXES = ("_usage_percent", "_hit_rate")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _value(v: float) -> str:
    return repr(float(v)) if v == v and abs(v) != float("inf") else ("+Inf" if v > 0 else "-Inf" if v < 0 else "NaN")


def merge_metrics(texts: Mapping[int, str]) -> str:
    """One exposition from ``{replica rank: its /metrics text}`` (see the module docstring).
    Malformed text of a replica raises ``ValueError`` (prometheus_client's parser)."""
    fams: OrderedDict[str, dict] = OrderedDict()
    for rank, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            f = fams.setdefault(fam.name, {"doc": fam.documentation, "type": fam.type,
                                           "per": [], "sum": OrderedDict(), "n": OrderedDict()})
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                f["per"].append((s.name, {**s.labels, "replica": str(rank)}, s.value))
                key = (s.name, tuple(sorted(s.labels.items())))
                f["sum"][key] = f["sum"].get(key, 0.0) + s.value
                f["n"][key] = f["n"].get(key, 0) + 1
    out: list[str] = []
    for name, f in fams.items():
        tname = name + "_total" if f["type"] == "counter" else name
        out.append(f"# HELP {tname} {f['doc']}")
        out.append(f"# TYPE {tname} {f['type']}")
        for (sname, labels), total in f["sum"].items():
            if sname.endswith(_MEAN_SUFFIXES):
                total /= f["n"][(sname, labels)]
            out.append(f"{sname}{_labels({**dict(labels), 'replica': 'all'})} {_value(total)}")
        out.extend(f"{sname}{_labels(lab)} {_value(v)}" for sname, lab, v in f["per"])
    return "\n".join(out) + "\n"


def router_metrics(replicas: Iterable[ReplicaView], policy: str, retries: int) -> str:
    """The router's own series, labelled by replica (and the policy on the routed counter)."""
    rows = [
        ("pagedkv_router_replica_up", "gauge", "1 while the replica is in routing, 0 while it is out.",
         lambda r: float(r.healthy)),
        ("pagedkv_router_in_flight", "gauge", "Requests the ingress has in flight at the replica.",
         lambda r: float(r.in_flight)),
        ("pagedkv_router_routed_total", "counter", "Requests routed to the replica (retries included).",
         lambda r: float(r.routed)),
        ("pagedkv_router_matched_blocks_total", "counter",
         "Prompt blocks the replica's prefix index held when a request was routed there.", lambda r: float(r.matched_blocks)),
        ("pagedkv_router_failures_total", "counter", "Requests lost by the replica (connection lost, process gone).",
         lambda r: float(r.failures)),
        ("pagedkv_router_restarts_total", "counter", "Times the replica came back as a new process.",
         lambda r: float(r.restarts)),
    ]
    reps = list(replicas)
    out: list[str] = []
    for name, typ, doc, get in rows:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {typ}"]
        extra = {"policy": policy} if name == "pagedkv_router_routed_total" else {}
        out += [f"{name}{_labels({'replica': str(r.rank), **extra})} {_value(get(r))}" for r in reps]
    out += ["# HELP pagedkv_router_retries_total Requests sent again to another replica after one failed them.",
            "# TYPE pagedkv_router_retries_total counter", f"pagedkv_router_retries_total {_value(retries)}"]
    return "\n".join(out) + "\n"
