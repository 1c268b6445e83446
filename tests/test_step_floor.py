"""`python -m jitney.bench.step_floor`: the real engine's decode step against the local roofline."""

from __future__ import annotations

import json

import pytest

from jitney.bench.step_floor import main


def test_step_floor_times_decode_steps_and_states_the_fraction(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "floor.json"
    model = tiny_checkpoint("llama")
    rc = main(
        ["--model", str(model), "--batches", "1", "3", "--context", "24", "--steps", "3", "--json", str(out)]
    )
    assert rc == 0
    record = json.loads(out.read_text())
    assert [row["batch"] for row in record["steps"]] == [1, 3]
    for row in record["steps"]:
        assert row["measured_ms"] > 0 and row["floor_ms"] > 0 and row["bound"] in ("memory", "compute")
        assert row["fraction"] == pytest.approx(row["floor_ms"] / row["measured_ms"])
    assert record["machine"]["bandwidth_gb_s"] > 0
    assert "| 3 | 24 |" in capsys.readouterr().out


def test_step_floor_refuses_bad_arguments(tiny_checkpoint, tmp_path, capsys):
    assert main(["--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    doc = tmp_path / "no-markers.md"
    doc.write_text("text\n")
    assert main(["--model", str(tiny_checkpoint("llama")), "--doc", str(doc)]) == 2
    assert "step-floor:begin" in capsys.readouterr().err
