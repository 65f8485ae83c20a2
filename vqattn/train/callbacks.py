"""Trainer parts of train.py that Lightning does not ship as such, each a small callback on Lightning's public
hooks: per-rank RNG state in checkpoints, a graceful Ctrl-C, a stop (or skip) at a non-finite loss or gradient,
last.ckpt (and kept steps, best.ckpt) saved once per step, never from non-finite weights, a run-long progress
bar, training-only token throughput, and a model summary without the FLOPs column; and
:func:`instantiate_callbacks`, which builds the ``callbacks`` config group.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint, ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from ..files import WriteFailed, atomic_path, remove_temporaries, write_failed_as, write_text
from .lifecycle import Diverged, log_to_file, note_signal, raise_interrupt, restore_handlers, set_handlers
from .saving import distributed, note_failure, stop_on_failure

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's summary goes
train_log = logging.getLogger("train")  # the trainer's own lines (vqattn.train.cli)


class RNGState(Callback):
    """Every training step draws from the RNG state the previous step left, and checkpoints keep that state for
    every rank.

    What runs between two steps (a validation, a resumed run's new data-loader iterator) then changes no random
    draw (dropout, codebook restarts), and a resumed run draws what an uninterrupted one would, on every rank. As a
    callback state it is restored only when a Trainer resumes (``fit(ckpt_path=...)``), never by
    ``LitLM.load_from_checkpoint``, so ``vqattn.train.sample --seed`` keeps its seed.
    """

    def __init__(self):
        self._snapshot: dict | None = None  # this rank's RNG state as the last training step left it

    def setup(self, trainer, pl_module, stage):
        self._trainer = trainer

    def _current(self) -> dict:
        device = self._trainer.strategy.root_device
        states = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(device)
        return states

    def _restore(self, states: dict) -> None:
        torch.set_rng_state(states["cpu"])
        if "cuda" in states and self._trainer.strategy.root_device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"], self._trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._snapshot is not None:
            self._restore(self._snapshot)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._snapshot = self._current()

    def state_dict(self) -> dict:
        trainer = self._trainer
        states = self._snapshot or self._current()
        if trainer.world_size > 1:  # every rank dumps the checkpoint (rank 0 writes it): gather all ranks' states
            device = trainer.strategy.root_device
            states = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in states.items()}
        else:
            states = {k: v[None] for k, v in states.items()}
        return {"world_size": trainer.world_size, **states}  # (world, N) uint8 each

    def load_state_dict(self, state: dict) -> None:
        trainer = self._trainer
        if state.get("world_size") != trainer.world_size:
            rank_zero_warn(f"the checkpoint's RNG states are from {state.get('world_size')} ranks, this run has "
                           f"{trainer.world_size}: random draws will differ from an uninterrupted run")
            return
        # .clone(): a row view crashes set_rng_state
        self._snapshot = {k: state[k][trainer.global_rank].clone() for k in ("cpu", "cuda") if k in state}
        self._restore(self._snapshot)


class GracefulInterrupt(Callback):
    """Ctrl-C (SIGINT) or SIGTERM during fit: finish the current step and stop (LastCheckpoint then saves that
    step); a second one aborts.

    SIGTERM is what preemption, ``docker stop`` and cluster time limits send; it replaces Lightning's own SIGTERM
    handling during fit, which stops without saving the steps since the last checkpoint. The flag is checked after
    each training batch, so the checkpoint holds a whole optimizer step (a KeyboardInterrupt raised inside
    ``optimizer.step`` could leave parameters half updated). Under DDP the ranks agree on the step to stop at by one
    boolean all-reduce per step, whichever ranks got the signal. ``interrupted_at`` is the global step it stopped
    at, or None; ``signum`` the signal that stopped it. The previous handlers are back once training ends, however
    it ends.
    """

    def __init__(self):
        self.interrupted_at, self._requested, self._previous = None, False, None
        self.signum = signal.SIGINT

    def _handler(self, signum, frame):
        self._requested, self.signum = True, signum
        note_signal(signum)
        set_handlers(raise_interrupt)  # a second Ctrl-C or SIGTERM raises KeyboardInterrupt

    def on_train_start(self, trainer, pl_module):
        self._previous = set_handlers(self._handler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stop = self._requested
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and self.interrupted_at is None:
            self.interrupted_at = trainer.global_step
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # no validation pass on the way out
            if trainer.world_size > 1:  # the signal a rank got (SIGTERM where ranks got different ones), on all
                signum = torch.tensor(int(self.signum) if self._requested else 0, device=trainer.strategy.root_device)
                self.signum = int(trainer.strategy.reduce(signum, reduce_op="max"))
                note_signal(self.signum)

    def restore_handler(self) -> None:
        if self._previous is not None:
            restore_handlers(self._previous)
            self._previous = None

    def on_train_end(self, trainer, pl_module):
        self.restore_handler()

    def on_exception(self, trainer, pl_module, exception):
        self.restore_handler()


def _all_finite(tensors) -> torch.Tensor:
    """0-dim bool tensor: every floating tensor of ``tensors`` is finite (read on the host only by the caller)."""
    checks = [t.isfinite().all() for t in tensors if torch.is_tensor(t) and t.is_floating_point()]
    if not checks:
        return torch.tensor(True)
    # on the accelerator's device: some tensors stay on the CPU there (AdamW's step counts)
    device = next((c.device for c in checks if c.device.type != "cpu"), checks[0].device)
    return torch.stack([c.to(device) for c in checks]).all()


def _any_rank(trainer, decision: bool) -> bool:
    """``decision`` on this rank, or on any rank under DDP (so that every rank acts alike at the same step)."""
    return trainer.strategy.reduce_boolean_decision(decision, all=False) if trainer.world_size > 1 else decision


class NonFiniteGuard(Callback):
    """A step whose loss or gradient is not finite is never applied: with ``mode="stop"`` (the default) the run stops
    there (:class:`Diverged`: the step, the loss, the learning rate and what to try; exit status 1), with
    ``mode="skip"`` the step's gradients are dropped (AdamW leaves the weights and its moments untouched, the
    schedule goes on) up to ``max_skips`` times in the whole run, after which it stops as "stop" does.

    Checked after the backward pass and before clipping and the optimizer step, on every rank: under DDP the ranks
    agree by one boolean all-reduce, so they stop (or skip) at the same step. A loss or gradient that diverges only
    after the weights have left the finite range is caught by LastCheckpoint, which never saves such weights. Under
    fp16 mixed precision the gradient scaler skips non-finite gradients itself: only the loss is checked. ``skipped``
    counts the run's skipped steps (resumed parts included, through the checkpoint); results.json reports it.
    """

    MODES = ("stop", "skip")

    def __init__(self, mode: str = "stop", max_skips: int = 100):
        if mode not in self.MODES:
            raise ValueError(f"nonfinite must be one of {', '.join(self.MODES)}, got {mode!r}")
        if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0:
            raise ValueError(f"nonfinite_max_skips must be an int >= 0, got {max_skips!r}")
        self.mode, self.max_skips = mode, max_skips
        self.skipped = 0
        self._loss: torch.Tensor | None = None  # the step's loss so far: the sum of its micro-batches' shares

    def on_before_backward(self, trainer, pl_module, loss):
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        loss, self._loss = self._loss, None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None  # fp16: the scaler's business
        # every entry checked, not a norm: a finite gradient whose norm overflows float32 is not a non-finite one
        checks = [loss.isfinite() if loss is not None else torch.tensor(True),
                  _all_finite([] if scaled else [p.grad for p in params])]
        loss_finite, grads_finite = torch.stack([c.to(checks[1].device) for c in checks]).tolist()  # one host sync
        if not _any_rank(trainer, not (loss_finite and grads_finite)):
            return
        what = "non-finite loss" if not loss_finite else "non-finite gradient"
        loss_value = float(loss) if loss is not None else math.nan
        lr = optimizer.param_groups[0]["lr"]
        if self.mode == "skip" and self.skipped < self.max_skips:
            self.skipped += 1
            for p in params:
                p.grad = None  # the optimizer passes over a parameter without a gradient
            if trainer.is_global_zero:
                train_log.warning("step %d: %s (loss %.4g, lr %.3g), skipped (%d of nonfinite_max_skips=%d)",
                                  trainer.global_step, what, loss_value, lr, self.skipped, self.max_skips)
            return
        if self.mode == "skip":
            what += f" after {self.skipped} skipped steps (nonfinite_max_skips={self.max_skips})"
        raise Diverged(trainer.global_step, what, loss_value, lr)

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state["skipped"]


class LastCheckpoint(Checkpoint):
    """Keeps ``dirpath/last.ckpt``: saved every ``every_n_train_steps`` optimizer steps and once more when
    training ends (finished or interrupted) unless that step was just saved, so each step is written at most once.

    - ``keep`` > 1: the last ``keep`` saves stay as ``step-NNNNNN.ckpt`` (the optimizer step, six digits or more),
      last.ckpt being a second name (a hard link, a copy where the filesystem has none) of the newest: ``keep``
      checkpoints' worth of disk. Older step files are removed; those of steps after the current one (left by the
      run a resume went back from) stay until this run saves that step.
    - ``best``: ``best.ckpt`` is saved after each validation whose bpb is the lowest so far (the run dir's: a
      resumed run compares with the best.json already there, which names its step and bpb): a second name of
      last.ckpt where that holds the step, else one more checkpoint's worth of disk.

    Every file is written whole or not at all (the trainer's AtomicCheckpointIO, :mod:`vqattn.files`). A failed
    write noted anywhere in the run (metrics.csv, train.log, a checkpoint) stops it here
    (:func:`vqattn.train.saving.stop_on_failure`): after every step in one process, at every save under DDP.

    Never from non-finite weights or optimizer state: the run stops there instead (:class:`Diverged`), and last.ckpt
    keeps the last finite step. Lightning runs Checkpoint callbacks after the others, so the saved step includes
    their state (RNGState). Saving is a collective under DDP: every rank calls it at the same step, rank 0 writes.
    """

    def __init__(self, dirpath: Path, every_n_train_steps: int, keep: int = 1, best: bool = False):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"checkpoint_keep must be a positive int (1: last.ckpt alone), got {keep!r}")
        self.dirpath, self.every_n_train_steps, self.keep, self.best = Path(dirpath), every_n_train_steps, keep, best
        self.path = self.dirpath / "last.ckpt"
        self.best_path, self.best_record = self.dirpath / "best.ckpt", self.dirpath / "best.json"
        self.saved_step: int | None = None
        self.best_bpb, self.best_step = math.inf, None

    def step_path(self, step: int) -> Path:
        return self.dirpath / f"step-{step:06d}.ckpt"

    def _save(self, trainer, pl_module) -> None:
        if trainer.global_step != self.saved_step and not trainer.sanity_checking:
            stop_on_failure()  # a log that could not be written stops the run before this save
            self._check_finite(trainer, pl_module)
            trainer.save_checkpoint(self.path, weights_only=False)
            if self.keep > 1 and trainer.is_global_zero:
                _noted_under_ddp(self._keep_step, trainer.global_step)
            stop_on_failure()
            self.saved_step = trainer.global_step

    def _keep_step(self, step: int) -> None:
        """last.ckpt (just saved at ``step``) also as its step file; the step files beyond ``keep`` removed."""
        _second_name(self.path, self.step_path(step))
        steps = sorted(s for s in (_step_of(p) for p in self.dirpath.glob("step-*.ckpt")) if s is not None and s <= step)
        for old in steps[:-self.keep]:
            with write_failed_as(self.step_path(old)):
                self.step_path(old).unlink(missing_ok=True)

    @staticmethod
    def _check_finite(trainer, pl_module) -> None:
        """Raise Diverged unless the module's weights and buffers and the optimizers' states are finite (on every
        rank)."""
        tensors = list(pl_module.state_dict().values())
        for optimizer in trainer.optimizers:
            tensors += [t for state in optimizer.state.values() for t in state.values()]
        if _any_rank(trainer, not bool(_all_finite(tensors))):
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else math.nan
            loss = trainer.callback_metrics.get("train_loss", math.nan)
            raise Diverged(trainer.global_step, "the last update left non-finite weights", float(loss), lr)

    def on_train_start(self, trainer, pl_module):
        self.saved_step = trainer.global_step  # a resumed run's checkpoint holds this step already
        if trainer.is_global_zero:  # what a process killed mid-save left
            for name in ("last.ckpt", "best.ckpt", "best.json", "step-*.ckpt"):
                remove_temporaries(self.dirpath, name)
        if self.best and self.best_record.is_file():  # the run dir's best so far, whichever checkpoint this run resumed
            record = json.loads(self.best_record.read_text())
            self.best_bpb, self.best_step = float(record["val_bpb"]), int(record["step"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.world_size == 1:
            stop_on_failure(collective=False)
        if trainer.global_step % self.every_n_train_steps == 0:
            self._save(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module):
        """best.ckpt after a validation with the lowest bpb so far: last.ckpt's second name where it holds this
        step (always so for the validation after training), else a save of its own."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not self.best or trainer.sanity_checking or (not fitting and self.saved_step != trainer.global_step):
            return  # a validate() outside a run has no training state to keep
        validation = pl_module.last_validation or {}
        bpb = float(validation.get("val_bpb", math.nan))
        improved = bool(math.isfinite(bpb) and bpb < self.best_bpb)
        if trainer.world_size > 1:  # the ranks agree, as every one of them must take part in a save
            improved = trainer.strategy.broadcast(improved, src=0)
        if not improved:
            return
        stop_on_failure()
        step = trainer.global_step
        if self.saved_step == step:
            if trainer.is_global_zero:
                _noted_under_ddp(_second_name, self.path, self.best_path)
        else:
            trainer.save_checkpoint(self.best_path, weights_only=False)
        if trainer.is_global_zero:
            _noted_under_ddp(write_text, self.best_record, json.dumps({"step": step, "val_bpb": bpb}) + "\n")
        stop_on_failure()
        self.best_bpb, self.best_step = bpb, step

    def on_train_end(self, trainer, pl_module):
        self._save(trainer, pl_module)


def _second_name(source: Path, target: Path) -> None:
    """``target`` replaced, atomically, by a hard link to ``source`` (a copy where the filesystem has no links)."""
    with atomic_path(target) as temporary:
        try:
            os.link(source, temporary)
        except OSError:
            shutil.copyfile(source, temporary)


def _step_of(path: Path) -> int | None:
    """The step of a ``step-NNNNNN.ckpt`` file name, else None."""
    digits = path.stem.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


def _noted_under_ddp(write, *args) -> None:
    """``write(*args)`` on rank 0 alone: under DDP its failure is noted, not raised, so that no rank is left at the
    next collective; the next :func:`stop_on_failure` raises it on every rank."""
    try:
        write(*args)
    except WriteFailed as failure:
        if not distributed():
            raise
        note_failure(failure)


class StepProgressBar(TQDMProgressBar):
    """The TQDM bar counting the run's optimizer steps (global_step of max_steps).

    Lightning's bar counts the current epoch's batches and loses its total after a mid-epoch resume ("81/?");
    this one continues a resumed run at its step, with the run's total, and, when the trainer has a TokenThroughput
    callback (``run_totals``), at the run's elapsed time: the wall time of the parts it resumes from plus this one's.
    The clock starts once per process: a resumed run's later epochs (its first is what remained of the interrupted
    one) keep the elapsed time and the rate instead of starting them again.
    Its metrics are this run's: a resumed run shows no validation result until its own first validation.

    Every validation inside fit logs one line with its metrics (``validation at step 200/1200: val_acc 0.5000,
    val_bpb 2.1000, val_loss 1.4000``). In a terminal (``terminal`` None, the default, where the bars' stdout is
    one) validations also get their passing bars, and the line goes to train.log alone, as the training bar shows
    the metrics. Elsewhere (a log file, a pipe, a batch job) no bar is drawn, since each redraw would be a line of
    the log (156 KB for the default run): training logs a plain line instead (:func:`progress_line`), every
    ``every`` of the run's steps or ``seconds`` seconds, whichever comes first, and at its last step, and each
    validation's line goes to the console and train.log.
    """

    def __init__(self, terminal: bool | None = None, every: float = 0.05, seconds: float = 30.0, **kwargs):
        super().__init__(**kwargs)
        if not 0 < every <= 1:
            raise ValueError(f"every must be a fraction of the run in (0, 1], got {every!r}")
        if not seconds > 0:
            raise ValueError(f"seconds must be positive, got {seconds!r}")
        self.terminal, self.every, self.seconds = terminal, every, seconds
        self._last_line: tuple[int, float] | None = None  # (step, time.time()) of the last plain line
        self.run_totals: TokenThroughput | None = None  # the trainer's, found at setup
        self._restored: dict = {}  # metrics a resumed run starts with, shown once this run has measured them
        self._start_t: float | None = None  # the bar's start time: this process's training start less the parts
        self._initial = 0  # resumed from; and the steps its elapsed time does not cover

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.run_totals = next((c for c in trainer.callbacks if isinstance(c, TokenThroughput)), None)

    def _start_clock(self, trainer) -> None:
        """The run's clock, once per process as training starts: elapsed is the wall time of the parts resumed from
        (none for a fresh run) plus this process's since now, and every later epoch keeps counting on it."""
        before = self.run_totals.wall_before if self.run_totals is not None else 0.0  # the parts resumed from
        # tqdm's clock is time.time (not its _time(), which the disabled bars of ranks > 0 do not have)
        self._start_t = time.time() - before
        # tqdm's rate is (n - initial) / elapsed: the steps the elapsed time covers, all of them when it includes
        # the parts resumed from, else this process's
        self._initial = 0 if before else trainer.global_step

    def _reset(self, trainer) -> None:
        bar = self.train_progress_bar
        bar.total = trainer.max_steps
        if self._start_t is None:
            self._start_clock(trainer)
        bar.n = bar.last_print_n = trainer.global_step
        bar.initial = self._initial
        # tqdm's reset() is not used: it would first show 0/total, and restart the clock at each epoch
        bar.last_print_t = time.time()
        bar.start_t = self._start_t
        bar.set_description("Training")  # refreshes

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self._restored = dict(trainer.progress_bar_metrics)
        self._start_clock(trainer)
        self._reset(trainer)
        self._last_line = (trainer.global_step, time.time())

    def on_train_epoch_start(self, trainer, *args):
        self._reset(trainer)  # not super's: it would count the epoch's batches again

    def _terminal(self) -> bool:
        return self.terminal if self.terminal is not None else sys.stdout.isatty()

    def init_train_tqdm(self) -> Tqdm:
        return super().init_train_tqdm() if self._terminal() else Tqdm(disable=True)

    def init_sanity_tqdm(self) -> Tqdm:
        return super().init_sanity_tqdm() if self._terminal() else Tqdm(disable=True)

    def init_validation_tqdm(self) -> Tqdm:
        return super().init_validation_tqdm() if self._terminal() else Tqdm(disable=True)

    def on_validation_end(self, trainer, pl_module):
        super().on_validation_end(trainer, pl_module)
        self._restored.clear()
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and trainer.is_global_zero:
            line = validation_line(trainer)
            if self._terminal():
                log_to_file(line)
                return
            bar = self._train_progress_bar
            if bar is not None and not bar.disable:  # the line after the training bar's, not at its end
                bar.fp.write("\n")
                bar.fp.flush()
            train_log.info("%s", line)

    def on_train_epoch_end(self, trainer, pl_module):
        # After the last epoch the bar is closed (its last state printed once, ending the line) before Lightning
        # logs why fit stopped; a resumed run's first epoch is what remained of the interrupted one.
        last = (trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
                or trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs)
        if last:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            self.train_progress_bar.close()

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        return {k: v for k, v in metrics.items() if k not in self._restored or v != self._restored[k]}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        if bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
            if not self._terminal() and trainer.is_global_zero and self._line_due(trainer):
                train_log.info("%s", self._progress_line(trainer, pl_module))

    def _line_due(self, trainer) -> bool:
        """Whether a plain progress line is due: ``every`` of the run's steps or ``seconds`` since the last line
        (or since training started in this process), or the run's last step."""
        now, step = time.time(), trainer.global_step
        last_step, last_t = self._last_line if self._last_line is not None else (step, now)
        due = (step >= trainer.max_steps or step - last_step >= max(1, round(self.every * trainer.max_steps))
               or now - last_t >= self.seconds)
        if due:
            self._last_line = (step, now)
        return due

    def _progress_line(self, trainer, pl_module) -> str:
        bar = self.train_progress_bar
        elapsed = time.time() - self._start_t
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items()
                   if not k.startswith("val_") and k != "v_num"}
        tokens = self.run_totals.rate(trainer.world_size) if self.run_totals is not None else None
        return progress_line(trainer.global_step, trainer.max_steps, metrics, tokens, elapsed, bar.n - bar.initial)


