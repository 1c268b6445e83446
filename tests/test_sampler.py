"""Sampling rules: greedy, temperature, top-k/top-p/min-p, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.model.sampler import Sampler, SamplingRow, draw_seed, greedy_tokens, sample
from jitney.request import SamplingParams

EOS = 3
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def row(num_output_tokens: int = 0, eos: int | None = EOS, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=64, **params), num_output_tokens, eos)


def repeated(logits: torch.Tensor, n: int) -> torch.Tensor:
    return logits.unsqueeze(0).expand(n, -1).clone()


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    result = sample(logits, [row(temperature=0.0)] * 5)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs is None


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(2, 600))
def test_greedy_tokens_take_the_first_maximum_of_bf16_rows(seed, rows, vocab):
    """bf16 logits tie often; the greedy pick is the first maximal index, as float32 argmax's."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 9, (rows, vocab), generator=gen).float() / 4).to(torch.bfloat16)
    expected = [row.index(max(row)) for row in logits.float().tolist()]
    assert greedy_tokens(logits).tolist() == expected


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 2.0]])  # EOS (3) best, stop id 2 next
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [row(0, **params)]).token_ids == [4]
    assert sample(logits, [row(1, **params)]).token_ids == [4]
    assert sample(logits, [row(2, **params)]).token_ids == [EOS]
    # ignore_eos: EOS never stops the request, so it is not suppressed (stop ids still are).
    assert sample(logits, [row(0, ignore_eos=True, **params)]).token_ids == [EOS]
    # No EOS known for the request: only the stop ids are suppressed.
    assert sample(logits, [row(0, eos=None, **params)]).token_ids == [EOS]


def test_temperature_sampling_follows_the_softmax():
    logits = torch.log(PROBS)
    n = 4000
    generator = torch.Generator().manual_seed(1)
    tokens = sample(repeated(logits, n), [row()] * n, generator).token_ids
    assert torch.allclose(frequencies(tokens, 4), PROBS, atol=0.03)
    hot = sample(repeated(logits, n), [row(temperature=2.0)] * n, generator).token_ids
    assert torch.allclose(frequencies(hot, 4), torch.softmax(logits / 2.0, dim=-1), atol=0.03)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (dict(top_k=1), {0}),
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.75), {0, 1}),  # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it
        (dict(top_p=0.4), {0}),
        (dict(min_p=0.2), {0, 1, 2}),  # keeps p >= 0.2 * 0.5
        (dict(min_p=0.5), {0, 1}),
        (dict(top_k=3, top_p=0.9, min_p=0.35), {0, 1}),
    ],
)
def test_truncation_keeps_exactly_the_allowed_tokens(params, allowed):
    n = 1500
    tokens = sample(repeated(torch.log(PROBS), n), [row(**params)] * n, torch.Generator().manual_seed(2))
    assert set(tokens.token_ids) == allowed


def test_rows_with_different_parameters_share_one_batch():
    logits = repeated(torch.log(PROBS), 4)
    rows = [row(temperature=0.0), row(top_k=1), row(top_p=0.4), row(min_p=0.9)]
    for seed in range(20):
        assert sample(logits, rows, torch.Generator().manual_seed(seed)).token_ids == [0, 0, 0, 0]


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab = 1000
    mine = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    alone = [sample(mine.unsqueeze(0), [row(k, seed=42)]).token_ids[0] for k in range(30)]
    others = torch.randn(6, vocab)
    for k in range(30):
        batch = torch.cat([others[:3], mine.unsqueeze(0), others[3:]])
        rows = [row(k, temperature=0.0), row(k), row(k, seed=7, top_k=5), row(k, seed=42),
                row(k, top_p=0.5), row(k + 3, seed=42), row(k)]
        token = sample(batch, rows, torch.Generator().manual_seed(k)).token_ids[3]
        assert token == alone[k]
    # The position matters (each output token has its own draw): the stream is not one token repeated.
    assert len(set(alone)) > 5


def test_seed_reproduces_after_recompute():
    logits = torch.randn(1, 300)
    first = [sample(logits, [row(k, seed=5, top_p=0.9)]).token_ids[0] for k in range(10)]
    torch.manual_seed(999)  # the global RNG state must not matter either
    again = [sample(logits, [row(k, seed=5, top_p=0.9)]).token_ids[0] for k in range(10)]
    assert first == again
    assert draw_seed(5, 0) != draw_seed(5, 1) != draw_seed(6, 0)


def test_sampler_generator_makes_unseeded_rows_reproducible():
    logits = torch.randn(8, 200)
    rows = [row()] * 8
    assert Sampler(seed=11)(logits, rows).token_ids == Sampler(seed=11)(logits, rows).token_ids


def test_logprobs_are_of_the_raw_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    rows = [row(0, temperature=0.5, logprobs=3, min_tokens=1), row(temperature=0.0), row(logprobs=0)]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    chosen, top = result.logprobs[0]
    token = result.token_ids[0]
    assert token != EOS  # suppressed by min_tokens ...
    assert chosen == pytest.approx(raw[0, token].item())  # ... but reported against the raw logits
    assert [t for t, _ in top] == [4, 3, 2]
    assert [lp for _, lp in top] == pytest.approx(raw[0, [4, 3, 2]].tolist())
    assert result.logprobs[1] is None
    assert result.logprobs[2] == (pytest.approx(-math.log(5)), [])


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, 4), [row()])
    assert sample(torch.zeros(0, 4), []).token_ids == []


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    min_tokens=st.integers(0, 2),
    num_output_tokens=st.integers(0, 3),
)
def test_sampled_token_is_always_admissible(seed, temperature, top_k, top_p, min_p, min_tokens,
                                            num_output_tokens):
    vocab = 16
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=generator) * 3
    r = row(num_output_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            min_tokens=min_tokens, stop_token_ids=[5])
    token = sample(logits, [r], generator).token_ids[0]
    masked = logits[0].clone()
    if num_output_tokens < min_tokens:
        assert token not in (EOS, 5)
        masked[[EOS, 5]] = float("-inf")
    if temperature == 0.0:
        assert token == int(masked.argmax())
        return
    ranked = masked.argsort(descending=True).tolist()
    if top_k:
        assert token in ranked[:top_k]
    probs = torch.softmax(masked / temperature, dim=-1)
    assert probs[token] >= min_p * probs.max() * (1 - 1e-5) or token == ranked[0]
    # top-p: the tokens strictly more likely than the chosen one do not already reach top_p.
    assert probs[probs > probs[token]].sum() < top_p + 1e-5
