"""Batch-1 decode and prefill of one peer engine, run inside that peer's own virtual environment.

``<venv>/bin/python pagedkv/bench/peers/worker.py SPEC.json`` prints one JSON object (its last stdout
line). Standard library only at import time: the peer's package (``vllm`` or
``openvino_genai``) is imported by its runner, so the file runs under an interpreter that has
no pagedkv installed; pagedkv imports :func:`measure` from here to time itself the same way.

The measurement is end-to-end latency differencing, the same for every system: one request
at a time, greedy, output forced to its length (EOS ignored), token-id prompts;

* prefill ``P`` tokens: the time of a request of ``P`` prompt tokens and 1 output token
  (its TTFT as the caller sees it), the best (shortest) of ``repeats``;
* batch-1 decode tokens/s: ``(N - 1) / (t(N) - t(1))`` for a prompt of ``decode_prompt``
  tokens, ``t(k)`` the best time of a request of ``k`` output tokens (the prefill and the
  per-request overhead cancel). Medians are recorded beside the best times.

SPEC: ``{"system": "vllm"|"openvino", "model": DIR, "threads": T, "prefill_tokens": P,
"decode_prompt": L, "decode_tokens": N, "repeats": R, "vocab_size": V, "dtype": "bfloat16",
"kv_cache_gib": 1}``.

With ``"mode": "batched"`` the worker measures offline continuous batching instead
(:func:`measure_batched`; SPEC keys ``concurrency``, ``prompt_tokens``, ``output_tokens``,
``min_requests``, ``requests_per_stream``, ``vocab_size``, ``threads``): OpenVINO GenAI's
``ContinuousBatchingPipeline`` with at most ``c`` sequences scheduled at once.

With ``"mode": "trace"`` it measures offline throughput on given requests (:func:`measure_trace`;
SPEC keys ``requests`` = ``[[prompt token ids, output tokens], ...]``, ``max_num_seqs``
(default 64), ``vocab_size``, ``threads``): all of them handed to the engine at once, vLLM's
offline ``LLM`` or OpenVINO's ``ContinuousBatchingPipeline``.
"""

from __future__ import annotations

import os
import sys

# run as a file, this module's folder (pagedkv/bench/peers, with its own trace.py and venv.py) must not shadow
# the standard library inside the peer's environment (callers also pass -I)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

#: ``gen(prompt token ids, output tokens) -> output token ids``
Generate = Callable[[Sequence[int], int], Sequence[int]]
#: ``gen_many(prompts, output tokens, concurrency) -> output token ids per prompt``
GenerateMany = Callable[[Sequence[Sequence[int]], int, int], Sequence[Sequence[int]]]
#: ``gen_trace(prompts, output tokens per prompt) -> output token ids per prompt`` (all at once)
GenerateTrace = Callable[[Sequence[Sequence[int]], Sequence[int]], Sequence[Sequence[int]]]


