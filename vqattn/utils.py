"""Process-level settings that matter for speed on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from pathlib import Path

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or ``taskset``'s share), else
    ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """(idle, total) clock ticks since boot of each core this process may run on, from /proc/stat ({} where there is
    none: not Linux). Idle counts idle and iowait; total also user, nice, system, irq, softirq and steal."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    mine = os.sched_getaffinity(0)
    ticks = {}
    for line in lines:
        name, *fields = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in mine:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
            ticks[int(name[3:])] = (idle + iowait, user + nice + system + idle + iowait + irq + softirq + steal)
    return ticks


def count_idle(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> int:
    """How many cores were idle at least half the time between two :func:`cpu_ticks` readings: with the busy
    fraction of core c  1 − Δidle_c / Δtotal_c  below 1/2. A core without ticks in between counts as idle."""
    idle = 0
    for core, (idle_0, total_0) in before.items():
        idle_1, total_1 = after.get(core, (idle_0, total_0))
        idle += 2 * (idle_1 - idle_0) >= total_1 - total_0
    return idle


def idle_cores(interval: float = 0.25) -> int:
    """The cores other work leaves idle, measured over the next ``interval`` seconds (this process sleeps), at least
    1; all of :func:`available_cores` where /proc/stat is missing.

    PyTorch's intra-op threads spin while they wait for each other at the end of every parallel op; one of them
    on a core that another process keeps busy stalls all the others, and a run with threads = cores can be many
    times slower than with fewer threads (docs/performance.md, "Threads on a busy CPU").
    """
    before = cpu_ticks()
    if not before:
        return available_cores()
    time.sleep(interval)
    return max(1, count_idle(before, cpu_ticks()))


def check_threads(threads) -> None:
    """A one-line ValueError unless ``threads`` is a positive int, "auto" or None."""
    if threads == "auto" or threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"threads must be a positive int, auto or null, got {threads!r}")


def pick_threads(threads: int | str | None = "auto", doing: str = "running") -> tuple[int | None, str]:
    """The intra-op threads a process sets for ``threads``, and the one line that says so.

    A positive int is itself; None keeps torch's default (one per core, or OMP_NUM_THREADS); "auto" takes the cores
    other work leaves idle now (:func:`idle_cores`), at most torch's default, and keeps torch's default where
    OMP_NUM_THREADS chose it. Returns (the count to pass to ``torch.set_num_threads``, None to keep torch's, and
    the line, e.g. ``threads=auto: 1 of 2 cores idle, sampling with 1 thread``); ``doing`` names the work in it.
    Where the user set the count (an int, OMP_NUM_THREADS, torch's default) and it exceeds the idle cores, the line
    says so, what it costs and what "auto" would take (:func:`busy_cores_note`).
    """
    import torch

    check_threads(threads)
    if threads == "auto" and "OMP_NUM_THREADS" not in os.environ:
        idle = idle_cores()
        chosen = min(idle, torch.get_num_threads())
        return chosen, f"threads=auto: {idle} of {available_cores()} cores idle, {doing} with {thread_count(chosen)}"
    if threads == "auto":
        n, chosen = torch.get_num_threads(), None
        line = f"threads=auto: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} set, {doing} with {thread_count(n)}"
    elif threads is None:
        n, chosen = torch.get_num_threads(), None
        line = f"threads=null: torch's default, {doing} with {thread_count(n)}"
    else:
        n, chosen = threads, threads
        line = f"threads={threads}: {doing} with {thread_count(threads)}"
    return chosen, line + busy_cores_note(n)


def busy_cores_note(threads: int) -> str:
    """What the threads line adds when a count the user set (``threads=N``, OMP_NUM_THREADS, torch's default)
    exceeds the cores idle now, or "" where it fits (or is one thread, which waits for nobody).

    ``threads=auto`` measures the idle cores, a set count does not: a thread on a busy core stalls the others at the
    end of every parallel op, which makes a run several times slower (docs/performance.md, "Threads on a busy CPU")
    and otherwise goes unsaid.
    """
    if threads <= 1:
        return ""
    idle = idle_cores()
    if threads <= idle:
        return ""
    auto = "threads=auto" if "OMP_NUM_THREADS" not in os.environ else "threads=auto without OMP_NUM_THREADS"
    return (f", but only {idle} of {available_cores()} cores {'is' if idle == 1 else 'are'} idle: threads on busy "
            f"cores stall each other, often several times slower; {auto} would use {thread_count(idle)}")


def thread_count(n: int) -> str:
    """"1 thread", "2 threads"."""
    return f"{n} thread{'s' * (n != 1)}"


def use_threads(threads: int | str | None = "auto", doing: str = "running", *, children: bool = False,
                file=None) -> int:
    """Set torch's intra-op threads as the trainer does (:func:`pick_threads`: by default the idle cores) and say so
    in one line on ``file`` (stderr by default); returns the threads now set. ``children``: the processes this one
    starts get the same count (through OMP_NUM_THREADS).

    The command lines beside the trainer call it (sample, length_eval, vqattn-export, vqattn-eval, the benchmarks on
    a CPU): on a machine where another job keeps a core busy, PyTorch's default of one thread per core can make
    them many times slower (docs/performance.md, "Threads on a busy CPU").
    """
    import torch

    chosen, line = pick_threads(threads, doing)
    if chosen is not None:
        torch.set_num_threads(chosen)
    if children:
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    print(line, file=sys.stderr if file is None else file, flush=True)
    return torch.get_num_threads()


def threads_arg(text: str) -> int | str:
    """argparse's ``type`` for ``--threads``: "auto" or a positive int."""
    import argparse

    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive int or auto, got {text!r}")
    return value


def add_threads_argument(parser) -> None:
    """``--threads N|auto`` (default auto) on an argparse parser, for :func:`use_threads`."""
    parser.add_argument("--threads", type=threads_arg, default="auto", metavar="N|auto",
                        help="intra-op threads (default auto: the cores other work leaves idle now, as the trainer)")


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
