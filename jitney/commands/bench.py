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
    print(
        f"{cfg.num_requests} requests, {runs[0].tokens} output tokens, TinyLM (embedding + "
        f"{cfg.num_blocks} MLP blocks + lm_head), torch.manual_seed({cfg.torch_seed})\n"
    )
    print(format_table(runs))
    return 0


# ---- serve ------------------------------------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _rate_list(text: str) -> list[float]:
    try:
        return [_rate(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from exc


def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load generator for any OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key")
    p.add_argument(
        "--dataset",
        choices=("random", "seed", "trace"),
        default="random",
        help="random token lengths, the seed's lognormal Poisson traffic, or a replayed trace",
    )
    p.add_argument(
        "--trace", help="CSV or JSON Lines trace (arrival, prompt_len, output_len) for --dataset trace"
    )
    p.add_argument(
        "--input-len",
        default="lognormal:256,0.6,16,1024",
        help="prompt lengths: N, uniform:LOW,HIGH or lognormal:MEDIAN,SIGMA,LOW,HIGH",
    )
    p.add_argument("--output-len", default="lognormal:128,0.6,16,512", help="output lengths, same forms")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix shared by every prompt")
    p.add_argument(
        "--vocab-size",
        type=_positive_int,
        help="random prompt ids are drawn below this (default: the tokenizer's vocabulary, else 500)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json (or its directory) to send text instead of token ids")
    p.add_argument("--num-prompts", type=_positive_int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seed-duration",
        type=_positive_float,
        default=30.0,
        help="window of the seed's traffic in seconds (--dataset seed)",
    )
    p.add_argument(
        "--request-rate", type=_rate, default=float("inf"), help="req/s (default inf: all at once)"
    )
    p.add_argument("--burstiness", type=_positive_float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=_positive_int, help="closed loop: at most N requests in flight")
    p.add_argument(
        "--num-warmups", type=int, default=1, help="requests sent first and left out of the figures"
    )
    p.add_argument("--slo-ttft-ms", type=_positive_float)
    p.add_argument("--slo-tpot-ms", type=_positive_float)
    p.add_argument(
        "--sweep-rate", type=_rate_list, help="comma-separated rates: find the highest meeting the SLOs"
    )
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="let the model stop early (outputs not forced)"
    )
    p.add_argument("--timeout", type=_positive_float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", dest="json_path", help="write vLLM-style result JSON here")
    p.add_argument("--plot", dest="plot_dir", help="write CDF, throughput and concurrency plots here")
    p.add_argument("--label", default="openai", help="backend name recorded in the JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import json
    import math
    from pathlib import Path

    from jitney.bench import datasets as ds
    from jitney.bench.client import ApiTarget, discover_model
    from jitney.bench.serve import (
        LoadConfig,
        format_summary,
        format_sweep,
        result_json,
        run_load,
        sweep_rates,
    )
    from jitney.metrics import SLO

    decode = None
    vocab = args.vocab_size
    if args.tokenizer:
        decode, tok_vocab = _load_tokenizer(args.tokenizer)
        vocab = vocab or tok_vocab
    tokens = ds.TokenSpace(vocab_size=vocab or 500, first_id=min(10, (vocab or 500) - 1))
    if args.dataset == "random":
        reqs = ds.random_requests(
            args.num_prompts,
            ds.LengthDist.parse(args.input_len),
            ds.LengthDist.parse(args.output_len),
            seed=args.seed,
            prefix_len=args.prefix_len,
            tokens=tokens,
        )
    elif args.dataset == "seed":
        rate = 16.0 if math.isinf(args.request_rate) else args.request_rate
        reqs = ds.seed_traffic(
            rate, args.seed_duration, seed=args.seed or 1234, burstiness=args.burstiness, tokens=tokens
        )[: args.num_prompts]
    else:
        if not args.trace:
            raise CliError("--dataset trace needs --trace FILE")
        reqs = ds.trace_requests(args.trace, seed=args.seed, tokens=tokens)[: args.num_prompts]
    if args.endpoint == "chat" or decode is not None:
        if decode is None:
            raise CliError(
                "the chat endpoint sends text: pass --tokenizer to turn random token ids into text"
            )
        reqs = ds.with_text_prompts(reqs, decode)

    model = args.model or discover_model(args.base_url, args.api_key)
    target = ApiTarget(
        args.base_url, model, args.endpoint, api_key=args.api_key, ignore_eos=not args.no_ignore_eos
    )
    cfg = LoadConfig(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        timeout_s=args.timeout,
        show_progress=not args.no_progress,
    )
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)

    if args.sweep_rate:
        points, capacity = sweep_rates(target, reqs, args.sweep_rate, cfg, slo)
        print(format_sweep(points, capacity, slo))
        if args.json_path:
            body = {
                "capacity_req_s": capacity,
                "good_share": 0.9,
                "runs": [result_json(p.result, target, slo, label=args.label) for p in points],
            }
            Path(args.json_path).write_text(json.dumps(body, indent=1))
        if args.plot_dir:
            from jitney.bench.plots import plot_sweep

            print(f"plot: {plot_sweep(points, args.plot_dir, slo)}")
        return 0

    result = run_load(target, reqs, cfg)
    print(format_summary(result, slo))
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(result_json(result, target, slo, label=args.label), indent=1)
        )
    if args.plot_dir:
        from jitney.bench.plots import plot_run

        for path in plot_run(result, args.plot_dir, slo):
            print(f"plot: {path}")
    return 0 if any(r.success for r in result.records) else 1


def _load_tokenizer(path: str):
    """(decode(ids) -> text, vocabulary size) from a tokenizer.json file or its directory."""
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    tok = Tokenizer.from_file(str(p))
    return (lambda ids: tok.decode(ids)), tok.get_vocab_size()


# ---- compare ----------------------------------------------------------------------------------


def _register_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two result JSON files side by side with the relative error per field")
    p.add_argument("a", help="first run (e.g. the simulated one)")
    p.add_argument("b", help="second run, the reference (e.g. the measured one)")
    p.add_argument("--select-a", help="which run of A, when the file holds several (key or label)")
    p.add_argument("--select-b", help="which run of B, when the file holds several")
    p.add_argument("--fields", help="comma-separated field names (default: counts, throughputs, latencies)")
    p.add_argument("--names", default="sim,real", help="column titles for A and B (default sim,real)")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from jitney.bench.compare import DEFAULT_FIELDS, compare, format_compare, load_run

    names = [n.strip() for n in args.names.split(",")]
    if len(names) != 2 or not all(names):
        raise CliError(f"--names takes two comma-separated titles, got {args.names!r}")
    fields = tuple(f.strip() for f in args.fields.split(",") if f.strip()) if args.fields else DEFAULT_FIELDS
    a = load_run(args.a, args.select_a)
    b = load_run(args.b, args.select_b)
    diffs = compare(a, b, fields)
    if not diffs:
        raise CliError(f"neither file has any of the fields {', '.join(fields)}")
    print(format_compare(diffs, *names))
    return 0


# ---- throughput -------------------------------------------------------------------------------


def _register_throughput(sub: argparse._SubParsersAction) -> None:
    from jitney.bench.throughput_worker import ENGINES

    p = sub.add_parser("throughput", help="offline throughput: jitney policies vs Hugging Face baselines")
    p.add_argument(
        "--model", help="checkpoint directory, .gguf file or known name (default: the bundled model)"
    )
    p.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}"
    )
    p.add_argument("--num-prompts", type=_positive_int, default=200)
    p.add_argument(
        "--input-len", default="lognormal:256,0.6,16,1024", help="N, uniform:LO,HI or lognormal:MED,SIG,LO,HI"
    )
    p.add_argument("--output-len", default="lognormal:128,0.6,16,512")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument(
        "--max-num-seqs", type=_positive_int, default=32, help="jitney and HF continuous batch limit"
    )
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    p.add_argument("--hf-batch-size", type=_positive_int, default=32, help="padded batch size of HF generate")
    p.add_argument("--threads", type=_positive_int, help="torch threads in every engine (default: torch's)")
    p.add_argument(
        "--kv-cache-mib", type=_positive_int, help="jitney's KV pool size (default: its own sizing)"
    )
    p.add_argument(
        "--repeats", type=_positive_int, default=1, help="rounds of all engines, alternating; medians shown"
    )
    p.add_argument("--timeout", type=_positive_float, default=3600.0, help="per engine, seconds")
    p.add_argument(
        "--cache-dir", default=".cache/jitney-bench", help="where a GGUF model is dequantized once"
    )
    p.add_argument("--json", dest="json_path", help="write the results as JSON here")
    p.set_defaults(func=_run_throughput)


