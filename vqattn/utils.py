"""Process-level settings that matter for speed on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or ``taskset``'s share), else
    ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def tune_cpu_allocator(keep_bytes: int = 1 << 30) -> bool:
    """Let glibc keep freed memory instead of handing every large block back to the OS.

    PyTorch's CPU tensors come straight from ``malloc``; glibc serves blocks above 128 KiB with ``mmap`` and
    unmaps them on free, so every training step page-faults (and zero-fills) all of its large temporaries
    again. Raising the mmap and trim thresholds to ``keep_bytes`` reuses them, like running under jemalloc or
    tcmalloc (PyTorch's CPU performance guide). It changes only speed, for every op in the process (SDPA too).
    Returns False where it does not apply (not Linux/glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, keep_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 4 * keep_bytes))
