"""Trainer parts of train.py that Lightning does not ship as such, each a small subclass or callback: per-rank
RNG state in checkpoints, a graceful Ctrl-C, one last.ckpt save per step, a run-long progress bar,
training-only throughput, and a CSV logger that continues a resumed run's metrics.csv.
"""

from __future__ import annotations

import csv
import signal
from pathlib import Path

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn


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
    """Ctrl-C (SIGINT) during fit: finish the current step and stop (LastCheckpoint then saves that step); a
    second Ctrl-C aborts.

    The flag is checked after each training batch, so the checkpoint holds a whole optimizer step (a
    KeyboardInterrupt raised inside ``optimizer.step`` could leave parameters half updated). Under DDP the
    ranks agree on the step to stop at by one boolean all-reduce per step. ``interrupted_at`` is the global
    step it stopped at, or None.
    """

    def __init__(self):
        self.interrupted_at, self._requested, self._previous = None, False, None

    def _handler(self, signum, frame):
        self._requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt

    def on_train_start(self, trainer, pl_module):
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stop = self._requested
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and self.interrupted_at is None:
            self.interrupted_at = trainer.global_step
            trainer.should_stop = True
            trainer.limit_val_batches = 0  # no validation pass on the way out

    def on_train_end(self, trainer, pl_module):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    on_exception = on_train_end


class LastCheckpoint(ModelCheckpoint):
    """ModelCheckpoint keeping only ``dirpath/last.ckpt``: every ``every_n_train_steps`` steps and once more when
    training ends (finished or interrupted) unless that step was just saved, so each step is written at most once."""

    def __init__(self, dirpath: Path, every_n_train_steps: int):
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps)

    def on_train_end(self, trainer, pl_module):
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class StepProgressBar(TQDMProgressBar):
    """The TQDM bar counting the run's optimizer steps (global_step of max_steps).

    Lightning's bar counts the current epoch's batches and loses its total after a mid-epoch resume ("81/?");
    this one continues a resumed run at its step, with the run's total.
    """

    def _reset(self, trainer) -> None:
        bar = self.train_progress_bar
        bar.total = trainer.max_steps
        bar.initial = bar.n = bar.last_print_n = trainer.global_step  # the rate counts this process's steps only
        bar.start_t = bar.last_print_t = bar._time()
        bar.set_description("Training")  # refreshes

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self._reset(trainer)

    def on_train_epoch_start(self, trainer, *args):
        self._reset(trainer)  # not super's: it would count the epoch's batches again

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        if bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


class TrainThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for tokens (items) per second, logging training throughput only.

    Validation batches are still timed, which is how the monitor excludes validation from training time, but
    their throughput is not logged (it would add rows at validation batch counts to metrics.csv).
    ``totals()`` gives results.json its tokens per second: all ranks' training tokens over the training wall time
    (steps and data loading, not validation).
    """

    def __init__(self, **kwargs):
        super().__init__(batch_size_fn=lambda batch: batch[0].size(0), length_fn=lambda batch: batch[0].numel(),
                         **kwargs)

    @rank_zero_only
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, *args, **kwargs):
        if not trainer.sanity_checking:
            self._update(trainer, pl_module, batch, trainer._evaluation_loop.batch_progress.total.ready)

    def totals(self, world_size: int) -> tuple[int, float]:
        """All ranks' training tokens and the training wall time (s) of this process's fit; rank 0 only."""
        throughput = self._throughputs.get(RunningStage.TRAINING)
        if throughput is None or not throughput._time:
            return 0, 0.0
        totals = throughput.compute()
        return int(totals["lengths"]) * world_size, float(totals["time"])


class _ContinuingWriter(ExperimentWriter):
    """ExperimentWriter that keeps an existing metrics.csv (the run dir also holds Hydra's files, and a resumed
    run continues its own file) and drops the rows logged after the step it resumes from, which it logs again."""

    def __init__(self, log_dir: str, resume_step: int = 0):
        self.resume_step = resume_step
        super().__init__(log_dir=log_dir)

    def _before_resume(self, row: dict) -> bool:
        """Whether the checkpoint at resume_step already holds what row records. Train rows carry Lightning's batch
        index (step s: the (s+1)-th batch); validation rows the optimizer step they followed, and the validation
        at the checkpoint's own step is not run again."""
        step = int(row["step"])
        return step < self.resume_step or (step == self.resume_step and bool(row.get("val_bpb")))

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            keys, rows = reader.fieldnames or [], [r for r in reader if self._before_resume(r)]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        self.metrics_keys = sorted(keys)


class RunCSVLogger(CSVLogger):
    """CSVLogger writing metrics.csv and hparams.yaml straight into the run dir, continuing a resumed run's file."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        super().__init__(save_dir=str(run_dir), name="", version="")
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = _ContinuingWriter(self.log_dir, self.resume_step)
        return self._experiment
