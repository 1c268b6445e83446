"""Pick the next token of every request in a batch from its logits row.

All rows are processed together on tensors: greedy rows in one argmax, the others through one
batched temperature / top-k / top-p / min-p pipeline. A draw is made with the "exponential race"
(``argmax(p / q)`` with ``q ~ Exp(1)``), which samples exactly from ``p`` and lets each row take its
noise from its own generator while the argmax stays batched.

Seeded requests draw their noise from a generator seeded by ``(seed, num_output_tokens)``, so a
request's tokens depend only on its own logits: not on what else is in the batch, nor on whether it
was preempted and recomputed (the n-th output token always uses the same noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jitney.request import SamplingParams

_MASK64 = (1 << 64) - 1

# (logprob of the sampled token, [(token id, logprob) of the top-n tokens, best first])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request for this step."""

    params: SamplingParams
    num_output_tokens: int  # tokens generated before this draw
    eos_token_id: int | None


@dataclass
class SampleResult:
    token_ids: list[int]
    # None when no row asked for logprobs; otherwise one entry per row (None for rows that did not ask).
    logprobs: list[TokenLogprobs | None] | None = None


def draw_seed(seed: int, step: int) -> int:
    """Mix a request seed and its output position into one 64-bit generator seed (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _suppressed_ids(row: SamplingRow) -> list[int]:
    """Ids that may not be sampled yet because ``min_tokens`` is not reached.

    EOS is suppressed only when it would stop the request: with ``ignore_eos`` it is an ordinary
    token (and stopping is the scheduler's business anyway).
    """
    p = row.params
    if row.num_output_tokens >= p.min_tokens:
        return []
    ids = list(p.stop_token_ids)
    if row.eos_token_id is not None and not p.ignore_eos:
        ids.append(row.eos_token_id)
    return ids


def _top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p cut, in transformers' order.

    ``top_k`` holds the vocabulary size for rows without a cut and ``top_p`` 1.0, so one code path
    serves every row. The most likely token always survives.
    """
    vocab = logits.shape[-1]
    needs_sort = bool((top_k < vocab).any() or (top_p < 1.0).any())
    if needs_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
        cut = ranks >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        # (rows at top_p == 1 are exempt: float rounding in the cumsum must not cut their tail)
        cut = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        cut[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _exponential_noise(rows: Sequence[SamplingRow], vocab: int, generator: torch.Generator | None,
                       device: torch.device) -> torch.Tensor:
    """One row of Exp(1) noise per sampled row: per-draw generators for seeded rows."""
    noise = torch.empty(len(rows), vocab, dtype=torch.float32)
    unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
    if unseeded:
        shared = torch.empty(len(unseeded), vocab, dtype=torch.float32).exponential_(generator=generator)
        noise[unseeded] = shared
    for i, row in enumerate(rows):
        if row.params.seed is not None:
            own = torch.Generator().manual_seed(draw_seed(row.params.seed, row.num_output_tokens))
            noise[i].exponential_(generator=own)
    # Exp(1) can come out as exactly 0; keep p / q finite so a zero-probability token never wins.
    return noise.clamp_(min=torch.finfo(torch.float32).tiny).to(device)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax. ``max`` over a dim returns the first maximal index, as ``argmax`` does,
    and unlike argmax it is as fast on bf16 rows as on float32 ones (6x here on a batch's logits)."""
    return logits.max(dim=-1).indices


def _logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
              rows: Sequence[SamplingRow]) -> list[TokenLogprobs | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    logp = torch.log_softmax(raw_logits[wanted].float(), dim=-1)
    chosen = logp.gather(1, token_ids[wanted].unsqueeze(1)).squeeze(1).tolist()
    top_n = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values, top_ids = (logp.topk(top_n, dim=-1) if top_n else (None, None))
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        top = []
        if n:
            top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        out[i] = (chosen[j], top)
    return out


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           generator: torch.Generator | None = None) -> SampleResult:
    """Choose one token per row of ``logits`` ([n, vocab]).

    Order of operations: ``min_tokens`` suppression, then greedy argmax (temperature 0) or
    temperature, top-k, top-p, min-p and a draw. Unseeded rows draw from ``generator`` (torch's
    default generator when None). Logprobs are the log-softmax of the RAW logits: before
    temperature, truncation and the ``min_tokens`` mask, as vLLM reports them by default.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    n, vocab = logits.shape
    if n == 0:
        return SampleResult([], None)
    raw = logits
    work = logits.float()
    suppressed = [(i, t) for i, row in enumerate(rows) for t in _suppressed_ids(row) if 0 <= t < vocab]
    if suppressed:
        work = work.clone()
        row_idx, tok_idx = zip(*suppressed, strict=True)
        work[list(row_idx), list(tok_idx)] = float("-inf")

    chosen = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy = [i for i, row in enumerate(rows) if row.params.temperature == 0.0]
    sampled = [i for i, row in enumerate(rows) if row.params.temperature != 0.0]
    if greedy:
        chosen[greedy] = greedy_tokens(work[greedy])
    if sampled:
        device = logits.device
        sub_rows = [rows[i] for i in sampled]
        temperature = torch.tensor([r.params.temperature for r in sub_rows], device=device).unsqueeze(1)
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else vocab for r in sub_rows], device=device
        ).clamp(max=vocab)
        top_p = torch.tensor([float(r.params.top_p) for r in sub_rows], device=device)
        min_p = torch.tensor([float(r.params.min_p) for r in sub_rows], device=device)
        scaled = _top_k_top_p_min_p(work[sampled] / temperature, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        noise = _exponential_noise(sub_rows, vocab, generator, device)
        chosen[sampled] = (probs / noise).argmax(dim=-1)

    logprobs = None
    if any(row.params.logprobs is not None for row in rows):
        logprobs = _logprobs(raw, chosen, rows)
    return SampleResult(chosen.tolist(), logprobs)


class Sampler:
    """``sample`` with one generator of its own for unseeded rows (seedable for reproducible runs).

    The noise is always drawn on the CPU, so a CPU generator serves every device.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        return sample(logits, rows, self.generator)
