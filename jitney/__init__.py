"""jitney: an LLM inference engine built around iteration-level scheduling."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jitney.request import SamplingParams

if TYPE_CHECKING:
    from jitney.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API pulls in torch; the scheduler and simulator do not need it.
    if name == "LLM":
        from jitney.llm import LLM

        return LLM
    raise AttributeError(f"module 'jitney' has no attribute {name!r}")
