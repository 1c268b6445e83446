"""Helpers for tests and benchmarks: tiny real checkpoints written locally."""

from jitney.testing.factory import ARCHITECTURES, make_tiny_checkpoint

__all__ = ["ARCHITECTURES", "make_tiny_checkpoint"]
