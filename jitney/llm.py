"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

All prompts are queued at once and the engine steps until every one has finished, so they are
answered together by whichever batching policy the LLM was built with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.scheduler import Scheduler
from jitney.engine import Engine, StepRecord
from jitney.metrics import RequestRecord, from_request
from jitney.request import Request, SamplingParams

logger = logging.getLogger("jitney")

Prompt = str | Sequence[int]
Message = dict[str, str]


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestRecord
    num_cached_prompt_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


class ProfileWriter:
    """Appends one JSON line per executed step: the simulator's ``profile`` cost model input."""

    def __init__(self, path: str | Path) -> None:
        # Line-buffered: a server stopped by a signal still leaves every finished step on disk.
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in close()

    def __call__(self, record: StepRecord) -> None:
        self._file.write(
            json.dumps(
                {
                    "prefill_tokens": record.prefill_tokens,
                    "decode_tokens": record.decode_tokens,
                    "context_tokens": record.context_tokens,
                    "ms": round(record.ms, 4),
                    "num_requests": record.num_requests,
                    "started_s": round(record.started_s, 6),
                    "busy_after": record.busy_after,
                }
            )
            + "\n"
        )

    def close(self) -> None:
        self._file.close()


class LLM:
    """A model, its tokenizer, a KV pool and a scheduler, for offline generation."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        policy: str = "chunked",
        queue: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        profile_path: str | Path | None = None,
        attention: str = "auto",
        num_threads: int | None = None,
    ) -> None:
        from jitney.model.registry import resolve_model
        from jitney.runner import ModelRunner
        from jitney.tokenizer import Tokenizer

        resolved = resolve_model(model)
        cache_config = None
        if num_blocks is not None:
            cache_config = CacheConfig(
                block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
            )
        self.runner = ModelRunner.from_pretrained(
            resolved.path,
            dtype=dtype,
            device=device,
            cache_config=cache_config,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            attention=attention,
            num_threads=num_threads,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        self.model_name = resolved.name
        loaded = self.runner.loaded
        assert loaded is not None
        tok = loaded.tokenizer
        self.tokenizer = tok if isinstance(tok, Tokenizer) else Tokenizer.from_directory(tok)
        model_len = self.runner.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > model_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_len}")
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
            queue=queue,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_model_len=max_model_len if max_model_len is not None else model_len,
        )
        logger.info("%s", self.runner.describe_kv_pool(self.scheduler_config.max_model_len))
        self._profile = ProfileWriter(profile_path) if profile_path is not None else None
        self.engine = Engine(
            Scheduler(self.scheduler_config, self.runner.cache_config),
            self.runner,
            self.tokenizer,
            on_step=self._profile,
        )

    @property
    def cache_config(self) -> CacheConfig:
        return self.runner.cache_config

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priorities: Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        if priorities is not None and len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        requests: list[Request] = []
        try:
            for i, (prompt, sp) in enumerate(zip(batch, params, strict=True)):
                req = self.engine.make_request(prompt, sp, priority=priorities[i] if priorities else 0)
                requests.append(self.engine.add_request(req))
        except ValueError:
            for req in requests:  # all or nothing: leave no half-submitted batch behind
                self.engine.abort(req.request_id)
            raise
        texts = self._run(requests, use_tqdm)
        return [
            GenerationOutput(
                request_id=req.request_id,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(req.prompt_token_ids),
                text=texts[req.request_id][0],
                token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason,
                metrics=from_request(req),
                num_cached_prompt_tokens=req.num_cached_prompt_tokens,
                logprobs=texts[req.request_id][1],
            )
            for prompt, req in zip(batch, requests, strict=True)
        ]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(conv)) for conv in conversations]
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> dict[str, tuple[str, list[Any]]]:
        pending = {r.request_id for r in requests}
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        logprobs: dict[str, list[Any]] = {r.request_id: [] for r in requests}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req", dynamic_ncols=True)
        num_tokens = 0
        clock = self.engine.clock
        start = clock()
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id not in texts:
                        continue
                    texts[out.request_id].append(out.new_text)
                    logprobs[out.request_id].extend(out.new_logprobs)
                    num_tokens += len(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix(tok_s=f"{num_tokens / max(clock() - start, 1e-9):.1f}", refresh=False)
        except BaseException:
            for rid in pending:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return {rid: ("".join(parts), logprobs[rid]) for rid, parts in texts.items()}

    def close(self) -> None:
        if self._profile is not None:
            self._profile.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    for i, p in enumerate(items):
        if not isinstance(p, str) and not (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise ValueError(f"got {len(items)} sampling params for {n} prompts")
    return items