def _run_throughput(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from jitney.bench.datasets import LengthDist
    from jitney.bench.throughput import ThroughputConfig, format_table, run_all

    cfg = ThroughputConfig(
        model=args.model,
        engines=tuple(e.strip() for e in args.engines.split(",") if e.strip()),
        num_prompts=args.num_prompts,
        input_len=LengthDist.parse(args.input_len),
        output_len=LengthDist.parse(args.output_len),
        seed=args.seed,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        hf_batch_size=args.hf_batch_size,
        threads=args.threads,
        kv_cache_mib=args.kv_cache_mib,
        repeats=args.repeats,
        timeout_s=args.timeout,
        cache_dir=Path(args.cache_dir),
    )
    model_dir, runs = run_all(cfg, progress=lambda line: print(line, flush=True))
    print(
        f"\nmodel {model_dir}, {args.dtype}, {cfg.num_prompts} requests, input {cfg.input_len}, "
        f"output {cfg.output_len} (forced), seed {cfg.seed}\n"
    )
    print(format_table(runs))
    if args.json_path:
        body = {
            "model": str(model_dir),
            "dtype": cfg.dtype,
            "num_prompts": cfg.num_prompts,
            "input_len": str(cfg.input_len),
            "output_len": str(cfg.output_len),
            "seed": cfg.seed,
            "runs": [
                {**asdict(r), "output_throughput": r.output_tps, "total_token_throughput": r.total_tps}
                for r in runs
            ],
        }
        Path(args.json_path).write_text(json.dumps(body, indent=1))
    return 0 if all(r.ok for r in runs) else 1


# ---- profile ----------------------------------------------------------------------------------


def _register_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile engine steps, fit the simulator's cost model, validate it")
    p.add_argument(
        "--model", help="checkpoint directory, .gguf file or known name (default: the bundled model)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--max-num-seqs", type=_positive_int, default=32)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument("--num-blocks", type=_positive_int, default=1024)
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-model-len", type=_positive_int, default=2048)
    p.add_argument("--threads", type=_positive_int, help="torch threads of the profiled and served engine")
    p.add_argument("--prefill-lens", type=_int_list, default=[16, 64, 128, 256, 512])
    p.add_argument("--decode-batches", type=_int_list, default=[1, 4, 8, 16, 32])
    p.add_argument("--decode-contexts", type=_int_list, default=[64, 256])
    p.add_argument("--mixed-prompt", type=_positive_int, default=256, help="prompt that lands among decodes")
    p.add_argument("--repeats", type=_positive_int, default=2, help="times each grid cell is run")
    p.add_argument("--holdout", type=float, default=0.25, help="share of steps held out of the fit")
    p.add_argument("--out", default="profile.jsonl", help="JSON Lines profile to write")
    p.add_argument(
        "--no-validate", action="store_true", help="skip the serving runs (overhead fit and validation)"
    )
    p.add_argument("--num-prompts", type=_positive_int, default=40, help="validation requests")
    p.add_argument("--request-rate", type=_positive_float, default=1.0, help="validation Poisson rate, req/s")
    p.add_argument("--input-len", default="lognormal:128,0.6,16,512")
    p.add_argument("--output-len", default="lognormal:64,0.6,8,256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write fit, held-out error and validation here")
    p.set_defaults(func=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from jitney.bench import calibrate as cal
    from jitney.bench.compare import DEFAULT_FIELDS, compare, format_compare
    from jitney.bench.datasets import LengthDist, TokenSpace
    from jitney.model.registry import resolve_model

    if not 0 < args.holdout < 1:
        raise CliError(f"--holdout must be in (0, 1), got {args.holdout}")
    model = str(resolve_model(args.model).path)
    settings = cal.EngineSettings(
        model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        threads=args.threads,
    )
    grid = cal.ProfileGrid(
        prefill_lens=tuple(args.prefill_lens),
        decode_batches=tuple(args.decode_batches),
        decode_contexts=tuple(args.decode_contexts),
        mixed_prompt=args.mixed_prompt,
        repeats=args.repeats,
    )
    input_len, output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    profiled = cal.profile_engine(settings, grid, seed=args.seed)
    rows = profiled.rows
    path = cal.write_jsonl(rows, args.out)
    cost, held = cal.fit_profile(rows, args.holdout, args.seed)
    print(f"profile: {len(rows)} steps -> {path}")
    print(
        f"fit on {len(rows) - held.num_steps - held.num_trimmed} steps "
        f"({held.num_trimmed} interference outliers trimmed): {cost.describe()}"
    )
    print(
        f"held-out {held.num_steps} steps: median abs error {held.median_abs_pct_error:.1f}%, "
        f"mean abs error {held.mean_abs_pct_error:.1f}%, "
        f"RMSE {held.rmse_ms:.2f} ms, total time {held.total_time_error:+.1%}"
    )
    body: dict = {
        "settings": vars(settings),
        "profile": str(path),
        "fit": cost.describe(),
        "held_out": vars(held),
    }
    if not args.no_validate:
        vocab = profiled.vocab_size
        tokens = TokenSpace(vocab_size=vocab, first_id=min(10, vocab - 1))
        traffic = (args.num_prompts, input_len, output_len, args.request_rate)
        reqs = cal.poisson_traffic(*traffic, args.seed, tokens)
        # The serving fit uses other traffic: same distributions and rate, the next seed.
        train = cal.poisson_traffic(*traffic, args.seed + 1, tokens)
        step_log = Path(args.out).with_suffix(".serve_steps.jsonl")
        report = cal.calibrate_and_validate(settings, train, reqs, cost, step_log, seed=args.seed)
        print(f"\n{report.overhead.describe()} (training run's step log: {step_log})")
        print(f"served-steps fit: {report.served_fit.describe()}")
        print(
            f"\nsame traffic ({len(reqs)} requests, Poisson {args.request_rate:g} req/s), "
            "simulated (served-steps fit + serving overhead) vs measured:\n"
        )
        val = report.served
        print(format_compare(compare(val.simulated, val.measured, DEFAULT_FIELDS), "simulated", "measured"))
        models = (
            ("offline fit", report.offline),
            ("+ serving overhead", report.with_overhead),
            ("served-steps fit + serving overhead", report.served),
        )
        for label, v in models:
            print(
                f"\nheadline, {label}: "
                + ", ".join(f"{k} {e:+.1%}" if e is not None else f"{k} -" for k, e in v.errors.items())
            )
        body["serving_overhead"] = vars(report.overhead)
        body["served_fit"] = report.served_fit.describe()
        body["validation"] = {
            "simulated": val.simulated,
            "simulated_offline_fit": report.offline.simulated,
            "simulated_offline_fit_with_overhead": report.with_overhead.simulated,
            "measured": val.measured,
            "errors": val.errors,
            "errors_offline_fit": report.offline.errors,
            "errors_offline_fit_with_overhead": report.with_overhead.errors,
            "num_prompts": len(reqs),
            "request_rate": args.request_rate,
        }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(body, indent=1, default=str))
    return 0
