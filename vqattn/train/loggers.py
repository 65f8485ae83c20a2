"""The run's loggers: metrics.csv always (RunCSVLogger), plus those the ``logger`` config group adds.

conf/logger/ follows lightning-hydra-template: each option is a dict of named loggers, each with a ``_target_``
(``logger=tensorboard``, ``logger=wandb``, ``logger=[tensorboard,wandb]``); ``save_dir: null`` means the run dir.
Every logger gets the same rows, at the step they were logged at (train rows at Lightning's batch index,
validation rows at the optimizer step they followed), so each plots against the step.
"""

from __future__ import annotations

import contextlib
import csv
import io
import sys
from pathlib import Path

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from ..files import WriteFailed, atomic_file, atomic_path, write_failed_as
from .configs import instantiate_targets
from .saving import note_failure


class RunCSVLogger(Logger):
    """metrics.csv and hparams.yaml straight in the run dir (one row per log call; columns sorted, ``step`` among
    them, a row's missing keys empty), continuing a resumed run's file.

    A resumed run (``resume_step`` > 0) keeps the rows its checkpoint already holds and drops those logged after
    it, which it logs again. Only rank 0 writes. Rows are appended; a rewrite (the first save, a new column) and
    hparams.yaml replace their file whole (:mod:`vqattn.files`), and a last row cut short by a kill or a full disk is
    not read back. A failed write keeps its rows for the next try and is noted for
    :func:`vqattn.train.saving.stop_on_failure`, which stops the run with one line.
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        super().__init__()
        self.run_dir, self.resume_step = Path(run_dir), resume_step
        self._hparams: dict = {}  # every call's, merged: the run's optimisation settings and the module's
        self.metrics_file_path = self.run_dir / "metrics.csv"
        self._rows: list[dict] = []
        self._keys: list[str] | None = None  # the file's columns, once read or written
        self._torn = False  # a failed append may have left a partial row

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.run_dir)

    @property
    def log_dir(self) -> str:
        return str(self.run_dir)

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._hparams.update(dict(params) if params is not None else {})
        try:
            with atomic_path(self.run_dir / "hparams.yaml") as temporary:
                save_hparams_to_yaml(temporary, self._hparams)
        except WriteFailed as failure:
            note_failure(failure)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        row = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        self._rows.append({**row, "step": len(self._rows) if step is None else step})

    def _before_resume(self, row: dict) -> bool:
        """Whether the checkpoint at resume_step already holds what row records. Train rows carry Lightning's batch
        index (step s: the (s+1)-th batch); validation rows the optimizer step they followed, and the validation
        at the checkpoint's own step is not run again."""
        step = int(row["step"])
        return step < self.resume_step or (step == self.resume_step and bool(row.get("val_bpb")))

    def _read_file(self, resuming: bool) -> list[dict]:
        """metrics.csv's rows (when resuming, only those before resume_step); sets the columns it has."""
        if not self.metrics_file_path.is_file():
            return []
        text = self.metrics_file_path.read_text()
        if not text.endswith("\n"):  # an append cut short: its last row is partial
            text = text[:text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = [r for r in reader if not resuming or self._before_resume(r)]
        self._keys = list(reader.fieldnames or [])
        return rows

    @rank_zero_only
    def save(self) -> None:
        try:
            with write_failed_as(self.metrics_file_path):
                self._save()
        except WriteFailed as failure:
            self._torn = True  # an append may have left part of a row: the next save writes the file whole
            note_failure(failure)

    def _save(self) -> None:
        first = self._keys is None  # the file is then rewritten: kept rows of an existing file, or a fresh one
        kept = self._read_file(resuming=True) if first else []
        self._keys = self._keys or []
        new_keys = {k for row in self._rows for k in row} - set(self._keys)
        if (new_keys or self._torn) and not first:  # a new column changes the header: the file is written again
            kept = self._read_file(resuming=False)
        self._keys = sorted({*self._keys, *new_keys})
        if not self._keys or not (first or new_keys or self._torn or self._rows):
            return
        rewrite = first or new_keys or self._torn
        with (atomic_file(self.metrics_file_path, "w", newline="") if rewrite
              else self.metrics_file_path.open("a", newline="")) as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            if rewrite:
                writer.writeheader()
            writer.writerows([*kept, *self._rows])
        self._rows, self._torn = [], False

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()


def extra_loggers(cfg: DictConfig | None, run_dir: Path) -> list[Logger]:
    """The loggers the ``logger`` group names, each built from its ``_target_``; ``save_dir: null`` is the run dir."""
    return instantiate_targets(cfg, "logger", lambda node: {"save_dir": str(run_dir)}
                               if node.get("save_dir", "unset") is None else {})


@contextlib.contextmanager
def wandb_run_finished():
    """End the Weights & Biases run that the job started (logger=wandb), however the job ends. wandb writes the run's
    history, config and summary (offline: RUN_DIR/wandb/offline-run-*/run-*.wandb) when the run finishes, which
    would otherwise wait for the process to exit; and the next job of a multirun starts a run of its own, where
    Lightning's WandbLogger would reuse a run still in progress (every job's metrics in the first job's run). The
    exit code wandb records is 0 when the job returned, 1 when it raised (an error, a divergence, Ctrl-C). A run
    in progress before the job (a notebook's own) is left alone."""
    before = getattr(sys.modules.get("wandb"), "run", None)
    failed = True
    try:
        yield
        failed = False
    finally:
        wandb = sys.modules.get("wandb")  # imported by WandbLogger: a job without logger=wandb has no run to end
        if wandb is not None and wandb.run is not None and wandb.run is not before:
            wandb.finish(exit_code=1 if failed else 0)
