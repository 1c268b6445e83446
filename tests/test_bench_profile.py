"""`jitney bench profile`: step-shape grid on the real engine, the cost-model fit and its held-out
error, and the served-vs-simulated comparison of the same traffic."""

from __future__ import annotations

import json
import random

import pytest

from jitney.bench.calibrate import EngineSettings, ProfileGrid, fit_profile, profile_engine, split_rows
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
    assert rc == 0 and "held-out" in text and "simulated vs measured" in text
    body = json.loads(out.read_text())
    sim, real = body["validation"]["simulated"], body["validation"]["measured"]
    assert sim["completed"] == real["completed"] == 6
    assert sim["total_output_tokens"] == real["total_output_tokens"]
    assert set(body["validation"]["errors"]) == {"mean_ttft_ms", "p95_tpot_ms", "output_throughput"}
    assert main(["bench", "profile", "--holdout", "2"]) == 2
    assert main(["bench", "profile", "--model", str(tiny_checkpoint("llama")), "--max-model-len", "100"]) == 2
    assert "grid cell prefill-128 needs 130 tokens" in capsys.readouterr().err
