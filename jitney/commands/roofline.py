"""`jitney roofline`: weight and KV bytes, step times and tokens/s of a model on some hardware."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "roofline", help="roofline figures of a model on a GPU (or this machine)", description=__doc__
    )
    p.add_argument(
        "--model",
        default="seed-8b",
        help="preset (seed-8b, qwen3-8b, llama-3-8b, llama-3-70b, "
        "qwen2.5-7b, smollm2-135m) or a config.json path",
    )
    p.add_argument(
        "--hardware",
        default="h100-seed",
        help="preset (h100-sxm, h100-seed, h200, a100-80g, l4) or 'local' (measured now)",
    )
    p.add_argument("--batch", type=int, default=32, help="decode batch size (default 32)")
    p.add_argument(
        "--context", type=int, default=1024, help="mean context per request, tokens (default 1024)"
    )
    p.add_argument(
        "--request-tokens", type=int, help="request length for the KV pool count (default: context)"
    )
    p.add_argument(
        "--kv-pool-gib", type=float, help="KV pool size, GiB (default: 90%% of memory minus weights)"
    )
    p.add_argument(
        "--efficiency", type=float, help="compute efficiency (MFU) in (0, 1]; overrides the preset"
    )
    p.add_argument("--bandwidth", type=float, help="memory bandwidth, bytes/s; overrides the preset")
    p.add_argument("--flops", type=float, help="dense peak FLOP/s; overrides the preset")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="fixed per-step overhead (default 0)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jitney.sim.roofline import Roofline
    from jitney.sim.specs import GIB, resolve_hardware, resolve_model, with_overrides

    if args.batch < 1 or args.context < 1:
        raise ValueError(f"--batch and --context must be >= 1, got {args.batch}, {args.context}")
    if args.request_tokens is not None and args.request_tokens < 1:
        raise ValueError(f"--request-tokens must be >= 1, got {args.request_tokens}")
    if args.kv_pool_gib is not None and args.kv_pool_gib < 0:
        raise ValueError(f"--kv-pool-gib must be >= 0, got {args.kv_pool_gib}")
    model = resolve_model(args.model)
    hw = with_overrides(
        resolve_hardware(args.hardware),
        bandwidth=args.bandwidth,
        flops=args.flops,
        efficiency=args.efficiency,
    )
    pool = int(args.kv_pool_gib * GIB) if args.kv_pool_gib is not None else None
    figures = Roofline(model, hw, args.overhead_ms / 1000.0).figures(
        args.batch, args.context, request_tokens=args.request_tokens, kv_pool_bytes=pool
    )
    if args.json:
        print(json.dumps(figures.to_dict(), indent=1))
    else:
        print("\n".join(figures.lines()))
    return 0
