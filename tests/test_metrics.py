import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitney.metrics import SLO, RequestRecord, Stats, from_request, slot_utilization, summarize
from jitney.request import Request, RequestStatus, SamplingParams


def _record(arrival: float, times: list[float], prompt: int = 10, **kw) -> RequestRecord:
    return RequestRecord(
        arrival_time=arrival,
        first_token_time=times[0],
        finish_time=times[-1],
        prompt_tokens=prompt,
        output_tokens=len(times),
        token_times=tuple(times),
        **kw,
    )


def _seed_pctl(xs: list[float], q: float) -> float:
    """The seed simulator's percentile (linear interpolation between order statistics)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] if lo == hi else xs[lo] * (hi - k) + xs[hi] * (k - lo)


def test_ttft_tpot_itl_e2el_follow_vllm_definitions():
    a = _record(0.0, [0.5, 0.6, 0.8, 1.1], first_scheduled_time=0.2)
    b = _record(1.0, [1.25])  # one token: no TPOT, no ITL
    s = summarize([a, b], duration=2.0)
    assert s.completed == 2 and s.failed == 0
    assert s.ttft.mean == pytest.approx((500 + 250) / 2)
    assert s.tpot.mean == pytest.approx((1.1 - 0.5) / 3 * 1000)  # only a has a TPOT
    assert s.itl.max == pytest.approx(300.0)
    assert s.itl.median == pytest.approx(200.0)  # gaps 100, 200, 300 ms
    assert s.e2el.max == pytest.approx(1100.0)
    assert s.queue.max == pytest.approx(200.0)
    assert s.output_throughput == pytest.approx(5 / 2.0)
    assert s.total_token_throughput == pytest.approx(25 / 2.0)
    assert s.request_goodput is None


def test_default_duration_spans_first_arrival_to_last_finish():
    s = summarize([_record(1.0, [1.5, 2.0]), _record(2.0, [2.5, 4.0])])
    assert s.duration == pytest.approx(3.0)
    assert s.request_throughput == pytest.approx(2 / 3.0)


def test_goodput_counts_requests_meeting_every_slo():
    fast = _record(0.0, [0.1, 0.12, 0.14])  # ttft 100 ms, tpot 20 ms
    slow_first = _record(0.0, [0.9, 0.91])  # ttft 900 ms
    slow_decode = _record(0.0, [0.1, 0.3])  # tpot 200 ms
    single = _record(0.0, [0.05])  # tpot counted as 0
    s = summarize([fast, slow_first, slow_decode, single], duration=1.0, slo=SLO(ttft_ms=500, tpot_ms=50))
    assert s.request_goodput == pytest.approx(2.0)


def test_failed_records_are_counted_but_not_measured():
    ok = _record(0.0, [0.1, 0.2])
    bad = RequestRecord(0.0, None, None, 10, 0, success=False, error="timeout")
    s = summarize([ok, bad], duration=1.0)
    assert (s.completed, s.failed) == (1, 1)
    assert s.total_input_tokens == 10


def test_empty_samples_read_as_zero_like_vllm():
    s = summarize([_record(0.0, [0.1])], duration=1.0)
    assert s.tpot.mean == 0.0 and s.itl.p(99) == 0.0


def test_to_dict_uses_vllm_field_names():
    d = summarize([_record(0.0, [0.1, 0.2])], duration=1.0).to_dict()
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p95_tpot_ms", "mean_itl_ms",
                "p90_e2el_ms", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "completed", "failed", "duration", "max_queue_ms"):
        assert key in d


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=60))
def test_percentiles_interpolate_linearly_like_the_seed(xs):
    s = Stats.of_seconds([x / 1000 for x in xs])
    for q in (50, 90, 95, 99):
        assert s.p(q) == pytest.approx(_seed_pctl(xs, q / 100), rel=1e-9, abs=1e-9)


def test_slot_utilization_of_the_seed_static_example():
    # One request of 2000 tokens and seven of 50 in a static batch of 8 slots held 2000 steps.
    assert slot_utilization(2000 + 7 * 50, 8 * 2000) == pytest.approx(0.146875)
    with pytest.raises(ValueError):
        slot_utilization(10, 5)


def test_slo_rejects_non_positive_targets():
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)


def test_from_request_reads_the_scheduler_stamps():
    req = Request("r0", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=1.0)
    req.output_token_ids = [7, 8, 9]
    req.first_scheduled_time = 1.1
    req.first_token_time = 1.5
    req.token_times = [1.5, 1.6, 1.8]
    req.finish_time = 1.8
    req.num_preemptions = 1
    req.status = RequestStatus.FINISHED_LENGTH
    rec = from_request(req)
    assert rec.success and rec.output_tokens == 3 and rec.prompt_tokens == 3
    assert rec.ttft == pytest.approx(0.5) and rec.tpot == pytest.approx(0.15)
    assert rec.queue_time == pytest.approx(0.1) and rec.num_preemptions == 1

    req.status = RequestStatus.FINISHED_ABORTED
    assert not from_request(req).success


@given(st.lists(st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), max_size=6), max_size=8))
def test_itl_is_every_gap_within_a_request_and_none_across(token_lists):
    recs = [
        RequestRecord(0.0, t[0], t[-1], 1, len(t), token_times=tuple(sorted(t)))
        for t in token_lists
        if t
    ]
    expected = [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    s = summarize(recs, duration=1.0) if recs else None
    if expected:
        assert s.itl.max == pytest.approx(max(expected) * 1000)
        assert s.itl.mean == pytest.approx(sum(expected) / len(expected) * 1000)
    elif s is not None:
        assert s.itl.max == 0.0
