"""How the trainer writes what outlives it: checkpoints through an atomic CheckpointIO, and a failed write (a full
disk, a read-only directory, a quota) as one stop of the whole run, on every rank alike.

- :class:`AtomicCheckpointIO` is the Trainer's checkpoint plugin (``Trainer(plugins=[...])``, Lightning's extension
  point): each checkpoint is written beside its target and renamed onto it (:mod:`vqattn.files`), so last.ckpt is
  a new file at every save on any filesystem, and a fault mid-save leaves the previous one whole.
- A write that fails inside Lightning's machinery (metrics.csv from a logger, train.log from its handler, a
  checkpoint on one rank of a DDP run) is not raised where it happens: raised there it would end in a traceback, or
  leave the other ranks waiting at the next collective. It is noted (:func:`note_failure`) and raised by
  :func:`stop_on_failure`, which LastCheckpoint calls after every step in one process, and at every save and at the
  end under DDP, where the ranks share the first failure and all raise it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..files import WriteFailed, atomic_file, write_failed_as

_failures: list[WriteFailed] = []  # this process's failed writes not yet raised, the first first


def note_failure(failure: WriteFailed) -> None:
    """Remember a failed write for :func:`stop_on_failure` (the first one is what the run reports)."""
    _failures.append(failure)


def clear_failures() -> None:
    """Forget this process's noted failures (a new run starts: a multirun's next job, a test)."""
    _failures.clear()


def distributed() -> bool:
    """Whether this process is one rank of several (a DDP run's process group is up)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def stop_on_failure(collective: bool = True) -> None:
    """Raise the first noted write failure; under DDP (``collective``: every rank calls it at the same point) each
    rank raises the same one, the lowest rank's, if any rank noted one."""
    mine = _failures[0] if _failures else None
    if collective and distributed():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        mine = next((failure for failure in gathered if failure is not None), None)
    if mine is not None:
        _failures.clear()
        raise mine


@contextlib.contextmanager
def _os_error_of_torch_save():
    """The OSError behind torch.save's RuntimeError: a file object's write that fails (a full disk) leaves the
    zip writer inconsistent, and closing it raises "unexpected pos" with the OSError as its context."""
    try:
        yield
    except RuntimeError as err:
        cause = err.__cause__ or err.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save into a temporary beside the target, fsynced and renamed onto it (:func:`vqattn.files.atomic_file`).

    A failed save raises :class:`~vqattn.files.WriteFailed` in one process; under DDP (only rank 0 writes, and
    every rank then waits at Lightning's barrier) it is noted for :func:`stop_on_failure` instead, so that every
    rank reaches the barrier and then stops alike.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        try:
            with atomic_file(path, "wb") as f, _os_error_of_torch_save():
                torch.save(checkpoint, f)
        except WriteFailed as failure:
            if not distributed():
                raise
            note_failure(failure)

    def remove_checkpoint(self, path) -> None:
        with write_failed_as(path):
            Path(path).unlink(missing_ok=True)


class RunLogHandler(logging.FileHandler):
    """train.log's handler (conf/config.yaml's ``hydra.job_logging``): logging's own FileHandler prints a traceback
    for each record it fails to write (``--- Logging error ---``) and goes on; this one notes the first failure
    for :func:`stop_on_failure`, which stops the run with one line, and writes nothing more."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # called by emit with the error being handled
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):  # a record that cannot be formatted is a bug, not a full disk
            return super().handleError(record)
        self.failed = True
        note_failure(WriteFailed(self.baseFilename, err))
