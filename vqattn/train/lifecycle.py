"""The run's lifecycle around the training task, as lightning-hydra-template's ``task_wrapper``: Ctrl-C, the
one-line errors, the cleanup of a run that saved nothing, the environment, and the resume message.

:func:`task_wrapper` wraps ``task(cfg, run_dir) -> dict`` (vqattn.train.cli.train). Around it:
- **Ctrl-C and SIGTERM.** Both stop a run the same way (SIGTERM is what preemption, ``docker stop`` and cluster
  time limits send). From the command line's first line on, such a signal is held (:func:`hold_interrupts`) while
  Hydra composes the config and makes the job's run dir, and raised as the job starts, when the run dir is known.
  During training GracefulInterrupt finishes the step and saves it: the wrapper prints the command that resumes
  the run in the same run dir. A second signal, or one before training, stops at once. The exit status is 128 plus
  the signal's number (130 for Ctrl-C, 143 for SIGTERM).
- **Divergence.** A non-finite loss, gradient or weights stop training before that step is applied or saved
  (vqattn.train.callbacks.NonFiniteGuard, LastCheckpoint): one line naming the step, the loss, the learning rate
  and what to try, the last finite checkpoint and the command that resumes from it; exit status 1.
- **Errors.** A configuration, data or checkpoint problem is one line (``error: ...``, exit status 2) in the
  console and in train.log; anything else is a bug and keeps its traceback (so does everything with
  ``HYDRA_FULL_ERROR=1``).
- **A failed write.** A full disk, a read-only directory or a quota (:class:`vqattn.files.WriteFailed`, from any
  file the run writes: checkpoints, metrics.csv, train.log, results.json) stops the run on every rank: one line
  naming the path and the error, the step whose checkpoint is intact and the command that resumes from it; exit
  status 74 (sysexits' EX_IOERR). Every file is written whole or not at all, so that checkpoint loads.
- **Cleanup.** A run that stops before saving a checkpoint or results.json leaves no run dir behind.
- **Environment.** What the job changed in ``os.environ`` (Lightning's MASTER_PORT, LOCAL_RANK, ...) is undone and
  the process group destroyed, so the next job of a multirun launches fresh ranks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

import torch

from ..files import WRITE_FAILED_STATUS, WriteFailed

log = logging.getLogger("train")
# What a run writes before it has anything worth keeping (a checkpoint, results.json): a failed run dir holding
# only these is removed.
RUN_FILES = {".hydra", "train.log", "hparams.yaml", "metrics.csv", "checkpoints", "tensorboard", "wandb"}
INTERRUPTED_STATUS = 128 + signal.SIGINT
USER_ERROR_STATUS = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the signals that stop a run as Ctrl-C does


def stopped_by(signum: int) -> str:
    """How the messages name a stop: "interrupted" for Ctrl-C, "terminated (SIGTERM)" for SIGTERM."""
    return "interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"


class Interrupted(Exception):
    """Training stopped on Ctrl-C or SIGTERM (``signum``) after saving its checkpoint; ``step`` is the global step
    it holds."""

    def __init__(self, step: int, signum: int = signal.SIGINT):
        super().__init__(f"{stopped_by(signum)} at step {step}")
        self.step, self.signum = step, signum


class Diverged(Exception):
    """Training met a non-finite loss, gradient or weights at global step ``step`` (the optimizer steps done before
    it) and stopped without applying or saving it (vqattn.train.callbacks.NonFiniteGuard); ``loss`` and ``lr`` are
    that step's."""

    def __init__(self, step: int, what: str, loss: float, lr: float):
        super().__init__(f"training diverged at step {step}: {what} (loss {loss:.4g}, lr {lr:.3g}); try a lower "
                         f"optim.lr, a longer optim.warmup_steps or a smaller trainer.gradient_clip_val, or "
                         f"nonfinite=skip to skip such steps")
        self.step, self.what, self.loss, self.lr = step, what, loss, lr


DIVERGED_STATUS = 1


class Aborted(Exception):
    """A second Ctrl-C or SIGTERM stopped training mid-step (or one came before training started): nothing new
    saved."""


_UNSET = object()
FULL_ERROR = "HYDRA_FULL_ERROR"


