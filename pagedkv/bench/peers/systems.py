"""The systems ``pagedkv bench peers`` compares, each run on the same requests.

Every ``run_*`` returns ``(result row, output token ids per request)``; the row's timings are
seconds since t0, the moment every request is submitted (see :mod:`pagedkv.bench.peers.run`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from pagedkv.bench.common import greedy
from pagedkv.bench.workload import BenchRequest, summarize, tpot
from pagedkv.utils import cdiv

# System names, as they appear in the result files.
PAGEDKV = "pagedkv"
PAGEDKV_REPEAT = "pagedkv (repeat, after the peers)"
HF_GENERATE = "transformers generate (bs={bs})"
HF_CB = "transformers generate_batch"


@dataclass(frozen=True)
class PeerModel:
    """The GGUF file every system of a peer benchmark runs on (``--model``; see
    :func:`resolve_peer_model`). ``name``: the bundled model's name or the file's stem, the
    result-name suffix of a model other than the default; ``file_type``: the weights as stored
    (``Q4_1``, ``Q4_K_M``: llama.cpp's precision); ``adds_bos``: the tokenizer starts every
    prompt with ``bos_token_id`` (Gemma-3), so the synthetic prompts do too; ``sliding_window``:
    the window (tokens) of its sliding-window layers, None without any."""

    path: Path
    model_id: str
    name: str
    default: bool
    file_type: str
    vocab_size: int
    bos_token_id: Optional[int]
    adds_bos: bool
    has_chat_template: bool
    sliding_window: Optional[int] = None

    @property
    def suffix(self) -> str:
        """``""`` for the default bundled model, else ``_<name>`` (so its results never
        overwrite the default model's)."""
        return "" if self.default else f"_{self.name}"

    def with_bos(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` (token ids) with its first token replaced by the model's BOS when its
        tokenizer starts every prompt with one (the length, so the workload, is unchanged);
        as is otherwise (SmolLM2 adds nothing)."""
        ids = list(prompt)
        if self.adds_bos and self.bos_token_id is not None and ids:
            ids[0] = self.bos_token_id
        return ids

    def note_bos(self, note: Optional[str], how: str) -> Optional[str]:
        """The results' notes: ``note`` (``--note``; None for none), then, for a model whose
        tokenizer starts every prompt with BOS, that it does and ``how`` the prompts got it. No
        peer benchmark uses a chat template (prompts are token ids or plain text)."""
        if not (self.adds_bos and self.bos_token_id is not None):
            return note
        bos = f"{self.model_id} starts every prompt with BOS (id {self.bos_token_id}): {how}"
        return f"{note}; {bos}" if note else bos

    def as_config(self) -> dict[str, Any]:
        """What the results record of the model (``model`` is the GGUF's path)."""
        return {"model": str(self.path), "model_id": self.model_id, "model_file": self.path.name,
                "model_name": self.name, "model_is_default": self.default, "model_weights_as_stored": self.file_type,
                "model_has_chat_template": self.has_chat_template,
                "prompts_start_with_bos": self.bos_token_id if self.adds_bos else None}


def resolve_peer_model(model: Optional[str] = None) -> PeerModel:
    """The GGUF of ``--model``: None (the default bundled SmolLM2), a bundled model's name
    (``gemma-3-270m``) or a GGUF file's path, resolved by
    :func:`pagedkv.model.loader.resolve_model_path`. Reads only the file's metadata. Raises
    ``ConfigError`` for a missing model, an HF directory (llama.cpp needs a GGUF file) or an
    unreadable GGUF."""
    from pagedkv._bundled import BUNDLED_NAMES, GEMMA3_GGUF_NAME, GEMMA3_NAME
    from pagedkv.errors import ConfigError
    from pagedkv.gguf_header import read_gguf_metadata
    from pagedkv.model.loader import load_config, resolve_model_path

    path = resolve_model_path(model)
    if not path.is_file():
        raise ConfigError(f"--model: {str(path)!r} is a directory; the peers run on one GGUF file (name it)")
    default = model is None
    if not default:
        try:
            default = os.path.samefile(path, resolve_model_path(None))
        except (ConfigError, OSError):  # the default model is not installed: this is another
            default = False
    meta = read_gguf_metadata(path)
    cfg = load_config(path)
    if default:
        name = "smollm2-135m-instruct"
    elif path.name == GEMMA3_GGUF_NAME or BUNDLED_NAMES.get(str(model)) == GEMMA3_NAME:
        name = GEMMA3_NAME
    else:
        name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in path.stem)
    return PeerModel(path=path, model_id=cfg.model_id or path.stem, name=name, default=default,
                     file_type=_file_type(meta.get("general.file_type")), vocab_size=int(cfg.vocab_size),
                     bos_token_id=cfg.bos_token_id, adds_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     has_chat_template=bool(meta.get("tokenizer.chat_template")), sliding_window=cfg.sliding_window)


def _file_type(code: Any) -> str:
    """A GGUF ``general.file_type`` code by llama.cpp's name (3 -> ``Q4_1``, 15 -> ``Q4_K_M``)."""
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(code)).name.removeprefix("MOSTLY_")
    except Exception:  # noqa: BLE001 - no gguf package, an unknown or absent code
        return "unknown" if code is None else f"file type {code}"


def result_row(name: str, reqs: Sequence[BenchRequest], elapsed: float, cpu_s: float, first: Sequence[Optional[float]],
            finish: Sequence[Optional[float]], n_out: Sequence[int], **extra: Any) -> dict[str, Any]:
    """A system's result row. ``elapsed``: wall seconds; ``cpu_s``: this process's CPU
    seconds over the same span (all threads; less sensitive to other jobs on a shared
    machine than wall time); ``first``/``finish``: per-request first-token and last-token
    times in seconds since t0 (all requests submitted at t0); ``n_out``: tokens produced.
    ``decode_tokens_per_s``: the requests' tokens after their first over the summed time from
    first to last token (tokens/s per request stream)."""
    useful = sum(min(n, r.output_len) for n, r in zip(n_out, reqs))
    ttfts = [f for f in first if f is not None]
    spans = [(e - f, min(n, r.output_len) - 1) for f, e, n, r in zip(first, finish, n_out, reqs)
             if f is not None and e is not None and min(n, r.output_len) >= 2]
    tpots = [t for t in (tpot(f, e, min(n, r.output_len)) for f, e, n, r in zip(first, finish, n_out, reqs)
                         if f is not None and e is not None) if t is not None]
    decode_s, decode_tokens = sum(s for s, _ in spans), sum(k for _, k in spans)
    return {
        "name": name,
        "status": "ok",
        "reason": None,
        "elapsed_s": elapsed,
        "requests": len(reqs),
        "completed": sum(1 for n, r in zip(n_out, reqs) if n >= r.output_len),
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed if elapsed > 0 else float("nan"),
        "cpu_s": cpu_s,
        "output_tokens_per_cpu_s": useful / cpu_s if cpu_s > 0 else float("nan"),
        "requests_per_s": len(reqs) / elapsed if elapsed > 0 else float("nan"),
        "ttft_s": summarize(ttfts),
        "tpot_s": summarize(tpots),
        # per-request decode rate: tokens after the first / time from the first to the last
        # (= 1 / token-weighted mean TPOT; for one-at-a-time runs, the batch-1 decode rate)
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        **extra,
    }


def failed(name: str, status: str, reason: str) -> dict[str, Any]:
    return {"name": name, "status": status, "reason": reason}


# ---- pagedkv ---------------------------------------------------------------------------------
def run_pagedkv(loaded: Any, reqs: Sequence[BenchRequest], engine_kwargs: dict[str, Any],
                progress: bool = True) -> tuple[dict[str, Any], list[list[int]]]:
    """All requests through ``LLM.generate`` (greedy, ignore_eos). Returns the result row
    and the output token ids per request."""
    from pagedkv.engine.llm import LLM

    llm = LLM(loaded, **engine_kwargs)
    # warm-up (first-call allocations, kernels), not timed
    llm.generate([reqs[0].prompt_token_ids[:8]], greedy(2), use_tqdm=False)
    params = [greedy(r.output_len) for r in reqs]
    t0 = time.time()
    c0 = time.process_time()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=progress)
    elapsed = time.time() - t0
    cpu = time.process_time() - c0
    first = [o.metrics.first_token_time - t0 if o.metrics.first_token_time else None for o in outs]
    finish = [o.metrics.finish_time - t0 if o.metrics.finish_time else None for o in outs]
    st = llm.engine.get_stats()
    kv = llm.engine.kv_summary()
    row = result_row(
        PAGEDKV, reqs, elapsed, cpu, first, finish, [len(o.token_ids) for o in outs],
        preemptions=st.num_preemptions, peak_running=st.peak_running,
        engine_steps=st.num_steps, kv_blocks=kv["num_blocks"], kv_bytes=kv["bytes"],
        computed_prompt_tokens=sum(r.prompt_len for r in reqs),
        computed_output_tokens=sum(len(o.token_ids) for o in outs),
    )
    return row, [list(o.token_ids) for o in outs]


# ---- transformers -----------------------------------------------------------------------------
def load_hf_model(path: Optional[Path] = None) -> Any:
    """The GGUF file at ``path`` (default: the bundled SmolLM2) through transformers,
    de-quantised to fp32 (eval mode). Raises whatever transformers raises (an architecture or
    quantisation its GGUF reader lacks)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedkv._bundled import bundled_model_path

    path = Path(path) if path is not None else bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


class _StepClock:
    """A StoppingCriteria that records the wall time of every generated token (never stops)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.times.append(time.time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _hf_generate_batch(model: Any, batch: Sequence[BenchRequest], pad_id: int) -> tuple[list[list[int]], list[float]]:
    """One static, left-padded batch run to its longest output. Returns the generated ids per
    row and the wall time of each generation step."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - r.prompt_len:] = 1
    n_new = max(r.output_len for r in batch)
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=pad_id)
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                             stopping_criteria=StoppingCriteriaList([clock]))
    gen = out[:, width:].tolist()
    return gen, clock.times


def run_hf_generate(model: Any, reqs: Sequence[BenchRequest], batch_size: int,
                    progress: bool = True) -> tuple[dict[str, Any], list[list[int]]]:
    """Static batches of ``batch_size`` requests in order. Returns the result row and the
    output token ids per request (each cut to its own output length)."""
    from tqdm.auto import tqdm

    pad_id = int(getattr(model.generation_config, "pad_token_id", None) or 0)
    _hf_generate_batch(model, [BenchRequest(reqs[0].prompt_token_ids[:8], 2)], pad_id)  # warm-up
    first: list[Optional[float]] = []
    finish: list[Optional[float]] = []
    n_out: list[int] = []
    outputs: list[list[int]] = []
    computed = 0
    computed_prompt = 0
    t0 = time.time()
    c0 = time.process_time()
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    for batch in tqdm(batches, desc=f"generate bs={batch_size}", unit="batch", disable=not progress, leave=False):
        gen, times = _hf_generate_batch(model, batch, pad_id)
        computed += len(batch) * len(times)
        computed_prompt += len(batch) * max(r.prompt_len for r in batch)
        for r, g in zip(batch, gen):
            n = min(len(g), r.output_len, len(times))
            first.append(times[0] - t0 if times else None)
            finish.append(times[n - 1] - t0 if n else None)
            n_out.append(n)
            outputs.append(g[: r.output_len])
    elapsed = time.time() - t0
    cpu = time.process_time() - c0
    row = result_row(HF_GENERATE.format(bs=batch_size), reqs, elapsed, cpu, first, finish, n_out,
                  batch_size=batch_size, computed_prompt_tokens=computed_prompt, computed_output_tokens=computed)
    return row, outputs


def run_hf_generate_batch(model: Any, reqs: Sequence[BenchRequest], max_batch_tokens: int = 512,
                          progress: bool = True) -> tuple[dict[str, Any], list[list[int]]]:
    """transformers' continuous batching: each request added with its own output length and
    EOS disabled; per-token timestamps give TTFT/TPOT. ``max_batch_tokens``: tokens per step
    (pagedkv's max_num_batched_tokens); its KV cache is sized to hold every request at once
    (left to itself on CPU it sizes the cache from system memory: ~10 GB here, and steps over
    that cache crawl). Raises whatever transformers raises."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(r.prompt_len for r in reqs),
                              max_generated_length=max(r.output_len for r in reqs), num_requests=len(reqs))
    except Exception:  # noqa: BLE001 - hints are optional
        hints = None
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in reqs), eos_token_id=-1,
                          pad_token_id=int(getattr(model.generation_config, "pad_token_id", None) or 0))
    page = 256
    num_blocks = sum(cdiv(r.prompt_len + r.output_len, page) for r in reqs) + 4
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                   max_requests_per_batch=len(reqs))
    kw: dict[str, Any] = {"generation_config": gc, "block": True, "timeout": 30, "continuous_batching_config": cbc}
    if hints is not None:
        kw["workload_hints"] = hints
    results: dict[str, Any] = {}
    attn_before = getattr(model.config, "_attn_implementation", None)
    try:
        t0, t0_perf, elapsed, cpu, ids = _cb_run(model, reqs, kw, results, progress)
    finally:
        # the manager switches to a paged attention implementation and should switch back on
        # stop; make sure a shared model (test fixtures) is left as it was
        if attn_before is not None and getattr(model.config, "_attn_implementation", None) != attn_before:
            model.set_attn_implementation(attn_before)
    first: list[Optional[float]] = []
    finish: list[Optional[float]] = []
    n_out: list[int] = []
    outputs: list[list[int]] = []
    errors = []
    for rid in ids:
        res = results.get(rid)
        if res is None or res.error is not None:
            errors.append(f"{rid}: {'missing' if res is None else res.error}")
            first.append(None)
            finish.append(None)
            n_out.append(0)
            outputs.append([])
            continue
        ts = list(res.timestamps or [])
        toks = list(res.generated_tokens)
        first.append(ts[0] - t0_perf if ts else None)
        finish.append(ts[len(toks) - 1] - t0_perf if ts and toks else None)
        n_out.append(len(toks))
        outputs.append(toks)
    if errors and len(errors) == len(ids):
        raise RuntimeError("every request failed: " + "; ".join(errors[:3]))
    row = result_row(HF_CB, reqs, elapsed, cpu, first, finish, n_out, request_errors=errors[:5] or None,
                  cb_config={"page_size": page, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens},
                  attn_implementation=attn_before)
    return row, outputs


def _cb_run(model: Any, reqs: Sequence[BenchRequest], kw: dict[str, Any], results: dict[str, Any],
            progress: bool) -> tuple[float, float, float, float, list[str]]:
    """Inside the manager: a warm-up request, then every request; fills ``results``.
    Returns (t0 wall, t0 perf_counter, elapsed s, process CPU s, request ids)."""
    import torch
    from tqdm.auto import tqdm

    with torch.inference_mode(), model.continuous_batching_context_manager(**kw) as mgr:
        # warm-up request, not timed
        wid = mgr.add_request(list(reqs[0].prompt_token_ids[:8]), request_id="warmup", max_new_tokens=2,
                              eos_token_id=-1)
        _wait_results(mgr, {wid}, {}, timeout=300.0)
        t0_perf = time.perf_counter()
        t0 = time.time()
        c0 = time.process_time()
        ids = []
        for i, r in enumerate(reqs):
            ids.append(mgr.add_request(list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.output_len,
                                       record_timestamps=True, eos_token_id=-1))
        bar = tqdm(total=len(ids), desc="generate_batch", unit="req", disable=not progress, leave=False)
        _wait_results(mgr, set(ids), results, timeout=max(600.0, 5.0 * len(reqs)), bar=bar)
        bar.close()
        elapsed = time.time() - t0
        cpu = time.process_time() - c0
    return t0, t0_perf, elapsed, cpu, ids


def _wait_results(mgr: Any, want: set[str], into: dict[str, Any], timeout: float, bar: Any = None) -> None:
    deadline = time.time() + timeout
    got: set[str] = set()
    while got != want:
        if time.time() > deadline:
            raise TimeoutError(f"generate_batch: {len(want - got)} requests unfinished after {timeout:.0f}s")
        res = mgr.get_result(timeout=1.0)
        if res is None:
            if not mgr.is_running():
                raise RuntimeError("the continuous batching thread stopped unexpectedly")
            continue
        if res.is_finished() and res.request_id in want:
            into[res.request_id] = res
            got.add(res.request_id)
            if bar is not None:
                bar.update(1)
