"""The seed's slot benchmark: token totals, model-call arithmetic, and the CLI."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.bench.slots import SlotsConfig, TinyLM, bench, run_all, run_policy, sample_output_lens
from jitney.cli import main


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Thousands of tiny calls: two OpenMP threads on shared cores spin far longer than they compute.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_model() -> TinyLM:
    return TinyLM(vocab_size=64, d_model=16, num_blocks=4).eval()


@settings(max_examples=25, deadline=None)
@given(
    out_lens=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=12),
    batch_size=st.integers(min_value=1, max_value=5),
)
def test_both_policies_produce_exactly_the_requested_tokens(out_lens, batch_size):
    model = TinyLM(vocab_size=32, d_model=8, num_blocks=4).eval()
    pad = run_policy("pad_to_max", out_lens, batch_size, model, prompt_len=3)
    cont = run_policy("continuous", out_lens, batch_size, model, prompt_len=3)
    assert pad.tokens == cont.tokens == sum(out_lens)
    # A wave costs one call per token of its longest request (the prefill gives the first one).
    waves = [out_lens[i : i + batch_size] for i in range(0, len(out_lens), batch_size)]
    assert pad.model_calls == sum(max(w) for w in waves)
    assert pad.slot_tokens == sum(len(w) * max(w) for w in waves)
    # Continuous never computes a slot for a finished request.
    assert cont.slot_tokens == sum(out_lens)
    assert cont.utilization == 1.0


def test_seed_workload_needs_fewer_calls_when_slots_are_refilled(small_model):
    out_lens = sample_output_lens(SlotsConfig())
    assert len(out_lens) == 64 and min(out_lens) >= 64 and max(out_lens) <= 512
    for batch_size in (8, 32):
        pad = run_policy("pad_to_max", out_lens, batch_size, small_model)
        cont = run_policy("continuous", out_lens, batch_size, small_model)
        assert cont.model_calls * 1.2 < pad.model_calls
        assert pad.utilization < 0.6


def test_seed_interface_returns_tokens_seconds_calls(small_model):
    tokens, seconds, calls = bench("continuous", [3, 1, 2], 2, model=small_model)
    assert tokens == 6 and seconds > 0 and calls >= 3


def test_unknown_policy_and_bad_inputs_are_rejected(small_model):
    with pytest.raises(ValueError, match="policy must be one of"):
        run_policy("static", [1], 1, small_model)
    with pytest.raises(ValueError, match="batch_size"):
        run_policy("continuous", [1], 0, small_model)
    with pytest.raises(ValueError, match="out_lens"):
        run_policy("continuous", [], 1, small_model)
    with pytest.raises(ValueError, match="min <= max"):
        SlotsConfig(min_output_len=10, max_output_len=5)


def test_run_all_reports_every_policy_at_every_batch():
    cfg = SlotsConfig(
        num_requests=5, min_output_len=2, max_output_len=6, batch_sizes=(2, 4), vocab_size=32, d_model=8
    )
    runs = run_all(cfg)
    assert [(r.batch_size, r.policy) for r in runs] == [
        (2, "pad_to_max"),
        (2, "continuous"),
        (4, "pad_to_max"),
        (4, "continuous"),
    ]


def test_cli_prints_the_table_and_rejects_bad_arguments(capsys):
    rc = main(
        [
            "bench",
            "slots",
            "--num-requests",
            "4",
            "--min-output-len",
            "2",
            "--max-output-len",
            "5",
            "--batch-sizes",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "| 2 | continuous |" in out and "speed-up" in out
    with pytest.raises(SystemExit) as exc:
        main(["bench", "slots", "--batch-sizes", "0"])
    assert exc.value.code == 2
    assert main(["bench", "slots", "--min-output-len", "9", "--max-output-len", "3"]) == 2
    assert "min <= max" in capsys.readouterr().err
