"""One pagedkv measurement of ``pagedkv bench models``, in its own process.

``python -m pagedkv.bench.models.child SPEC.json``: pin ``threads`` torch threads, construct
``pagedkv.LLM(model=<gguf>, ...)`` (cold or warm: the parent chose ``$PAGEDKV_CACHE_DIR``),
print ``{"event": "ready", ...}`` (wall clock, so the parent can time process start to
ready), then, with ``"measure": true``, time prefill and batch-1 decode with
:func:`pagedkv.bench.peers.worker.measure` (the same helper ``pagedkv bench peers`` times
pagedkv and the venv peers with). The last stdout line is the result JSON; peak RSS is the
process's ``VmHWM`` (the parent also reads ``ru_maxrss`` from ``wait4``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

T_START = time.time()


def status_bytes(field: str) -> int | None:
    """``field`` (``VmHWM``, ``VmRSS``) of ``/proc/self/status`` in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(open(argv[0]).read())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from pagedkv.engine.llm import LLM
    from pagedkv.bench.common import greedy
    from pagedkv.bench.peers.worker import measure

    t_import = time.time()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine"])
    load_s = time.perf_counter() - t0
    loaded = llm.engine.loaded
    out: dict[str, Any] = {"event": "ready", "t_ready_wall": time.time(), "t_start_wall": T_START,
                           "import_s": t_import - T_START, "llm_init_s": load_s,
                           "weights": str(loaded.weights), "weights_reason": loaded.weights_reason,
                           "from_cache": bool(loaded.from_cache), "vm_hwm_after_load": status_bytes("VmHWM"),
                           "kv_cache_dtype": str(llm.engine.kv_summary()["kv_cache_dtype"]),
                           "vm_rss_after_load": status_bytes("VmRSS")}
    print(json.dumps(out), flush=True)
    if spec.get("measure"):
        def gen(prompt: Any, k: int) -> Any:
            (o,) = llm.generate([list(prompt)], greedy(k), use_tqdm=False)
            return o.token_ids

        m = measure(gen, spec["measure_spec"])
        m.pop("output", None)
        out["measure"] = m
    out.update({"event": "done", "vm_hwm": status_bytes("VmHWM"),
                "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