def prompt_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[100, vocab_size)`` with ``seed`` (the same
    prompt for every system)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def measure(gen: Generate, spec: dict[str, Any]) -> dict[str, Any]:
    """Times ``gen`` as the module docstring says. Returns seconds (medians and every
    repeat), tokens/s and the output of the longest decode request (token ids). Raises
    ``RuntimeError`` when ``gen`` returns a different number of tokens than asked."""
    reps = int(spec.get("repeats", 3))
    vocab = int(spec["vocab_size"])
    p_len, d_len, n = int(spec["prefill_tokens"]), int(spec["decode_prompt"]), int(spec["decode_tokens"])

    def timed(prompt: Sequence[int], k: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = list(gen(prompt, k))
        dt = time.perf_counter() - t
        if len(out) != k:
            raise RuntimeError(f"asked for {k} tokens, got {len(out)}")
        return dt, out

    timed(prompt_ids(8, vocab, 99), 2)  # warm-up, not timed
    pre = [timed(prompt_ids(p_len, vocab, 1000 + i), 1)[0] for i in range(reps)]
    d_prompt = prompt_ids(d_len, vocab, 7)
    one = [timed(d_prompt, 1)[0] for _ in range(reps)]
    full, tokens = [], []
    for _ in range(reps):
        dt, tokens = timed(d_prompt, n)
        full.append(dt)
    return {**summarize_runs(p_len, d_len, n, pre, one, full), "output": tokens}


def summarize_runs(p_len: int, d_len: int, n: int, pre: Sequence[float], one: Sequence[float],
                   full: Sequence[float]) -> dict[str, Any]:
    """The rates from the timed repeats (seconds): prefill runs ``pre``, 1-token runs ``one``
    and ``n``-token runs ``full``. Headline = best of the repeats (the minimum time: on a
    shared machine the other jobs only ever add time), medians beside it."""
    out: dict[str, Any] = {"prefill_tokens": p_len, "decode_prompt": d_len, "decode_tokens": n, "estimator": "best of repeats",
                           "prefill_runs_s": list(pre), "t1_runs_s": list(one), "tn_runs_s": list(full)}
    for key, pick in (("", min), ("median_", statistics.median)):
        p, t1, tn = pick(pre), pick(one), pick(full)
        out.update({f"{key}prefill_s": p, f"{key}prefill_tokens_per_s": p_len / p, f"{key}t1_s": t1, f"{key}tn_s": tn,
                    f"{key}decode_tokens_per_s": (n - 1) / (tn - t1) if tn > t1 else float("nan"),
                    f"{key}tpot_s": (tn - t1) / (n - 1)})
    return out


def batched_requests(c: int, spec: dict[str, Any]) -> int:
    """Requests of one batched run at concurrency ``c``: ``max(min_requests, c x requests_per_stream)``
    (the same count as a ``pagedkv bench serve --peer`` run)."""
    return max(int(spec["min_requests"]), c * int(spec["requests_per_stream"]))


def measure_batched(gen_many: GenerateMany, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Offline continuous batching, per concurrency ``c`` of ``spec["concurrency"]``: every one
    of :func:`batched_requests` requests (``prompt_tokens`` token-id prompts, ``output_tokens``
    outputs each, EOS ignored) is handed to the engine at once and it runs at most ``c`` at a
    time; after one untimed 2-token warm-up request at the same ``c``. Returns one row per ``c``:
    requests, output tokens, seconds and output tokens/s (wall time). Raises ``RuntimeError``
    when a request returns a different number of tokens than asked."""
    vocab, p_len, o_len = int(spec["vocab_size"]), int(spec["prompt_tokens"]), int(spec["output_tokens"])
    rows = []
    for c in (int(x) for x in spec["concurrency"]):
        n = batched_requests(c, spec)
        prompts = [prompt_ids(p_len, vocab, 3000 + i) for i in range(n)]
        gen_many([prompt_ids(8, vocab, 99)], 2, c)  # warm-up (and the engine for c), not timed
        t = time.perf_counter()
        outs = [list(o) for o in gen_many(prompts, o_len, c)]
        dt = time.perf_counter() - t
        bad = [len(o) for o in outs if len(o) != o_len]
        if len(outs) != n or bad:
            raise RuntimeError(f"asked for {n} x {o_len} tokens, got {len(outs)} outputs (lengths {bad[:4]} differ)")
        rows.append({"concurrency": c, "requests": n, "prompt_tokens": p_len, "output_tokens": n * o_len,
                     "seconds": dt, "output_tokens_per_s": n * o_len / dt, "first_output": outs[0][:8]})
    return rows


def trace_requests(spec: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids) and output lengths (tokens) of ``spec["requests"]``. Raises
    ``ValueError`` for an empty list, an empty prompt or an output length below 1."""
    reqs = spec.get("requests") or []
    if not reqs:
        raise ValueError("a trace SPEC needs at least one request")
    prompts = [[int(t) for t in p] for p, _ in reqs]
    lens = [int(k) for _, k in reqs]
    if min(len(p) for p in prompts) < 1 or min(lens) < 1:
        raise ValueError("every trace request needs a prompt token and at least 1 output token")
    return prompts, lens


def measure_trace(gen_trace: GenerateTrace, spec: dict[str, Any]) -> dict[str, Any]:
    """Offline throughput on the requests of ``spec`` (:func:`trace_requests`): after one
    untimed 2-token warm-up request, every request is handed to ``gen_trace`` at once (greedy,
    EOS ignored) and the wall time until the last output is taken. Returns requests, prompt /
    output / total tokens, seconds, output tokens/s and total (prompt + output) tokens/s and the
    first 8 token ids of the first output. Raises ``RuntimeError`` when the number of outputs
    or any output's length differs from what was asked."""
    prompts, lens = trace_requests(spec)
    gen_trace([prompt_ids(8, int(spec["vocab_size"]), 99)], [2])  # warm-up, not timed
    t = time.perf_counter()
    outs = [list(o) for o in gen_trace(prompts, lens)]
    dt = time.perf_counter() - t
    bad = [(i, len(o), k) for i, (o, k) in enumerate(zip(outs, lens)) if len(o) != k]
    if len(outs) != len(prompts) or bad:
        raise RuntimeError(f"asked for {len(prompts)} outputs, got {len(outs)}; "
                           f"(request, got, asked) that differ: {bad[:4]}")
    n_in, n_out = sum(len(p) for p in prompts), sum(lens)
    return {"requests": len(prompts), "max_num_seqs": int(spec.get("max_num_seqs", 64)), "prompt_tokens": n_in,
            "output_tokens": n_out, "seconds": dt, "output_tokens_per_s": n_out / dt,
            "total_tokens_per_s": (n_in + n_out) / dt, "first_output": outs[0][:8]}


def vllm_runner(spec: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """vLLM's offline ``LLM`` on the HF directory ``spec["model"]`` (CPU; threads and KV space
    come from ``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_KVCACHE_SPACE``, set by the caller)."""
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=int(spec.get("max_model_len", 1024)),
              seed=0, disable_log_stats=True)

    def gen(prompt: Sequence[int], k: int) -> Sequence[int]:
        sp = SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)
        return out.outputs[0].token_ids

    return gen, {"version": vllm.__version__, "weights": spec.get("dtype", "bfloat16")}


def openvino_runner(spec: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """OpenVINO GenAI's ``LLMPipeline`` (CPU, paged-attention scheduler) on the IR directory
    ``spec["model"]``, ``INFERENCE_NUM_THREADS`` = threads."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    sched = og.SchedulerConfig()
    sched.cache_size = int(spec.get("kv_cache_gib", 1))
    pipe = og.LLMPipeline(spec["model"], "CPU", scheduler_config=sched,
                          INFERENCE_NUM_THREADS=int(spec["threads"]))

    def gen(prompt: Sequence[int], k: int) -> Sequence[int]:
        cfg = og.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = k, k, False
        ids = ov.Tensor(np.array([list(prompt)], dtype=np.int64))
        res = pipe.generate(ids, cfg)
        return list(res.tokens[0])

    return gen, {"version": og.__version__, "weights": "IR as converted"}


def openvino_batched_runner(spec: dict[str, Any]) -> tuple[GenerateMany, dict[str, Any]]:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the IR ``spec["model"]``, one pipeline
    per concurrency (``SchedulerConfig.max_num_seqs`` = c, ``cache_size`` GiB of KV, no prefix
    caching, its other scheduler defaults), ``INFERENCE_NUM_THREADS`` = threads, greedy.

    The requests go in through ``add_request`` and ``step``, at most ``c`` in the pipeline at a
    time (a finished one makes room for the next): handed over at once through ``generate``, its
    scheduler ran every request together even with ``max_num_seqs`` = 1 (measured: 4 requests of 64
    tokens took 1.15 s at 1 and 1.10 s at 4, one alone 0.82 s). Raises ``RuntimeError`` for a
    request that ends other than finished."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    pipes: dict[int, Any] = {}
    facts: dict[str, Any] = {"version": og.__version__, "weights": "IR as converted", "scheduler": {},
                             "admission": "closed loop: add_request/step, at most c requests in the pipeline"}
    next_id = [0]

    def gen_many(prompts: Sequence[Sequence[int]], k: int, c: int) -> Sequence[Sequence[int]]:
        if c not in pipes:
            pipes.clear()
            sched = og.SchedulerConfig()
            sched.cache_size, sched.max_num_seqs = int(spec.get("kv_cache_gib", 1)), c
            sched.enable_prefix_caching = False
            pipes[c] = og.ContinuousBatchingPipeline(spec["model"], sched, "CPU",
                                                     {"INFERENCE_NUM_THREADS": int(spec["threads"])})
            facts["scheduler"][str(c)] = " ".join(sched.to_string().split())[:400]
        cfg = openvino_greedy(og, k)
        return drive_closed_loop(pipes[c], [tensor(p) for p in prompts], [cfg] * len(prompts), c,
                                 og.GenerationStatus, next_id)

    def tensor(prompt: Sequence[int]) -> Any:
        return ov.Tensor(np.array([list(prompt)], dtype=np.int64))

    return gen_many, facts


def openvino_greedy(og: Any, k: int) -> Any:
    """An OpenVINO GenAI ``GenerationConfig``: greedy, exactly ``k`` new tokens."""
    cfg = og.GenerationConfig()
    cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = k, k, False
    return cfg


def drive_closed_loop(pipe: Any, inputs: Sequence[Any], configs: Sequence[Any], c: int, status: Any,
                      next_id: list[int]) -> list[list[int]]:
    """Runs ``inputs`` (one input tensor per request, ``configs[i]`` its ``GenerationConfig``)
    through a ``ContinuousBatchingPipeline`` ``pipe`` by ``add_request`` / ``step``, at most
    ``c`` requests in the pipeline at a time, the next admitted as one finishes (in order).
    ``status``: OpenVINO's ``GenerationStatus``; ``next_id``: the last request id used (a
    one-item list, advanced). Returns the generated token ids per request. Raises
    ``RuntimeError`` for a request that ends other than ``FINISHED``."""
    waiting, running = list(range(len(inputs))), {}
    out: list[list[int]] = [[] for _ in inputs]
    while waiting or running:
        while waiting and len(running) < c:
            i = waiting.pop(0)
            next_id[0] += 1
            running[i] = pipe.add_request(next_id[0], inputs[i], configs[i])
        pipe.step()
        for i, h in list(running.items()):
            st = h.get_status()
            if st == status.RUNNING:
                continue
            if st != status.FINISHED:
                raise RuntimeError(f"request {i} ended {st}")
            out[i] = list(h.read_all()[0].generated_ids)
            del running[i]
    return out


def vllm_trace_runner(spec: dict[str, Any]) -> tuple[GenerateTrace, dict[str, Any]]:
    """vLLM's offline ``LLM`` as in :func:`vllm_runner`, at most ``spec["max_num_seqs"]``
    (default 64) sequences at once; every request goes into one ``generate`` call with its own
    ``SamplingParams`` (greedy, exactly its output length, EOS ignored)."""
    import vllm
    from vllm import LLM, SamplingParams

    seqs = int(spec.get("max_num_seqs", 64))
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=int(spec.get("max_model_len", 1024)),
              max_num_seqs=seqs, seed=0, disable_log_stats=True)

    def gen_trace(prompts: Sequence[Sequence[int]], lens: Sequence[int]) -> Sequence[Sequence[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True) for k in lens]
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return gen_trace, {"version": vllm.__version__, "weights": spec.get("dtype", "bfloat16"), "max_num_seqs": seqs}


def openvino_trace_runner(spec: dict[str, Any]) -> tuple[GenerateTrace, dict[str, Any]]:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the IR ``spec["model"]`` with
    ``SchedulerConfig.max_num_seqs`` = ``spec["max_num_seqs"]`` (default 64), ``cache_size``
    GiB of KV, no prefix caching, ``INFERENCE_NUM_THREADS`` = threads; the requests go in by
    :func:`drive_closed_loop` with that many in the pipeline at a time, one greedy
    ``GenerationConfig`` per request (exactly its output length)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    seqs = int(spec.get("max_num_seqs", 64))
    sched = og.SchedulerConfig()
    sched.cache_size, sched.max_num_seqs = int(spec.get("kv_cache_gib", 1)), seqs
    sched.enable_prefix_caching = False
    pipe = og.ContinuousBatchingPipeline(spec["model"], sched, "CPU", {"INFERENCE_NUM_THREADS": int(spec["threads"])})
    next_id = [0]

    def gen_trace(prompts: Sequence[Sequence[int]], lens: Sequence[int]) -> Sequence[Sequence[int]]:
        inputs = [ov.Tensor(np.array([list(p)], dtype=np.int64)) for p in prompts]
        return drive_closed_loop(pipe, inputs, [openvino_greedy(og, k) for k in lens], seqs, og.GenerationStatus,
                                 next_id)

    return gen_trace, {"version": og.__version__, "weights": "IR as converted", "max_num_seqs": seqs,
                       "scheduler": " ".join(sched.to_string().split())[:400],
                       "admission": "add_request/step, at most max_num_seqs requests in the pipeline"}


# "openvino-fp16": the same runners on the fp16 IR (the caller passes its directory as "model")
RUNNERS = {"vllm": vllm_runner, "openvino": openvino_runner, "openvino-fp16": openvino_runner}
BATCHED_RUNNERS = {"openvino": openvino_batched_runner, "openvino-fp16": openvino_batched_runner}
TRACE_RUNNERS = {"vllm": vllm_trace_runner, "openvino": openvino_trace_runner, "openvino-fp16": openvino_trace_runner}


def main(argv: Sequence[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    if spec.get("mode") == "batched":
        gen_many, facts = BATCHED_RUNNERS[spec["system"]](spec)
        result: dict[str, Any] = {"batched": measure_batched(gen_many, spec)}
    elif spec.get("mode") == "trace":
        gen_trace, facts = TRACE_RUNNERS[spec["system"]](spec)
        result = {"trace": measure_trace(gen_trace, spec)}
    else:
        gen, facts = RUNNERS[spec["system"]](spec)
        result = measure(gen, spec)
    print(json.dumps({"system": spec["system"], **facts, "threads": spec["threads"], "pid": os.getpid(),
                      **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
