"""``pagedkv generate`` and ``pagedkv chat``, plus the engine options every model command shares."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from pagedkv.errors import ConfigError, InvalidRequestError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate, chat, serve and the benchmarks."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF safetensors dir or a bundled model's name: smollm2-135m-instruct (default), "
                        "gemma-3-270m (a base model: plain completions)")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    g.add_argument("--weights", default="auto",
                   help="linear weights: auto (a GGUF's stored blocks, a checkpoint's own dtype: never changes the "
                        "model's numbers) | gguf | fp32 | bf16 | int8 | int4 (int8/int4 requantise)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache format: auto (= --dtype) | float32 | bfloat16 | float16 | int8 | fp8_e4m3 | "
                        "fp8_e5m2 (int8/fp8: one-byte codes + an bf16 scale per group of each head vector)")
    g.add_argument("--kv-quant-group-size", type=int, default=None,
                   help="elements per scale of an int8/fp8 KV cache (default: head_dim; must divide it)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-cache-memory", default=None, help='KV cache budget, e.g. "1GiB" (default 1GiB)')
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--disable-paging", action="store_true", help="no paging: each request reserves max_model_len tokens of contiguous KV up front (the baseline paging is measured against)")
    g.add_argument("--attention-backend", default="cpu")
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks with torch.distributed (default 1; see docs/distributed.md)")
    g.add_argument("--kv-offload", action="append", default=None, metavar="TIER",
                   help="a tier behind the KV pool, fastest first (repeatable): host:4GiB, disk:PATH:50GiB; "
                        "turns prefix caching on (docs/kv_tiers.md)")
    g.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV events over ZeroMQ, e.g. tcp://127.0.0.1:5557 (replay socket: port + 1)")
    g.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="the replay socket's endpoint")
    g.add_argument("--compile-decode", action="store_true",
                   help="run decode steps (<= 64 tokens) through torch.compile: ~80 s per graph at the first start "
                        "on a 2-core CPU, cached under ~/.cache/pagedkv/inductor (docs/performance.md)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels on every route: a request's tokens do not depend on the batch, the "
                        "chunk budget, prefix hits or threads (GGUF models are anyway; docs/determinism.md)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file in place of the model's own (a base model has none)")
    g.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL",
                   help="speculative decoding: ngram = prompt lookup, drafts from the request's own context; "
                        "draft:MODEL = greedy drafts from a smaller model with the same tokenizer (a GGUF/HF path "
                        "or a bundled name, e.g. draft:smollm2-135m) (docs/speculative_decoding.md)")
    g.add_argument("--draft-weights", default="auto",
                   help="the draft model's linear-layer format, as --weights (default auto)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens per decode row (default 4)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    return dict(
        dtype=args.dtype, weights=args.weights, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype, kv_quant_group_size=args.kv_quant_group_size,
        num_blocks=args.num_blocks, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enable_paging=not args.disable_paging,
        attention_backend=args.attention_backend, policy=args.policy, seed=args.seed,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        kv_offload=getattr(args, "kv_offload", None), kv_events=getattr(args, "kv_events", None),
        kv_events_replay=getattr(args, "kv_events_replay", None),
        compile_decode=getattr(args, "compile_decode", False), deterministic=getattr(args, "deterministic", False),
        chat_template=getattr(args, "chat_template", None),
        speculative=getattr(args, "speculative", None), num_speculative_tokens=getattr(args, "num_speculative_tokens", 4),
        draft_weights=getattr(args, "draft_weights", "auto"),
    )


def _sampling(args: argparse.Namespace):
    from pagedkv.engine.request import SamplingParams

    sp = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sample_seed, stop=args.stop or None,
        ignore_eos=getattr(args, "ignore_eos", False), n=getattr(args, "n", 1),
    )
    sp.validate()  # before the model loads: bad flags fail at once
    return sp


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt (default 128; "
                   "Python's SamplingParams: 16, the server: OpenAI's, up to the context)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _make_llm(args: argparse.Namespace):
    from pagedkv.engine.llm import LLM

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    t0 = time.time()
    llm = LLM(args.model, **engine_kwargs(args))
    kv = llm.engine.kv_summary()
    print(
        f"[pagedkv] model loaded in {time.time() - t0:.1f}s, weights {llm.engine.loaded.weights} "
        f"({llm.engine.loaded.weights_reason}); KV cache ({kv['kv_cache_dtype']}): {kv['num_blocks']} blocks x "
        f"{kv['block_size']} tokens = {kv['tokens']} tokens ({kv['bytes'] / 2**20:.0f} MiB, "
        f"{kv['bytes_per_token']} B/token); max concurrency at max_model_len "
        f"{kv['max_model_len']}: {kv['max_concurrency_at_max_model_len']:.2f}",
        file=sys.stderr,
    )
    if llm.engine.loaded.report is not None:
        print(f"[pagedkv] weights: {llm.engine.loaded.report.summary()}", file=sys.stderr)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    prompts: list[Any] = list(args.prompts)
    if args.input:
        try:
            with open(args.input) as f:
                lines = [ln for ln in f if ln.strip()]
        except OSError as e:
            raise InvalidRequestError(f"--input: cannot read {args.input}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"--input line {n}: not JSON ({e.msg})") from None
            if isinstance(rec, dict) and (set(rec) - {"prompt", "messages"} or len(rec) != 1):
                # sampling settings are the command's options, for every line: a key such as
                # "max_tokens" would otherwise be ignored without a word
                extra = sorted(set(rec) - {"prompt", "messages"})
                raise InvalidRequestError(
                    f"--input line {n}: " + (f"unknown key(s) {', '.join(map(repr, extra))}; " if extra else "")
                    + 'a line is a string, {"prompt": "..."} or {"messages": [...]} (sampling settings are '
                    "the command's options, e.g. --max-tokens)")
            p = rec if isinstance(rec, str) else next(iter(rec.values())) if isinstance(rec, dict) else None
            if not isinstance(p, (str, list)):
                raise InvalidRequestError(
                    f'--input line {n}: expected a string, {{"prompt": "..."}} or {{"messages": [...]}}'
                )
            prompts.append(p)
    if not prompts:
        raise InvalidRequestError("no prompts: give them as arguments or with --input FILE.jsonl")
    sp = _sampling(args)
    if args.output:  # fail before the run, not after it
        try:
            open(args.output, "a").close()
        except OSError as e:
            raise InvalidRequestError(f"--output: cannot write {args.output}: {e.strerror}") from None
    llm = _make_llm(args)
    raw = args.raw
    if not raw and not llm.engine.has_chat_template:  # a base model: plain completions
        print(f"[pagedkv] {llm.engine.model_id} has no chat template (a base model): prompts run as plain "
              "completions (--chat-template FILE gives it one)", file=sys.stderr)
        raw = True
    token_prompts = []
    for p in prompts:
        if isinstance(p, list):  # chat messages from a JSONL record
            token_prompts.append(llm.engine.apply_chat_template(p))
        elif raw:
            token_prompts.append(p)
        else:
            token_prompts.append(llm.engine.apply_chat_template([{"role": "user", "content": p}]))
    t0 = time.time()
    outs = llm.generate(token_prompts, sp, use_tqdm=not args.json)
    dt = time.time() - t0
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    records = []
    for p, o in zip(prompts, outs):
        rec = {"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
               "num_prompt_tokens": len(o.prompt_token_ids), "ttft_s": o.metrics.ttft}
        if len(o.outputs) > 1:
            rec["outputs"] = [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in o.outputs]
        records.append(rec)
    stats = llm.engine.get_stats()
    summary = {"elapsed_s": dt, "output_tokens": n_out, "output_tokens_per_s": n_out / dt if dt else 0.0,
               "requests": len(outs), "preemptions": stats.num_preemptions,
               "peak_running": stats.peak_running, "kv_blocks": stats.num_blocks}
    if args.output:
        with open(args.output, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    if args.json:
        print(json.dumps({"results": records, "summary": summary}, indent=2))
    elif not args.output:
        for r in records:
            print(f"\n>>> {r['prompt'] if isinstance(r['prompt'], str) else json.dumps(r['prompt'])}")
            print(r["text"])
            print(f"    [{len(r['token_ids'])} tokens, finish_reason={r['finish_reason']}]")
    print(
        f"[pagedkv] {len(outs)} request{'s' if len(outs) != 1 else ''}, {n_out} output tokens in {dt:.2f}s = "
        f"{summary['output_tokens_per_s']:.1f} tok/s; preemptions {summary['preemptions']}, "
        f"peak running {summary['peak_running']}, KV blocks {summary['kv_blocks']}",
        file=sys.stderr,
    )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    sp = _sampling(args)
    llm = _make_llm(args)
    if not llm.engine.has_chat_template:
        raise InvalidRequestError(f"pagedkv chat: {llm.engine.model_id} has no chat template (a base model); "
                                  "use `pagedkv generate` for plain completions or pass --chat-template FILE")
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagedkv chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        out = llm.chat(history, sp, use_tqdm=False)[0]
        print(f"assistant> {out.text}")
        history.append({"role": "assistant", "content": out.text})
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for prompts (chat template by default)")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--input", help="JSONL file: one prompt per line: a string, {'prompt': ...} or "
                                    "{'messages': [...]} (sampling from the options, for every line)")
    p.add_argument("--output", help="write results as JSONL here")
    p.add_argument("--raw", action="store_true", help="plain completion (no chat template)")
    p.add_argument("--json", action="store_true", help="machine-readable output (text and token ids)")
    p.add_argument("--n", type=int, default=1, help="parallel samples per prompt")
    p.add_argument("--ignore-eos", action="store_true")
    _add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    c = subparsers.add_parser("chat", help="interactive chat with the model")
    c.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)
