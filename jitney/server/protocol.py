"""Request bodies of the OpenAI-compatible API, and their translation to ``SamplingParams``.

Field types are checked by pydantic (a wrong type becomes a 400 through the error handlers);
value ranges are checked once by ``SamplingParams.validate``. Unknown fields are ignored, as the
OpenAI-compatible servers that benchmark tools target do, so extra vendor fields never break a
client; fields we know but do not implement are refused when they would change the result.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jitney.request import SamplingParams
from jitney.server.errors import ApiError

MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: one choice per request (n=1)", "n")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported (only 1)", "best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (only 0)", name)
        if self.repetition_penalty not in (None, 1, 1.0):
            raise ApiError(400, "repetition_penalty is not supported (only 1)", "repetition_penalty")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int
    ) -> SamplingParams:
        self._check_unsupported()
        values = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "min_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None or self.top_k == -1 else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            # SamplingParams names the field first: "<field> must be ...".
            field = str(exc).split(" ", 1)[0]
            param = "max_tokens" if field == "max_tokens" else field
            raise ApiError(400, str(exc), param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """One prompt: a string or token ids. Batched prompts are refused, not silently cut."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported: one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt, list) and not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        return prompt

    def to_sampling_params(self, default_max_tokens: int = 16) -> SamplingParams:
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            message = f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            raise ApiError(400, message, "logprobs")
        return self._sampling_params(self.max_tokens, self.logprobs, default_max_tokens)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ApiError(
                    400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            return self._sampling_params(max_tokens, logprobs, default_max_tokens)
        except ApiError as exc:
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
