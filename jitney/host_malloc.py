"""Keep large freed blocks in glibc's heap, so a step's activations reuse the last step's memory.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free. A prefill step of thousands of tokens has activations that large in every
layer (an 8,192-token step's gate/up output is 48 MiB for a 135M model), so each step made the
kernel fault in and zero-fill them again: 8% of the prefill time of the 200-request benchmark here.
Turning mmap off for ordinary allocations and raising the trim threshold keeps those blocks in the
heap for the next step, as tcmalloc or jemalloc would (preloading either also works).

The setting is process-wide and only ever applied on the CPU engine's start (an inference process
keeps its high-water mark anyway). ``JITNEY_SYSTEM_MALLOC=1`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Free memory at the top of the heap above this is still returned to the OS.
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_blocks() -> bool:
    """Apply the setting where malloc is glibc's; returns whether it was applied."""
    if os.environ.get("JITNEY_SYSTEM_MALLOC", "").strip() not in ("", "0"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only (musl has neither)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if applied:
        gnu_get_libc_version.restype = ctypes.c_char_p
        log.debug("glibc %s: large freed blocks stay in the heap", gnu_get_libc_version().decode())
    return applied
