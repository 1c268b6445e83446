"""The simulator on the real scheduler: the seed's experiment, its interface, totals, preemption."""

from __future__ import annotations

import json
import math
import random

import pytest

from jitney.cli import main
from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.outputs import SchedulerOutput
from jitney.core.scheduler import Scheduler
from jitney.request import Request, SamplingParams
from jitney.sim import LinearCost, Req, TrafficItem, TrafficSpec, generate, run, shape_of, simulate
from jitney.sim.experiment import policy_runs, run_all
from jitney.sim.simulator import default_cache_config


def _seed_outcomes(**traffic):
    items = generate(TrafficSpec(**traffic))
    runs = policy_runs(
        ["static", "continuous", "chunked"],
        [512],
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        queue="fcfs",
        max_model_len=8192,
    )
    return items, {
        o.run.label: o for o in run_all(items, runs, default_cache_config(items, 32), LinearCost())
    }


def test_seed_workload_compares_the_policies_as_the_seed_expects():
    items, out = _seed_outcomes()
    assert len(items) == 429
    static, cont, chunked = (out[k].summary for k in ("static", "continuous", "chunked"))
    assert static.ttft.p(95) >= 10 * cont.ttft.p(95)
    assert chunked.tpot.p(95) <= cont.tpot.p(95)
    assert abs(chunked.output_throughput - cont.output_throughput) <= 0.15 * cont.output_throughput
    for o in out.values():
        assert o.result.all_finished and o.summary.completed == len(items)
        assert o.summary.total_output_tokens == sum(it.output_len for it in items)
    assert static.slot_utilization < 0.6 and cont.slot_utilization == 1.0


def test_same_seed_gives_identical_json_bit_for_bit(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["simulate", "--duration", "10", "--json", str(a)]) == 0
    assert main(["simulate", "--duration", "10", "--json", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    rows = json.loads(a.read_text())
    assert [r["policy"] for r in rows] == ["static", "continuous", "chunked"]
    for key in (
        "mean_ttft_ms",
        "p95_ttft_ms",
        "p95_tpot_ms",
        "output_throughput",
        "request_throughput",
        "median_itl_ms",
        "p99_e2el_ms",
        "completed",
        "duration",
    ):
        assert key in rows[0]
    assert main(["simulate", "--duration", "10", "--seed", "7", "--json", str(b)]) == 0
    assert a.read_bytes() != b.read_bytes()


def test_default_command_prints_the_table_and_the_totals_check(capsys):
    assert main(["simulate"]) == 0
    text = capsys.readouterr().out
    assert "429 requests" in text and "TTFT p95" in text
    assert text.count(": ok") == 3


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
@pytest.mark.parametrize("policy", ["static", "continuous", "chunked"])
def test_every_request_finishes_when_a_small_pool_forces_preemption(policy, queue):
    rng = random.Random(5)
    items = [
        TrafficItem(i * 0.002, rng.randint(40, 300), rng.randint(5, 120), priority=rng.randint(0, 3))
        for i in range(80)
    ]
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        policy=policy,
        long_prefill_token_threshold=128 if policy == "chunked" else 0,
        queue=queue,
    )
    # 40 blocks of 16 tokens: room for about two of the longest requests at once.
    result = run(
        items, sc, CacheConfig(block_size=16, num_blocks=40, enable_prefix_caching=False), LinearCost()
    )
    summary = result.summary()
    assert result.all_finished and not result.rejected
    assert summary.completed == len(items)
    assert summary.total_output_tokens == sum(it.output_len for it in items)
    if policy != "static":
        assert summary.num_preemptions > 0


def test_requests_that_never_fit_are_rejected_and_counted_as_failed():
    items = [TrafficItem(0.0, 100, 10), TrafficItem(0.01, 5000, 10)]
    sc = SchedulerConfig(max_num_seqs=4, policy="chunked", long_prefill_token_threshold=64)
    result = run(items, sc, CacheConfig(block_size=16, num_blocks=20), LinearCost())
    s = result.summary()
    assert (s.completed, s.failed) == (1, 1)
    assert "KV blocks" in result.rejected[0][1]


def test_static_slot_utilisation_is_the_seeds_14_7_percent():
    # One request of 2000 output tokens and seven of 50 in one wave of 8 slots.
    items = [TrafficItem(0.0, 64, 2000)] + [TrafficItem(0.0, 64, 50) for _ in range(7)]
    sc = SchedulerConfig(max_num_seqs=8, policy="static")
    result = run(items, sc, default_cache_config(items, 8), LinearCost())
    assert result.slot_utilization == pytest.approx(2350 / 16000)


def _seed_traffic_as_reqs() -> list[Req]:
    """The seed's make_traffic output handed to its interface as is (seconds in a field meant as ms)."""
    return [
        Req(i, it.arrival * 1000.0, it.prompt_len, it.output_len)
        for i, it in enumerate(generate(TrafficSpec(seed_units=True)))
    ]


def _pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] if lo == hi else xs[lo] * (hi - k) + xs[hi] * (k - lo)


