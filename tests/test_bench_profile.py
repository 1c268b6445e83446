"""`jitney bench profile`: step-shape grid on the real engine, the cost-model fit and its held-out
error, and the served-vs-simulated comparison of the same traffic."""

from __future__ import annotations

import json
import random

import pytest

from jitney.bench.calibrate import (
    EngineSettings,
    ProfileGrid,
    fit_profile,
    fit_serving_overhead,
    profile_engine,
    split_rows,
    with_serving_overhead,
)
from jitney.cli import main
from jitney.sim.costs import ProfileCost


def _plane(p: int, d: int, c: int) -> float:
    return 2.0 + 0.05 * p + 0.5 * d + 0.001 * c


def test_fit_recovers_a_known_plane_despite_interference_spikes():
    rng = random.Random(0)
    rows = []
    for i in range(200):
        p, d, c = rng.choice([0, 0, 16, 128, 512]), rng.randint(0, 32), rng.randint(0, 8000)
        ms = _plane(p, d, c) * rng.uniform(0.98, 1.02)
        if i % 25 == 0:
            ms += 150.0  # a descheduled thread
        rows.append({"prefill_tokens": p, "decode_tokens": d, "context_tokens": c, "ms": ms})
    cost, held = fit_profile(rows, holdout=0.25, seed=1)
    assert cost.ms_per_prefill_token == pytest.approx(0.05, rel=0.05)
    assert cost.ms_per_decode_token == pytest.approx(0.5, rel=0.05)
    assert held.num_trimmed >= 5 and held.num_steps == 50
    assert held.median_abs_pct_error < 3.0
    untrimmed, _ = fit_profile(rows, holdout=0.25, seed=1, trim=False)
    assert abs(untrimmed.intercept_ms - 2.0) > abs(cost.intercept_ms - 2.0)


def _step_log(gaps_ms: list[float], decodes: list[int], busy: list[bool]) -> list[dict]:
    """Steps of 5 ms each, separated by the given gaps."""
    rows, t = [], 100.0
    for gap, d, b in zip(gaps_ms, decodes, busy, strict=True):
        rows.append({"started_s": t, "ms": 5.0, "decode_tokens": d, "busy_after": b})
        t += (5.0 + gap) / 1e3
    return rows


def test_serving_overhead_fit_recovers_the_gap_and_skips_idle_and_descheduled_gaps():
    rng = random.Random(4)
    decodes = [rng.randint(0, 24) for _ in range(120)]
    gaps = [0.8 + 0.12 * d + rng.uniform(-0.05, 0.05) for d in decodes]
    busy = [True] * 120
    for i in range(0, 120, 10):  # idle: the engine waited for the next arrival
        busy[i], gaps[i] = False, rng.uniform(0.0, 400.0)
    gaps[5] = 900.0  # a descheduled server process
    over = fit_serving_overhead(_step_log(gaps, decodes, busy))
    assert over.num_gaps == 120 - 12 - 1 - 1  # idle ones, the 900 ms one, and no gap after the last
    assert over.intercept_ms == pytest.approx(0.8, abs=0.05)
    assert over.ms_per_decode_token == pytest.approx(0.12, rel=0.05)
    cost = ProfileCost(1.0, 0.5, 0.2, 0.001, fit=None)
    served = with_serving_overhead(cost, over)
    assert served.intercept_ms == pytest.approx(1.0 + over.intercept_ms)
    assert served.ms_per_decode_token == pytest.approx(0.2 + over.ms_per_decode_token)
    assert served.ms_per_prefill_token == 0.5 and served.name == "profile+serving"


def test_serving_overhead_coefficients_stay_non_negative_and_need_gaps():
    # Gaps that shrink with the batch would give a negative per-token cost: a constant instead.
    decodes = list(range(0, 40, 2))
    over = fit_serving_overhead(_step_log([3.0 - 0.05 * d for d in decodes], decodes, [True] * 20))
    # The mean of the 19 gaps (the last step has none after it).
    assert over.ms_per_decode_token == 0.0 and over.intercept_ms == pytest.approx(2.1, abs=0.01)
    with pytest.raises(ValueError, match="need at least 2"):
        fit_serving_overhead(_step_log([1.0, 1.0], [1, 2], [False, False]))


