"""``pagedkv example`` (seed §03/§07 worked example) and ``pagedkv plan`` (KV capacity)."""

from __future__ import annotations

import argparse
import json

from pagedkv.errors import ConfigError


def _int_list(field: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{field}: expected comma-separated integers, got {text!r}") from None


def run_example(args: argparse.Namespace) -> int:
    from pagedkv.examples.seed_example import example_json, format_example, worked_example

    lengths = _int_list("lengths", args.lengths)
    sizes = _int_list("block_size", args.block_size)
    if not sizes:
        raise ConfigError("block_size: give at least one block size")
    results = [worked_example(lengths, args.max_len, bs, args.seed) for bs in sizes]
    print(json.dumps(example_json(results), indent=2) if args.json else format_example(results))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from pagedkv.examples.capacity_plan import format_plan, plan

    p = plan(model=args.model, kv_budget=args.kv_budget, dtype=args.dtype,
             block_size=args.block_size, tp_size=args.tp, max_model_len=args.max_model_len,
             workload=args.workload, kv_cache_dtype=args.kv_cache_dtype,
             quant_group_size=args.kv_quant_group_size)
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedkv.examples.seed_example import EXAMPLE_SHUFFLE_SEED

    p = subparsers.add_parser("example", help="worked example: three requests' block tables, paged vs contiguous reservation")
    p.add_argument("--lengths", default="17,33,8", help="request lengths in tokens (default 17,33,8)")
    p.add_argument("--max-len", type=int, default=64, help="max reservation per request, tokens (default 64)")
    p.add_argument("--block-size", default="16", help="block size(s) in tokens, e.g. 16 or 8,16,32")
    p.add_argument("--seed", type=int, default=EXAMPLE_SHUFFLE_SEED,
                   help=f"random seed of the free-block order (default {EXAMPLE_SHUFFLE_SEED}: the block ids of "
                        "the project's design notes)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_example)

    q = subparsers.add_parser("plan", help="KV capacity plan: bytes/token, blocks, concurrency")
    q.add_argument("--model", default=None,
                   help="config.json (file or folder), GGUF file, or a shipped config name "
                        "(llama-3-8b, qwen2.5-7b, deepseek-v3, ...); default: the bundled model")
    q.add_argument("--kv-budget", default="20GiB", help="KV bytes per rank, e.g. 20GiB (default)")
    q.add_argument("--dtype", default=None, help="cache dtype: fp32 bf16 fp16 fp8 int8 int4 "
                                                  "(default: the config's, fp32 for GGUF)")
    q.add_argument("--kv-cache-dtype", default=None,
                   help="the engine's KV cache format: auto float32 bfloat16 float16 int8 fp8_e4m3 fp8_e5m2 "
                        "(int8/fp8: + one bf16 scale per group; the blocks the engine allocates)")
    q.add_argument("--kv-quant-group-size", type=int, default=None,
                   help="elements per scale of an int8/fp8 cache (default: head_dim)")
    q.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    q.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    q.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request (default: the model's max positions)")
    q.add_argument("--workload", default=None,
                   help="trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens), e.g. "
                        "../shared/workloads/azure_llm_2023_conv.csv")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=run_plan)