@pytest.mark.parametrize(
    ("policy", "ttft_p50", "ttft_p95", "tok_s", "wall_s"),
    # The seed's sched_sim.py prints these for its own (burst) traffic.
    [
        ("static", 21491, 39544, 1347, 41.1),
        ("continuous", 5703, 10881, 4675, 11.8),
        ("chunked", 5709, 10895, 4669, 11.9),
    ],
)
def test_seed_interface_fills_reqs_and_reproduces_the_seed_program(policy, ttft_p50, ttft_p95, tok_s, wall_s):
    reqs = _seed_traffic_as_reqs()
    same, total_ms = simulate(policy, reqs)
    assert same is reqs
    assert all(r.first_tok is not None and r.finish is not None and r.finish >= r.first_tok for r in reqs)
    assert all(r.generated == r.out_len and r.prefill_done == r.prompt_len for r in reqs)
    ttft = [r.first_tok - r.arrival for r in reqs]
    assert _pct(ttft, 0.5) == pytest.approx(ttft_p50, abs=1)
    assert _pct(ttft, 0.95) == pytest.approx(ttft_p95, abs=1)
    assert sum(r.out_len for r in reqs) / total_ms * 1000 == pytest.approx(tok_s, abs=1)
    assert total_ms / 1000 == pytest.approx(wall_s, abs=0.05)


def test_step_shape_reads_chunks_and_padding_from_a_real_scheduler_output():
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, policy="chunked", long_prefill_token_threshold=32
        ),
        CacheConfig(block_size=16, num_blocks=64),
    )
    sched.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=4, ignore_eos=True)))
    out = sched.schedule()
    assert shape_of(out).prefill_tokens == 32 and shape_of(out).decode_tokens == 0
    assert shape_of(out).context_tokens == 32
    padded = SchedulerOutput(
        step_id=9, chunks=out.chunks, num_padding_decode_slots=3, num_padding_prefill_tokens=5
    )
    assert shape_of(padded).decode_tokens == 3 and shape_of(padded).prefill_tokens == 37


def test_linear_cost_is_the_seeds_step_cost():
    cost = LinearCost()
    assert cost.step_ms(0, 0) == pytest.approx(0.20)
    assert cost.step_ms(1000, 0) == pytest.approx(0.20 + 20.0)
    assert cost.step_ms(100, 32) == pytest.approx(0.20 + 2.0 + 0.40 + 0.96)
    with pytest.raises(ValueError, match="decode_base_ms"):
        LinearCost(decode_base_ms=-1)


def test_plots_are_written(tmp_path, capsys):
    assert main(["simulate", "--duration", "3", "--chunk", "128,512", "--plot", str(tmp_path)]) == 0
    for name in ("timeline.png", "cdf.png", "kv_queue.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "chunked-128" in capsys.readouterr().out


def test_sweep_marks_where_static_saturates(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "simulate",
                "--duration",
                "5",
                "--policy",
                "static,chunked",
                "--sweep-rate",
                "4:40:36",
                "--json",
                str(out),
                "--plot",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    static = {r["rate"]: r for r in rows if r["policy"] == "static"}
    assert static[40.0]["saturated"] and not static[4.0]["saturated"]
    assert static[4.0]["saturation_rate"] == 40.0
    assert (tmp_path / "sweep.png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fifo"], "policies are"),
        (["--chunk", "0"], "integers >= 1"),
        (["--cost", "profile"], "--profile FILE"),
        (["--rate", "-1"], "rate must be a finite number > 0"),
        (["--sweep-rate", "5:1:1"], "0 < A <= B"),
        (["--trace", "/nonexistent.csv"], "no trace file"),
        (["--num-blocks", "0"], "num_blocks"),
        (["--cost", "roofline", "--hardware", "tpu"], "unknown hardware"),
    ],
)
def test_bad_options_give_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) if argv[0] in ("--policy", "--chunk") else _no_raise():
        code = main(["simulate", *argv])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
