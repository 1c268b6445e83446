"""`jitney bench compare`: field-by-field relative errors between two result files."""

from __future__ import annotations

import json
import math

import pytest

from jitney.bench.compare import FieldDiff, compare, headline_errors, load_run
from jitney.cli import main
from jitney.metrics import RequestRecord, summarize


def _summary(scale: float) -> dict:
    """A real summary of three requests whose every latency is multiplied by ``scale``."""
    recs = [
        RequestRecord(0.0, 0.1 * scale, 0.5 * scale, 10, 5, tuple(0.1 * scale * (i + 1) for i in range(5))),
        RequestRecord(0.2, 0.2 + 0.2 * scale, 0.2 + 0.6 * scale, 20, 3, ()),
        RequestRecord(0.4, None, None, 30, 0, success=False, error="HTTP 400: no"),
    ]
    return summarize(recs, duration=2.0 * scale).to_dict()


def test_relative_errors_are_against_the_second_run():
    sim, real = _summary(1.1), _summary(1.0)
    errs = headline_errors(sim, real)
    assert errs["mean_ttft_ms"] == pytest.approx(0.1)
    assert errs["p95_tpot_ms"] == pytest.approx(0.1)
    assert errs["output_throughput"] == pytest.approx(1 / 1.1 - 1)
    assert FieldDiff("x", 0.0, 0.0).rel_error == 0.0 and math.isinf(FieldDiff("x", 1.0, 0.0).rel_error)
    assert FieldDiff("x", None, 2.0).rel_error is None
    same = compare(real, real)
    assert same and all(d.rel_error == 0.0 for d in same if d.name != "request_goodput")
    assert [d.rel_error for d in same if d.name == "request_goodput"] == [None]  # no SLO, no goodput


def test_nested_runs_are_found_and_selected(tmp_path):
    nested = tmp_path / "sim.json"
    nested.write_text(
        json.dumps({"runs": [{"policy": "static", **_summary(2.0)}, {"policy": "chunked", **_summary(1.0)}]})
    )
    assert load_run(nested, "chunked")["mean_ttft_ms"] == pytest.approx(_summary(1.0)["mean_ttft_ms"])
    with pytest.raises(ValueError, match="several runs"):
        load_run(nested)
    with pytest.raises(ValueError, match="no runs named 'x'"):
        load_run(nested, "x")
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="no run summary"):
        load_run(empty)


def test_cli_prints_both_columns_and_errors(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_summary(1.2)))
    b.write_text(json.dumps(_summary(1.0)))
    assert main(["bench", "compare", str(a), str(b), "--fields", "mean_ttft_ms,completed"]) == 0
    out = capsys.readouterr().out
    assert "| field | sim | real | rel. error |" in out
    assert "| mean_ttft_ms |" in out and "+20.0%" in out and "| completed | 2.00 | 2.00 | +0.0% |" in out
    assert main(["bench", "compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["bench", "compare", str(a), str(tmp_path / "bad.json")]) == 2
    assert "not JSON" in capsys.readouterr().err
