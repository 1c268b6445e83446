"""`jitney bench {slots,serve,compare,throughput,profile}`: measurements of the engine and its peers.

Heavy imports (torch, httpx, matplotlib) happen inside each subcommand, so `jitney --help` stays
fast.
"""

from __future__ import annotations

import argparse

from jitney.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks: slots, serve, compare, throughput, profile")
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_slots(sub)
    for extra in (_register_serve, _register_compare, _register_throughput, _register_profile):
        extra(sub)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


# ---- slots ------------------------------------------------------------------------------------


def _register_slots(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slots", help="the seed's task 08.2: pad-to-max waves vs continuous slot refilling")
    p.add_argument("--num-requests", type=_positive_int, default=64)
    p.add_argument("--batch-sizes", type=_int_list, default=[8, 32], help="comma-separated (default 8,32)")
    p.add_argument("--min-output-len", type=_positive_int, default=64)
    p.add_argument("--max-output-len", type=_positive_int, default=512)
    p.add_argument("--repeats", type=_positive_int, default=1, help="report the median of N runs")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    p.set_defaults(func=_run_slots)


def _run_slots(args: argparse.Namespace) -> int:
    from jitney.bench.slots import SlotsConfig, format_table, run_all

    cfg = SlotsConfig(
        num_requests=args.num_requests,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
        batch_sizes=tuple(args.batch_sizes),
        repeats=args.repeats,
        num_threads=args.threads,
    )
    runs = run_all(cfg)
    print(f"{cfg.num_requests} requests, {runs[0].tokens} output tokens, TinyLM (embedding + "
          f"{cfg.num_blocks} MLP blocks + lm_head), torch.manual_seed({cfg.torch_seed})\n")
    print(format_table(runs))
    return 0


def _register_serve(sub: argparse._SubParsersAction) -> None:
    pass


def _register_compare(sub: argparse._SubParsersAction) -> None:
    pass


def _register_throughput(sub: argparse._SubParsersAction) -> None:
    pass


def _register_profile(sub: argparse._SubParsersAction) -> None:
    pass


__all__ = ["register", "CliError"]
