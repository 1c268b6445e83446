"""Shared fixtures: tiny real checkpoints, written once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(arch, **overrides) -> Path``: a random-initialised HF checkpoint with a
    trained BPE tokenizer (see jitney.testing.factory), cached for the whole session per argument set."""
    from jitney.testing import make_tiny_checkpoint

    cache: dict[tuple, Path] = {}

    def get(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_checkpoint(path, arch, **overrides)
        return cache[key]

    return get
