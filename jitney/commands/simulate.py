"""`jitney simulate`: the scheduler on a virtual clock. With no arguments, the seed's experiment:
static, continuous and chunked prefill on the same Poisson traffic."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jitney.cli import CliError

POLICIES = ("static", "continuous", "chunked")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate batching policies on a virtual clock", description=__doc__
    )
    t = p.add_argument_group("traffic")
    t.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, req/s (default 16)")
    t.add_argument("--duration", type=float, default=30.0, help="arrival window, seconds (default 30)")
    t.add_argument("--seed", type=int, default=1234, help="random seed of the traffic (default 1234)")
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier",
    )
    t.add_argument("--trace", help="replay a CSV/JSONL trace (arrival s, prompt_len, output_len[, priority])")
    t.add_argument(
        "--seed-units",
        action="store_true",
        help="reproduce the seed's defect: arrival seconds read as ms (a 30 ms burst)",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--policy", type=_policies, default=list(POLICIES), help="comma list of static,continuous,chunked"
    )
    s.add_argument(
        "--chunk", type=_int_list, default=[512], help="chunked prefill size(s), e.g. 128,512,2048"
    )
    s.add_argument("--max-num-seqs", type=int, default=32)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--queue", choices=("fcfs", "priority"), default="fcfs")
    s.add_argument("--num-blocks", type=int, help="KV pool size in blocks (default: never preempts)")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument(
        "--prefix-caching", action="store_true", help="enable prefix caching (prompts never share)"
    )
    c = p.add_argument_group("step cost")
    c.add_argument("--cost", choices=("linear", "roofline", "profile"), default="linear")
    c.add_argument("--model", default="seed-8b", help="roofline model preset or config.json path")
    c.add_argument("--hardware", default="h100-sxm", help="roofline hardware preset or 'local'")
    c.add_argument("--efficiency", type=float, help="roofline compute efficiency (MFU), overrides the preset")
    c.add_argument("--overhead-ms", type=float, default=0.2, help="roofline fixed per-step overhead (0.2 ms)")
    c.add_argument(
        "--profile", help="JSONL of measured steps {prefill_tokens, decode_tokens, context_tokens, ms}"
    )
    c.add_argument("--step-overhead-ms", type=float, default=0.20, help="linear: per-step overhead")
    c.add_argument("--prefill-ms-per-token", type=float, default=0.020, help="linear: per prefill token")
    c.add_argument("--decode-base-ms", type=float, default=0.40, help="linear: once per step with decodes")
    c.add_argument("--decode-per-seq-ms", type=float, default=0.030, help="linear: per decoding request")
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT, ms")
    o.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT, ms")
    o.add_argument("--json", dest="json_path", help="write one JSON object per policy to this file")
    o.add_argument("--plot", help="write PNG figures to this directory")
    o.add_argument("--sweep-rate", help="A:B:STEP: run every policy at each rate, mark saturation")
    o.add_argument("--no-fast-path", action="store_true", help="schedule every step (slower, same numbers)")
    p.set_defaults(func=run)


def _cost(args: argparse.Namespace):
    from jitney.sim.costs import LinearCost, ProfileCost, RooflineCost
    from jitney.sim.roofline import Roofline
    from jitney.sim.specs import resolve_hardware, resolve_model, with_overrides

    if args.cost == "linear":
        return LinearCost(
            args.step_overhead_ms, args.prefill_ms_per_token, args.decode_base_ms, args.decode_per_seq_ms
        )
    if args.cost == "roofline":
        hw = with_overrides(resolve_hardware(args.hardware), efficiency=args.efficiency)
        return RooflineCost(Roofline(resolve_model(args.model), hw, args.overhead_ms / 1000.0))
    if not args.profile:
        raise CliError("--cost profile needs --profile FILE (JSON lines of measured steps)")
    return ProfileCost.from_jsonl(args.profile)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise CliError(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}") from None


def _run(args: argparse.Namespace) -> int:
    from jitney.config import CacheConfig
    from jitney.metrics import SLO
    from jitney.sim.experiment import outcome_json, policy_runs, run_all, table, totals_check
    from jitney.sim.simulator import default_cache_config
    from jitney.sim.traffic import TrafficSpec, generate, load_trace

    wall0 = time.perf_counter()
    spec = TrafficSpec(args.rate, args.duration, args.seed, args.burstiness, args.seed_units)
    if args.trace and (args.sweep_rate or args.seed_units):
        raise CliError("--trace fixes the arrivals: it cannot be combined with --sweep-rate or --seed-units")
    items = load_trace(args.trace) if args.trace else generate(spec)
    if not items:
        raise CliError("the traffic holds no requests: raise --rate or --duration")
    cost = _cost(args)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    longest = max(it.prompt_len + it.output_len for it in items)

    def cache_for(its):
        if args.num_blocks is None:
            return default_cache_config(its, args.max_num_seqs, args.block_size, args.prefix_caching)
        return CacheConfig(args.block_size, args.num_blocks, args.prefix_caching)

    runs = policy_runs(
        args.policy,
        args.chunk,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        queue=args.queue,
        max_model_len=max(8192, longest),
    )
    if args.sweep_rate:
        return _sweep(args, spec, runs, cache_for, cost, slo, wall0)

    source = (
        f"trace {args.trace}"
        if args.trace
        else f"{'gamma k=' + format(args.burstiness, 'g') if args.burstiness != 1 else 'Poisson'} "
        f"{args.rate:g} req/s, {args.duration:g} s window, seed {args.seed}"
        + (" (seed units: arrivals squeezed into ms)" if args.seed_units else "")
    )
    print(f"traffic: {len(items)} requests, {source}")
    print(
        f"prompt ~{sum(i.prompt_len for i in items) / len(items):.0f} tokens, "
        f"output ~{sum(i.output_len for i in items) / len(items):.0f} tokens"
    )
    print(f"cost: {cost.describe()}\n")

    outcomes = run_all(
        items,
        runs,
        cache_for(items),
        cost,
        slo=slo,
        fast_path=not args.no_fast_path,
        record_timeline=bool(args.plot),
    )
    print("\n".join(table(outcomes)))
    ok, lines = totals_check(items, outcomes)
    print("\n".join(lines))
    for o in outcomes:
        if o.summary.request_goodput is not None:
            print(f"{o.run.label}: goodput {o.summary.request_goodput:.2f} req/s under the SLOs")
    if args.json_path:
        extra = {
            "cost": cost.describe(),
            "num_requests": len(items),
            "seed": args.seed,
            "rate": args.rate,
            "burstiness": args.burstiness,
            "seed_units": args.seed_units,
            "trace": args.trace,
        }
        Path(args.json_path).write_text(
            json.dumps([outcome_json(o, extra) for o in outcomes], indent=1) + "\n"
        )
        print(f"wrote {args.json_path}")
    if args.plot:
        from jitney.sim.plots import plot_all

        for path in plot_all(outcomes, Path(args.plot)):
            print(f"wrote {path}")
    print(f"simulated in {time.perf_counter() - wall0:.2f} s of wall time")
    return 0 if ok else 1


def _sweep(args, spec, runs, cache_for, cost, slo, wall0: float) -> int:
    from jitney.sim.experiment import outcome_json
    from jitney.sim.sweep import parse_rates, saturation_rates, sweep, sweep_table

    points = sweep(spec, parse_rates(args.sweep_rate), runs, cache_for, cost, slo)
    if not points:
        raise CliError("no rate in the sweep produced any request")
    print(f"sweep: {', '.join(r.label for r in runs)}; cost: {cost.describe()}\n")
    print("\n".join(sweep_table(points)))
    if args.json_path:
        sat = saturation_rates(points)
        rows = [
            outcome_json(
                p.outcome,
                {
                    "rate": p.rate,
                    "offered_rate": p.offered_rate,
                    "saturated": p.saturated,
                    "saturation_rate": sat[p.outcome.run.label],
                    "seed": args.seed,
                },
            )
            for p in points
        ]
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.json_path}")
    if args.plot:
        from jitney.sim.plots import plot_sweep

        Path(args.plot).mkdir(parents=True, exist_ok=True)
        path = Path(args.plot) / "sweep.png"
        plot_sweep(points, path)
        print(f"wrote {path}")
    print(f"simulated in {time.perf_counter() - wall0:.2f} s of wall time")
    return 0
