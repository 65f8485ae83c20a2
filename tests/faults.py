"""Faults for the tests of what the trainer writes: a disk that fills, a writer that dies mid-file, a kill mid-save.

:func:`full_disk` makes every file opened for writing under a directory raise ENOSPC once ``budget`` bytes have
been written there in all (Python-level writes: ``open``, ``Path.open``, logging's handlers, ``torch.save`` into
a file object), as a disk that fills does: the write that crosses the budget writes its first part, then fails.
:func:`main_with_faults` is a train.py whose environment (FAULT_ROOT, FAULT_BUDGET) says where the disk is full,
for the tests that need the real console and exit status; under DDP each rank's process installs it alike.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from pathlib import Path


class _Filling:
    """The bytes written so far under ``root`` and the budget they may not pass."""

    def __init__(self, root: Path, budget: int, match: str | None = None):
        self.root, self.budget, self.match, self.written = root.resolve(), budget, match, 0

    def covers(self, file, mode: str) -> bool:
        if not isinstance(file, (str, os.PathLike)) or not any(c in mode for c in "wax+"):
            return False
        path = Path(file).resolve()
        inside = path == self.root or self.root in path.parents
        return inside and (self.match is None or self.match in path.name)

    def take(self, n: int) -> int:
        """How many of ``n`` bytes still fit (the rest raise)."""
        fits = max(0, min(n, self.budget - self.written))
        self.written += fits
        return fits


class _FillingFile:
    """A file object whose writes stop with ENOSPC at the disk's budget."""

    def __init__(self, f, disk: _Filling):
        self._f, self._disk = f, disk

    def write(self, data):
        fits = self._disk.take(len(data))
        if fits < len(data):
            if fits:
                self._f.write(data[:fits])
                self._f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def install_full_disk(root: str | Path, budget: int, match: str | None = None) -> _Filling:
    """From now on in this process, files opened for writing under ``root`` (those whose name contains ``match``,
    if given) fill a disk of ``budget`` bytes."""
    disk = _Filling(Path(root), budget, match)
    real_open = io.open

    def filling_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FillingFile(f, disk) if disk.covers(file, mode) else f

    builtins.open = io.open = filling_open
    return disk


def full_disk(monkeypatch, root: str | Path, budget: int, match: str | None = None) -> _Filling:
    """:func:`install_full_disk`, undone when the test ends."""
    monkeypatch.setattr(builtins, "open", builtins.open)
    monkeypatch.setattr(io, "open", io.open)
    return install_full_disk(root, budget, match)


def main_with_faults() -> None:
    """train.py's main under the disk FAULT_ROOT / FAULT_BUDGET describe (none when FAULT_ROOT is unset)."""
    if os.environ.get("FAULT_ROOT"):
        install_full_disk(os.environ["FAULT_ROOT"], int(os.environ["FAULT_BUDGET"]))
    from vqattn.train.entry import main

    main()


if __name__ == "__main__":
    sys.exit(main_with_faults())
