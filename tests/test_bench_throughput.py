"""`jitney bench throughput` on a tiny real checkpoint: every engine in its own process does the
same forced-length work, and the table reports it against jitney chunked."""

from __future__ import annotations

import json

import pytest

from jitney.bench.datasets import LengthDist
from jitney.bench.throughput import EngineRun, ThroughputConfig, build_workload, format_table, median_run
from jitney.cli import main


def test_engines_produce_exactly_the_requested_tokens(tiny_checkpoint, tmp_path, capsys):
    ckpt = tiny_checkpoint("llama")
    out = tmp_path / "tp.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--model",
            str(ckpt),
            "--engines",
            "jitney-chunked,jitney-static,hf-generate",
            "--num-prompts",
            "6",
            "--input-len",
            "uniform:4,24",
            "--output-len",
            "uniform:2,10",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "4",
            "--hf-batch-size",
            "4",
            "--kv-cache-mib",
            "8",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert rc == 0, text
    runs = {r["engine"]: r for r in body["runs"]}
    assert set(runs) == {"jitney-chunked", "jitney-static", "hf-generate"}
    wanted = runs["jitney-chunked"]["requested_output_tokens"]
    for r in runs.values():
        assert r["ok"] and r["output_tokens"] == wanted and r["peak_rss_mib"] > 0 and r["wall_s"] > 0
        assert r["input_tokens"] == runs["jitney-chunked"]["input_tokens"]
    assert "| jitney-chunked |" in text and "x1.00" in text


def test_workload_is_the_same_for_every_engine_and_seeded():
    cfg = ThroughputConfig(
        num_prompts=5, input_len=LengthDist.parse("uniform:3,9"), output_len=LengthDist.parse("4")
    )
    a, b = build_workload(cfg, 100), build_workload(cfg, 100)
    assert (
        a == b and all(3 <= len(p) <= 9 and all(10 <= t < 100 for t in p) for p in a[0]) and a[1] == [4] * 5
    )


def test_bad_settings_are_refused_with_their_names(capsys):
    with pytest.raises(ValueError, match="engines must be among"):
        ThroughputConfig(engines=("vllm",))
    with pytest.raises(ValueError, match="dtype"):
        ThroughputConfig(dtype="int8")
    assert main(["bench", "throughput", "--engines", "nope", "--num-prompts", "1"]) == 2
    assert "engines must be among" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", "/no/such/model", "--engines", "hf-generate"]) == 2
    assert "not found" in capsys.readouterr().err


def test_table_shows_failures_and_ratios():
    runs = [
        EngineRun("jitney-chunked", True, wall_s=2.0, input_tokens=100, output_tokens=50, peak_rss_mib=400),
        EngineRun("hf-generate", True, wall_s=4.0, input_tokens=100, output_tokens=50, peak_rss_mib=200),
        EngineRun("hf-continuous", False, error="exit 1: boom"),
    ]
    table = format_table(runs)
    assert "| hf-generate | 12.5 | 37.5 | 4.00 | 200 | x0.50 | x0.50 |" in table
    assert "failed: exit 1: boom" in table


def test_repeated_rounds_report_each_engines_median_run_and_its_range():
    def run(wall: float) -> EngineRun:
        return EngineRun("jitney-chunked", True, wall_s=wall, input_tokens=100, output_tokens=60)

    rounds = [run(3.0), run(2.0), run(6.0)]  # 20, 30 and 10 output tok/s
    median = median_run(rounds)
    assert median.wall_s == 3.0 and median.round_output_tps == [20.0, 30.0, 10.0]
    assert "| jitney-chunked | 20.0 (10.0-30.0) |" in format_table([median])
    broken = EngineRun("jitney-chunked", False, error="exit 1: boom")
    assert median_run([run(3.0), broken]) is broken