def progress_line(step: int, max_steps: int, metrics: dict, tokens_per_sec: float | None, elapsed: float,
                  steps_timed: int) -> str:
    """The training bar as one plain line for a log file: ``step 120/1200 (10%): train_bpb 2.5123, 7,512 tokens/s,
    0:45 elapsed, 6:43 left``; the time left is the remaining steps at the rate of the ``steps_timed`` steps that
    ``elapsed`` covers (validations included)."""
    from tqdm import tqdm

    parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(metrics.items())]
    if tokens_per_sec is not None:
        parts.append(f"{tokens_per_sec:,.0f} tokens/s")
    parts.append(f"{tqdm.format_interval(elapsed)} elapsed")
    if steps_timed > 0:
        parts.append(f"{tqdm.format_interval(elapsed / steps_timed * (max_steps - step))} left")
    return f"step {step}/{max_steps} ({100 * step / max_steps:.0f}%): {', '.join(parts)}"


def validation_line(trainer) -> str:
    """One line for a validation inside fit: the step and the validation metrics the progress bar shows."""
    metrics = trainer.progress_bar_metrics
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("val_"))
    return f"validation at step {trainer.global_step}/{trainer.max_steps}: {shown}"


class TokenThroughput(Callback):
    """Training tokens per second, validation excluded, and the run's totals across resumes.

    Logs ``train/device/items_per_sec`` (this process's tokens per second over the last ``window_size`` batches)
    and ``train/items_per_sec`` (times the world size) with the train rows. ``totals()`` gives results.json its
    tokens per second: all ranks' training tokens over the training time (steps and data loading, not validation),
    and ``wall_seconds()`` the run's wall time since ``started`` (the ``clock`` reading when the run began: start-up
    counts). The three totals go into the checkpoint, so a resumed run continues them: results.json and the
    summary line describe the whole run, tokens T = T_before + T_now and seconds likewise, not the resumed part.

    When the median step of a full window takes ``slowdown`` times as long as the fastest window's median, with more
    than one intra-op thread, rank 0 logs one hint: other work that took a core after the run chose its threads
    (threads=auto counts the idle cores at the start) stalls every thread, and fewer threads can be many times
    faster. The median ignores a few slow steps (a moment of other work, a checkpoint); lasting load moves it.

    ``clock`` is the timer in seconds (``time.perf_counter``); tests pass one they advance themselves.
    """

    def __init__(self, window_size: int = 50, *, clock=time.perf_counter, started: float | None = None,
                 slowdown: float = 4.0):
        self.clock, self.slowdown = clock, slowdown
        self.fastest_step, self.hinted = math.inf, False  # the fastest window's median step (s); hint given
        self.started = clock() if started is None else started
        self.window: deque[tuple[float, int]] = deque(maxlen=window_size)  # (training clock, tokens so far)
        self.tokens = 0  # this process's training tokens since it started (its part of the run)
        self._seconds, self._since = 0.0, None  # training seconds so far; _since: the training clock runs since then
        self.tokens_before, self.wall_before = 0, 0.0  # all ranks' tokens and the wall time of the parts resumed from
        self._world_size = 1

    def setup(self, trainer, pl_module, stage):
        self._world_size = trainer.world_size

    def _clock(self) -> float:
        """Seconds of training so far, resumed parts included (the time since on_train_start, less validation)."""
        return self._seconds + (self.clock() - self._since if self._since is not None else 0.0)

    def _pause(self) -> None:
        self._seconds, self._since = self._clock(), None

    def on_train_start(self, trainer, pl_module):
        self._since = self.clock()
        self.window.clear()

    def on_validation_start(self, trainer, pl_module):
        self._pause()

    def on_validation_end(self, trainer, pl_module):
        # A validation inside fit resumes the clock; the final trainer.validate does not. (trainer.training is
        # False in this hook, also inside fit: the loop switches back to training only after it.)
        if trainer.state.fn == TrainerFn.FITTING:
            self._since = self.clock()

    def on_train_end(self, trainer, pl_module):
        self._pause()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens += batch[0].numel()
        self.window.append((self._clock(), self.tokens))
        if len(self.window) > 1:
            rate = self.rate()
            pl_module.log_dict({"train/device/items_per_sec": rate, "train/items_per_sec": rate * trainer.world_size},
                               on_step=True, on_epoch=False)
            if len(self.window) == self.window.maxlen:
                self._hint_if_slowed(trainer)

    def _hint_if_slowed(self, trainer) -> None:
        times = [t for t, _ in self.window]
        step = statistics.median(b - a for a, b in zip(times, times[1:]))
        self.fastest_step = min(self.fastest_step, step)
        if self.hinted or step < self.slowdown * self.fastest_step or torch.get_num_threads() == 1:
            return
        self.hinted = True
        if trainer.is_global_zero:
            train_log.warning("training runs %.0fx slower than earlier in this run: if other work took a core, fewer "
                              "threads can be many times faster (Ctrl-C, then resume with threads=1)",
                              step / self.fastest_step)

    def rate(self, world_size: int = 1) -> float | None:
        """All ranks' training tokens per second over the last ``window_size`` batches (None before two)."""
        if len(self.window) < 2:
            return None
        (t0, n0), (t1, n1) = self.window[0], self.window[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9) * world_size

    def totals(self, world_size: int) -> tuple[int, float]:
        """All ranks' training tokens and the training time (s) of the whole run, resumed parts included."""
        return self.tokens_before + self.tokens * world_size, self._clock()

    def wall_seconds(self) -> float:
        """Wall time of the whole run: the parts resumed from, and this one since ``started``."""
        return self.wall_before + self.clock() - self.started

    def state_dict(self) -> dict:
        tokens, seconds = self.totals(self._world_size)
        return {"train_tokens": tokens, "train_seconds": seconds, "wall_seconds": self.wall_seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_before, self._seconds = state["train_tokens"], state["train_seconds"]
        self.wall_before = state["wall_seconds"]


class ParamSummary(ModelSummary):
    """Lightning's model summary without its FLOPs column, which counts only modules given an
    ``example_input_array`` (LitLM has none: the column would show zeros)."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:
        columns = [(head, [str(v) for v in values]) for head, values in summary_data if head != "FLOPs"]
        widths = [max(len(head), *(len(v) for v in values)) for head, values in columns]
        rows = [[head for head, _ in columns], *zip(*(values for _, values in columns))]
        lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines += [f"{get_human_readable_count(trainable_parameters):<10}Trainable params",
                  f"{get_human_readable_count(total_parameters):<10}Total params",
                  f"{model_size:<10,.3f}Total estimated model params size (MB)"]
        log.info("\n" + "\n".join(lines))


def instantiate_callbacks(cfg, trainer_cfg, started: float | None = None) -> list[Callback]:
    """The callbacks the ``callbacks`` group names (conf/callbacks), each built from its ``_target_``, less a
    progress bar with ``trainer.enable_progress_bar=false`` and a model summary with
    ``trainer.enable_model_summary=false`` (Lightning refuses them there); a TokenThroughput's wall time counts from
    ``started`` (the ``time.perf_counter()`` at which the run began), when given."""
    from .configs import instantiate_targets

    callbacks = []
    for callback in instantiate_targets(cfg, "callbacks"):
        if (isinstance(callback, ProgressBar) and trainer_cfg.enable_progress_bar is False
                or isinstance(callback, ModelSummary) and trainer_cfg.enable_model_summary is False):
            continue
        if isinstance(callback, TokenThroughput) and started is not None:
            callback.started = started
        callbacks.append(callback)
    return callbacks
