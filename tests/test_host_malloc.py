"""The glibc setting that keeps large freed blocks in the heap, checked in fresh processes (it is
process-wide) with glibc's own count of bytes in mmapped blocks."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
import torch
from jitney.host_malloc import keep_freed_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_blocks() if sys.argv[1] == "apply" else None
block = torch.empty(64 << 20, dtype=torch.uint8)  # twice glibc's largest mmap threshold
print(applied, libc.mallinfo2().hblkhd)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return hasattr(libc, "mallinfo2") and hasattr(libc, "gnu_get_libc_version")
    except OSError:
        return False


def _probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc only")
def test_large_blocks_come_from_the_heap_once_applied():
    applied, mmapped = _probe("apply")
    assert applied == "True" and mmapped < 64 << 20
    _, mmapped = _probe("leave")
    assert mmapped >= 64 << 20  # glibc's default: a fresh mapping for the block


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc only")
def test_the_environment_can_keep_the_system_default():
    applied, mmapped = _probe("apply", JITNEY_SYSTEM_MALLOC="1")
    assert applied == "False" and mmapped >= 64 << 20
