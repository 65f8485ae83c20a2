"""Files that a later run or tool reads, written so that no fault leaves them half-written.

A file is written beside its target (a hidden temporary in the same directory), flushed and fsynced, renamed onto
the target with ``os.replace`` and the directory fsynced: a reader sees the old file or the new one, whole, and a
kill, a full disk or a power cut during the write leaves the old one in place. A temporary in another directory
(the system temp dir, as fsspec's local transaction uses) is not enough: across filesystems the final move copies
over the old file in place, and a fault during that copy destroys it. A directory (the Hugging Face export) is
written as a temporary directory beside it and renamed into place.

A failed write (a full disk, a read-only directory, a quota) is raised as :class:`WriteFailed`, an OSError whose
message is one line naming the path and the system's error, for the command line to print as it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

TEMPORARY_MARK = ".tmp-"  # in every temporary's name: .NAME.tmp-PID-RANDOM


class WriteFailed(OSError):
    """Writing ``path`` failed with the OSError ``error``; ``str()`` is one line: the path and the system's error."""

    def __init__(self, path: str | Path, error: OSError):
        super().__init__(error.errno, error.strerror or str(error))
        self.path, self.error = Path(path), error

    def __str__(self) -> str:
        reason = f"[Errno {self.errno}] {self.strerror}" if self.errno is not None else str(self.error)
        return f"could not write {self.path}: {reason}"

    def __reduce__(self):  # picklable, for the ranks of a DDP run to share one failure
        return type(self), (self.path, OSError(self.error.errno, self.error.strerror))


def temporary_beside(path: Path) -> Path:
    """A new hidden name in ``path``'s directory for a temporary of it."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and TEMPORARY_MARK in path.name


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file in directory ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: the rename itself is still atomic
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WRITE_FAILED_STATUS = 74  # sysexits.h's EX_IOERR, as the trainer's


def failed_write_exit(prog: str, failure: WriteFailed) -> int:
    """A command line's answer to a failed write: its one line on stderr, and the exit status to return."""
    print(f"{prog}: error: {failure}", file=sys.stderr)
    return WRITE_FAILED_STATUS


@contextlib.contextmanager
def write_failed_as(path: str | Path) -> Iterator[None]:
    """Raise an OSError of the block as :class:`WriteFailed` naming ``path`` (one already so raised passes)."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as err:
        raise WriteFailed(path, err) from err


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write a file to; when the block ends normally the file is
    fsynced and renamed onto ``path`` (its directory created if missing). On any error the temporary is removed
    and ``path`` keeps what it held; an OSError is raised as :class:`WriteFailed`."""
    path = Path(path)
    with write_failed_as(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_beside(path)
    try:
        yield temporary
        with write_failed_as(path):
            fsync_file(temporary)
            os.replace(temporary, path)
            fsync_directory(path.parent)
    except BaseException as err:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise WriteFailed(path, err) from err
        raise


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", **open_kwargs) -> Iterator:
    """An open file (``mode`` "w" or "wb") whose content replaces ``path`` whole when the block ends normally
    (:func:`atomic_path`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as temporary, open(temporary, mode, **open_kwargs) as f:
        yield f
        f.flush()


def write_text(path: str | Path, text: str) -> Path:
    """``path``'s content replaced by ``text`` (UTF-8), atomically; returns ``path``."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def save_figure(fig, path: str | Path, **savefig_kwargs) -> Path:
    """A matplotlib figure saved to ``path`` atomically, in the format its suffix names (``.png``, ``.pdf``, ...,
    as ``savefig`` infers it); returns ``path``."""
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".") or None)
    with atomic_path(path) as temporary:
        fig.savefig(temporary, **savefig_kwargs)
    return path


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``path`` for the block to fill; when it ends normally every file in it is
    fsynced and the directory takes ``path``'s place (an existing ``path`` is moved aside first and removed after:
    a fault between the two renames leaves it whole as ``.NAME.old-...`` beside, never half-overwritten). On any error
    the temporary is removed and ``path`` is untouched; an OSError is raised as :class:`WriteFailed`."""
    path = Path(path)
    with write_failed_as(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = temporary_beside(path)
        temporary.mkdir()
    try:
        yield temporary
        with write_failed_as(path):
            for file in sorted(temporary.rglob("*")):
                if file.is_file():
                    fsync_file(file)
            fsync_directory(temporary)
            old = None
            if path.exists():
                old = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.rename(path, old)
            os.rename(temporary, path)
            fsync_directory(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise WriteFailed(path, err) from err
        raise


@contextlib.contextmanager
def atomic_files(directory: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``directory`` for the block to write files to; when it ends normally each file
    is fsynced and renamed into ``directory`` (created if missing), replacing its namesake whole, and the others
    there are left as they are. Each file is atomic, not the set: a fault between two renames leaves some files
    new and some old, each whole. On any error the temporary is removed; an OSError is raised as
    :class:`WriteFailed`."""
    directory = Path(directory)
    with write_failed_as(directory):
        directory.mkdir(parents=True, exist_ok=True)
        temporary = temporary_beside(directory)
        temporary.mkdir()
    try:
        yield temporary
        with write_failed_as(directory):
            for file in sorted(p for p in temporary.iterdir() if p.is_file()):
                fsync_file(file)
                os.replace(file, directory / file.name)
            fsync_directory(directory)
    except BaseException as err:
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise WriteFailed(directory, err) from err
        raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def remove_temporaries(directory: str | Path, name: str) -> None:
    """Remove the temporaries of ``directory/name`` that an earlier process left (it was killed mid-write)."""
    directory = Path(directory)
    if directory.is_dir():
        for stale in directory.glob(f".{name}{TEMPORARY_MARK}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    stale.unlink()
