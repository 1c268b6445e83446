"""Traffic generators and trace replay; the profile cost model's fit."""

from __future__ import annotations

import json
import statistics

import pytest

from jitney.cli import main
from jitney.sim import ProfileCost, StepShape, TrafficSpec, generate, load_trace


def test_seed_generator_draws_the_seeds_workload():
    items = generate(TrafficSpec())
    assert len(items) == 429
    assert round(statistics.mean(i.prompt_len for i in items)) == 1051
    assert round(statistics.mean(i.output_len for i in items)) == 129
    assert all(64 <= i.prompt_len <= 4096 and 16 <= i.output_len <= 384 for i in items)
    assert items[-1].arrival < 30.0 and items[-1].arrival > 29.0


def test_seed_units_squeeze_the_window_into_milliseconds():
    real = generate(TrafficSpec())
    burst = generate(TrafficSpec(seed_units=True))
    assert [(b.prompt_len, b.output_len) for b in burst] == [(r.prompt_len, r.output_len) for r in real]
    assert burst[-1].arrival == pytest.approx(real[-1].arrival / 1000)
    assert burst[-1].arrival < 0.03


def test_gamma_with_shape_one_is_the_poisson_stream_and_lower_shapes_are_burstier():
    assert generate(TrafficSpec(burstiness=1.0)) == generate(TrafficSpec())

    def cv(items):
        gaps = [b.arrival - a.arrival for a, b in zip(items, items[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    spec = TrafficSpec(duration_s=300.0)
    bursty = generate(TrafficSpec(duration_s=300.0, burstiness=0.25))
    assert cv(bursty) > 1.5 * cv(generate(spec))
    assert len(bursty) == pytest.approx(len(generate(spec)), rel=0.2)  # same mean rate


def test_bad_traffic_parameters_are_rejected():
    for kwargs, field in (
        ({"rate": 0}, "rate"),
        ({"duration_s": -1}, "duration"),
        ({"burstiness": 0}, "burstiness"),
    ):
        with pytest.raises(ValueError, match=field):
            TrafficSpec(**kwargs)


def test_csv_and_jsonl_traces_replay_sorted_by_arrival(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival,prompt_len,output_len,priority\n1000.5,100,10,1\n1000.25,50,5,\n")
    items = load_trace(csv_path)  # sorted, and shifted so the first arrives at 0
    assert [(i.arrival, i.prompt_len, i.output_len, i.priority) for i in items] == [
        (0.0, 50, 5, 0),
        (0.25, 100, 10, 1),
    ]
    jl = tmp_path / "t.jsonl"
    jl.write_text(json.dumps({"arrival_time": 0.0, "prompt_tokens": 7, "output_tokens": 3}) + "\n\n")
    assert load_trace(jl)[0].prompt_len == 7


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "arrival,prompt_len\n0,5\n", "a.csv:2: missing a column named one of output_len"),
        ("b.csv", "arrival,prompt_len,output_len\nsoon,5,5\n", "b.csv:2"),
        ("c.jsonl", '{"arrival": 0, "prompt_len": 0, "output_len": 3}\n', "lengths must be >= 1"),
        ("d.jsonl", "[1, 2]\n", "a JSON object per line"),
        ("e.csv", "arrival,prompt_len,output_len\n", "holds no requests"),
        ("f.csv", "arrival,prompt_len,output_len\n-1,5,5\n", "arrival must be"),
    ],
)
def test_bad_traces_name_the_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_trace(path)


def test_trace_runs_through_the_cli(tmp_path, capsys):
    path = tmp_path / "trace.csv"
    path.write_text(
        "arrival,prompt_len,output_len\n" + "".join(f"{i * 0.01},{64 + i},{8 + i % 5}\n" for i in range(30))
    )
    assert main(["simulate", "--trace", str(path), "--policy", "chunked"]) == 0
    assert "30 of 30 finished: ok" in capsys.readouterr().out


def test_profile_fit_recovers_a_known_plane_and_reports_its_error(tmp_path):
    path = tmp_path / "steps.jsonl"
    rows = []
    for p in (0, 64, 256, 512):
        for d in (0, 1, 8, 32):
            for c in (0, 1000, 5000):
                ms = 1.5 + 0.01 * p + 0.2 * d + 0.0004 * c
                rows.append(
                    json.dumps({"prefill_tokens": p, "decode_tokens": d, "context_tokens": c, "ms": ms})
                )
    path.write_text("\n".join(rows) + "\n")
    cost = ProfileCost.from_jsonl(path)
    assert cost.intercept_ms == pytest.approx(1.5, abs=1e-9)
    assert cost.ms_per_prefill_token == pytest.approx(0.01, abs=1e-12)
    assert cost.ms_per_context_token == pytest.approx(0.0004, abs=1e-12)
    assert cost.fit.rmse_ms < 1e-9 and cost.fit.r2 == pytest.approx(1.0)
    assert cost.step_seconds(StepShape(100, 4, 2000)) == pytest.approx((1.5 + 1.0 + 0.8 + 0.8) / 1000)
    assert "RMSE" in cost.describe()


def test_profile_fit_reports_a_noisy_fit_honestly():
    rows = [
        (p, d, 0, 1.0 + 0.01 * p + (0.5 if i % 2 else -0.5))
        for i, (p, d) in enumerate((p, d) for p in (0, 100, 200, 300) for d in (0, 4, 8))
    ]
    fit = ProfileCost.fit_samples(rows).fit
    assert fit.rmse_ms == pytest.approx(0.5, rel=0.2) and fit.mean_abs_pct_error > 5


def test_bad_profiles_are_rejected(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prefill_tokens": 1, "decode_tokens": 2}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        ProfileCost.from_jsonl(path)
    with pytest.raises(ValueError, match="at least 4"):
        ProfileCost.fit_samples([(1, 1, 1, 1.0)])


def test_profile_written_by_the_real_engine_drives_the_simulator(tiny_checkpoint, tmp_path, capsys):
    from jitney.llm import LLM
    from jitney.request import SamplingParams

    path = tmp_path / "steps.jsonl"
    llm = LLM(
        tiny_checkpoint("llama"),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        profile_path=path,
    )
    try:
        prompts = [[5 + i] * (20 + 15 * i) for i in range(6)]
        llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0), use_tqdm=False)
    finally:
        llm.close()
    cost = ProfileCost.from_jsonl(path)
    assert cost.fit.num_samples >= 10 and cost.fit.rmse_ms >= 0
    assert (
        main(
            [
                "simulate",
                "--cost",
                "profile",
                "--profile",
                str(path),
                "--duration",
                "2",
                "--rate",
                "2",
                "--policy",
                "chunked",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "profile:" in out and "RMSE" in out and "finished: ok" in out