def test_holdout_split_is_disjoint_and_seeded():
    rows = [{"i": i} for i in range(40)]
    train, test = split_rows(rows, 0.25, seed=3)
    assert len(test) == 10 and len(train) == 30
    assert {r["i"] for r in train} | {r["i"] for r in test} == set(range(40))
    assert split_rows(rows, 0.25, seed=3) == (train, test)
    with pytest.raises(ValueError, match="held-out share"):
        split_rows(rows, 1.5)


def test_grid_steps_have_the_shapes_asked_for(tiny_checkpoint, tmp_path):
    settings = EngineSettings(
        str(tiny_checkpoint("llama")), max_num_batched_tokens=64, num_blocks=64, max_model_len=256, threads=1
    )
    grid = ProfileGrid(
        prefill_lens=(16, 48),
        decode_batches=(3,),
        decode_contexts=(20,),
        decode_steps=4,
        mixed_batches=(2,),
        mixed_prompt=100,
        repeats=1,
    )
    run = profile_engine(settings, grid)
    by_cell: dict[str, list[dict]] = {}
    for r in run.rows:
        by_cell.setdefault(r["cell"], []).append(r)
    assert by_cell["prefill-48"][0]["prefill_tokens"] == 48 and by_cell["prefill-48"][0]["decode_tokens"] == 0
    decodes = [r for r in by_cell["decode-b3-c20"] if r["prefill_tokens"] == 0]
    assert len(decodes) == 3 and all(r["decode_tokens"] == 3 for r in decodes)
    # The late 100-token prompt is chunked by the 64-token budget, next to the running decodes.
    mixed = [r for r in by_cell["mixed-b2-p100"] if r["prefill_tokens"] and r["decode_tokens"]]
    assert mixed and all(r["prefill_tokens"] + r["decode_tokens"] <= 64 for r in mixed)
    assert all(r["ms"] >= r["execute_ms"] > 0 for r in run.rows)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in run.rows))
    assert ProfileCost.from_jsonl(path).fit.num_samples == len(run.rows)


def test_cli_profiles_fits_and_compares_a_served_run_with_its_simulation(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "cal.json"
    rc = main(
        [
            "bench",
            "profile",
            "--model",
            str(tiny_checkpoint("llama")),
            "--prefill-lens",
            "16,64",
            "--decode-batches",
            "1,4",
            "--decode-contexts",
            "32",
            "--repeats",
            "1",
            "--num-blocks",
            "64",
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "64",
            "--num-prompts",
            "6",
            "--request-rate",
            "8",
            "--input-len",
            "uniform:8,40",
            "--output-len",
            "uniform:4,12",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "p.jsonl"),
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "held-out" in text and "serving overhead:" in text
    assert "headline, offline fit" in text and "headline, + serving overhead" in text
    assert "headline, served-steps fit + serving overhead" in text
    body = json.loads(out.read_text())
    # The overhead came from the training run's own step log, written by `jitney serve --step-log`.
    steps = [json.loads(line) for line in (tmp_path / "p.serve_steps.jsonl").read_text().splitlines()]
    assert steps and all({"started_s", "busy_after", "num_requests"} <= set(s) for s in steps)
    assert sum(s["decode_tokens"] for s in steps) > 0
    assert body["serving_overhead"]["num_gaps"] >= 2
    overhead = body["serving_overhead"]
    assert overhead["intercept_ms"] >= 0 and overhead["ms_per_decode_token"] >= 0
    sim, real = body["validation"]["simulated"], body["validation"]["measured"]
    assert sim["completed"] == real["completed"] == 6
    assert sim["total_output_tokens"] == real["total_output_tokens"]
    assert set(body["validation"]["errors"]) == {"mean_ttft_ms", "p95_tpot_ms", "output_throughput"}
    assert main(["bench", "profile", "--holdout", "2"]) == 2
    assert main(["bench", "profile", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "100"]) == 2
    assert "grid cell prefill-128 needs 130 tokens" in capsys.readouterr().err