class _Signals:
    full_error = _UNSET  # the user's HYDRA_FULL_ERROR (None: unset) while composition errors are raised to main()
    task_started = False  # whether Hydra got as far as running a job (so its errors are the job's, not the config's)
    held_interrupt = 0  # the stop signal (SIGINT, SIGTERM) that came while Hydra was setting a job up; 0: none
    last = signal.SIGINT  # the last stop signal received: the exit status is 128 + its number


def last_signal() -> int:
    """The last stop signal received (SIGINT where none came)."""
    return _Signals.last


def exit_status() -> int:
    """128 + the number of the last stop signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + _Signals.last


def raise_interrupt(signum, frame) -> None:
    """A stop signal as a KeyboardInterrupt (what Python's own SIGINT handler raises), remembering which."""
    _Signals.last = signum
    raise KeyboardInterrupt


def note_signal(signum: int) -> None:
    """Remember ``signum`` as the last stop signal (the exit status follows it)."""
    _Signals.last = signum


def _hold(signum, frame) -> None:
    _Signals.held_interrupt = _Signals.last = signum


def set_handlers(handler) -> dict:
    """``handler`` for every stop signal; returns the previous handlers, for :func:`restore_handlers`."""
    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def hold_interrupts():
    """The command line's SIGINT and SIGTERM handler while Hydra composes the config and makes a job's run dir: a
    KeyboardInterrupt raised there would leave that dir behind, since only the job knows it. Installed also when
    SIGINT was ignored: a shell without job control starts background jobs (``python train.py &`` in a script) that
    way, and Ctrl-C (or ``kill -INT``) should still mean "stop"."""
    previous = set_handlers(_hold)
    try:
        yield
    finally:
        restore_handlers(previous)


@contextlib.contextmanager
def composition_errors_raised():
    """HYDRA_FULL_ERROR=1 while Hydra composes the config, so that a composition error (an unknown key) reaches the
    command line's main() as the exception itself, for a one-line message, instead of Hydra's report of it. Each job
    runs under the user's own setting (:func:`task_wrapper` puts it back first), so Hydra reports the job's errors as
    before; the user's setting is back however the command ends."""
    _Signals.full_error = os.environ.get(FULL_ERROR)
    os.environ[FULL_ERROR] = "1"
    try:
        yield
    finally:
        _user_full_error()
        _Signals.full_error = _UNSET


def _user_full_error() -> None:
    """The user's HYDRA_FULL_ERROR back, where :func:`composition_errors_raised` set it."""
    if _Signals.full_error is _UNSET:
        return
    if _Signals.full_error is None:
        os.environ.pop(FULL_ERROR, None)
    else:
        os.environ[FULL_ERROR] = _Signals.full_error


def full_error_asked() -> bool:
    """Whether the user asked for Hydra's full tracebacks (HYDRA_FULL_ERROR=1)."""
    value = os.environ.get(FULL_ERROR) if _Signals.full_error is _UNSET else _Signals.full_error
    return value == "1"


def task_started() -> bool:
    return _Signals.task_started


def interrupt_held() -> bool:
    """Whether a Ctrl-C or SIGTERM came while no job was running (during composition, or after a multirun's last
    job)."""
    return bool(_Signals.held_interrupt)


def is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def task_wrapper(task):
    """``task(cfg, run_dir)`` inside the run's lifecycle (module docstring): Ctrl-C, SIGTERM and errors end it with
    SystemExit (128 + the signal's number, or 2 for a user error); the environment is restored however it ends."""

    @functools.wraps(task)
    def wrapped(cfg, run_dir: Path):
        _Signals.task_started = True
        _user_full_error()  # Hydra reports the job's own errors as the user asked
        env = dict(os.environ)
        held = set_handlers(raise_interrupt)  # the run dir is known: Ctrl-C and SIGTERM raise
        try:
            if _Signals.held_interrupt:
                _Signals.held_interrupt = 0
                raise KeyboardInterrupt
            return task(cfg, run_dir)
        except Interrupted as stop:
            if is_rank_zero():  # one message, from rank 0
                print(f"\n{stop}: saved {run_dir / 'checkpoints' / 'last.ckpt'}\n"
                      f"resume with:\n  {resume_command(run_dir)}", file=sys.stderr)
            raise SystemExit(128 + stop.signum) from None
        except Diverged as stop:
            log_to_file(f"error: {stop}", logging.ERROR)
            discard_failed_run(run_dir)
            if is_rank_zero():
                print(f"\nerror: {stop}\n{_last_checkpoint_line(run_dir)}", file=sys.stderr)
            raise SystemExit(DIVERGED_STATUS) from None
        except WriteFailed as failure:
            log_to_file(f"error: {failure}", logging.ERROR)
            discard_failed_run(run_dir)
            if is_rank_zero():
                print(f"\nerror: {failure}\n{_last_checkpoint_line(run_dir, 'intact', 'once that path can be written')}",
                      file=sys.stderr)
            raise SystemExit(WRITE_FAILED_STATUS) from None
        except (Aborted, KeyboardInterrupt) as stop:
            discard_failed_run(run_dir)
            checkpoint = run_dir / "checkpoints" / "last.ckpt"
            if is_rank_zero():
                saved = f"the last checkpoint is {checkpoint}" if checkpoint.exists() else "nothing was saved"
                print(f"\n{str(stop) or stopped_by(_Signals.last)}: {saved}", file=sys.stderr)
            raise SystemExit(exit_status()) from None
        except Exception as err:
            message = user_error(err)
            if message is not None:
                log_to_file(f"error: {message}", logging.ERROR)
            discard_failed_run(run_dir)
            if message is None or full_error_asked():
                raise
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(USER_ERROR_STATUS) from None
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            restore_environ(env)
            restore_handlers(held)  # a multirun's next job is set up under the same handlers

    return wrapped


def _last_checkpoint_line(run_dir: Path, kind: str = "finite", when: str = "with a change from the line above") -> str:
    """Where a stopped run's last ``kind`` state is, and the command that resumes from it (nothing was saved yet:
    say so)."""
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if not checkpoint.exists():
        return "no checkpoint was saved before it: nothing to resume"
    step = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["global_step"]
    return f"the last {kind} checkpoint is {checkpoint} (step {step}); {when}, resume with:\n  {resume_command(run_dir)}"


def resume_command(run_dir: Path) -> str:
    """The command that resumes this job from its last checkpoint, in the same run dir."""
    from hydra.core.hydra_config import HydraConfig

    keep = [o for o in HydraConfig.get().overrides.task if not o.startswith(("ckpt_path=", "hydra.run.dir="))]
    args = [*keep, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={run_dir}"]
    return shlex.join(["python", sys.argv[0], *args])


def user_error(err: BaseException) -> str | None:
    """The one-line message for a configuration, data or checkpoint problem, else None (a bug: show the traceback)."""
    from hydra.errors import InstantiationException
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from .data import DataUnavailableError

    if isinstance(err, InstantiationException):
        err = err.__cause__ or err
        if isinstance(err, TypeError):  # e.g. +data.foo=1: an argument the target does not take
            return f"{type(err).__name__}: {err}"
    if isinstance(err, (ValueError, FileNotFoundError, DataUnavailableError, MisconfigurationException)):
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def restore_environ(before: dict[str, str]) -> None:
    """Undo this job's environment changes (Lightning's MASTER_PORT, LOCAL_RANK, ..., VQATTN_DDP_ARGV), so that the
    next job of a sweep launches fresh ranks."""
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def discard_failed_run(run_dir: Path) -> None:
    """Remove the run dir of a run that failed or was stopped before saving anything (it holds only RUN_FILES and
    rank logs, no checkpoint), and its parents left empty (outputs/DATE/) up to the working directory."""
    if not run_dir.is_dir() or (run_dir / "checkpoints" / "last.ckpt").exists():
        return
    if any(p.name not in RUN_FILES and not (p.name.startswith("rank") and p.suffix == ".log") for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd = Path.cwd().resolve()
    for parent in run_dir.resolve().parents:
        if parent == cwd or cwd not in parent.parents:
            break
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break


def log_to_file(message: str, level: int = logging.INFO) -> None:
    """Record message in train.log only (the console has it already, in its own form)."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
