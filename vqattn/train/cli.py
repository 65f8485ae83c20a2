"""Train a byte-level GPT with any vqattn attention: ``vqattn-train attention=vq_soft`` (or ``python train.py ...``).

Hydra composes vqattn/train/conf/config.yaml on the schema vqattn.train.configs registers (see docs/training.md
and the README); every run writes into its Hydra run dir: results.json, metrics.csv, hparams.yaml,
checkpoints/last.ckpt, train.log and .hydra/. :func:`train` is the task: build, fit, validate, summarize;
:mod:`vqattn.train.lifecycle` wraps it (Ctrl-C saves the step and prints the resume command, one-line errors,
cleanup, the environment).

Multi-GPU (``trainer=ddp trainer.devices=N``): Lightning re-launches the command once per extra local rank;
:mod:`vqattn.train.launch` makes those processes compose rank 0's config and write into rank 0's run dir.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import resource
import sys
import time
import warnings
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from ..files import WRITE_FAILED_STATUS, WriteFailed
from ..utils import available_cores, pick_threads
from .checks import (
    check_config,
    check_resumable,
    cpu_processes_warning,
    raw_window_warning,
    unknown_key_error,
    unknown_option,
)
from .configs import config_groups, register
from .launch import DDP_ARGV, ddp_child_argv
from .lifecycle import (
    USER_ERROR_STATUS,
    Aborted,
    Interrupted,
    composition_errors_raised,
    discard_failed_run,
    exit_status,
    full_error_asked,
    hold_interrupts,
    interrupt_held,
    is_rank_zero,
    last_signal,
    stopped_by,
    task_started,
    task_wrapper,
)

log = logging.getLogger("train")
register()


_runs_in_process = 0  # the runs this process has summarised: a Hydra multirun runs its jobs one after the other in it


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this run: CUDA max allocated on a GPU (reset at its start), otherwise the process's peak
    resident set size, which no call resets: after the first run of a multirun it is the peak of every run so far,
    and its kind says so ("cpu_max_rss_of_process")."""
    global _runs_in_process
    _runs_in_process += 1
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    kind = "cpu_max_rss" if _runs_in_process == 1 else "cpu_max_rss_of_process"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, kind


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def instantiate_module(cfg: DictConfig):
    """The LitLM, with an attention layer's error named by the key the user types (attention.kwargs.num_codes, or
    for a hybrid stack layer_kwargs.ovq.num_slots)."""
    try:
        return hydra.utils.instantiate(cfg.module, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        first = str(cause).split(" ", 1)[0]
        if isinstance(cause, ValueError) and first.startswith("attention_kwargs."):  # GPT names a hybrid's layer
            raise ValueError(f"layer_kwargs.{str(cause).removeprefix('attention_kwargs.')}") from None
        if isinstance(cause, ValueError) and isinstance(cfg.model.attention, str) and first in cfg.attention.kwargs:
            raise ValueError(f"attention.kwargs.{cause}") from None
        raise


def build(cfg: DictConfig, run_dir: Path, started: float | None = None):
    """Module, data (loaded now, so data errors come before any training output) and a Trainer with its callbacks
    and loggers; ``started``: the ``time.perf_counter()`` at which the run began (the wall time counts from it)."""
    from lightning.pytorch.callbacks import LambdaCallback

    from ..checkpoint import read_checkpoint
    from .callbacks import GracefulInterrupt, LastCheckpoint, NonFiniteGuard, RNGState, instantiate_callbacks
    from .loggers import RunCSVLogger, extra_loggers
    from .saving import AtomicCheckpointIO, clear_failures

    check_config(cfg)
    clear_failures()  # a multirun's earlier job is not this one
    for warning in (cpu_processes_warning(cfg, available_cores(), torch.cuda.is_available()), raw_window_warning(cfg)):
        if warning is not None and is_rank_zero():
            log.warning("%s", warning)
    checkpoint = read_checkpoint(cfg.ckpt_path) if cfg.ckpt_path else None
    module = instantiate_module(cfg)  # model errors first: model.seq_len, not data's
    if checkpoint is not None:
        check_resumable(module, checkpoint, cfg.ckpt_path)
    resume_step = int(checkpoint["global_step"]) if checkpoint is not None else 0
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    if getattr(datamodule, "tokenizer", None) is not None:  # checkpoints keep it: sampling and the export decode with it
        module.tokenizer = datamodule.tokenizer
    # The checkpoint, its RNG states, Ctrl-C's saved step and a stop before a non-finite step are what resuming rests
    # on: every run has them.
    callbacks = [LastCheckpoint(run_dir / "checkpoints", cfg.checkpoint_every, cfg.checkpoint_keep, cfg.checkpoint_best),
                 RNGState(), GracefulInterrupt(),
                 NonFiniteGuard(cfg.nonfinite, cfg.nonfinite_max_skips),
                 *instantiate_callbacks(cfg.get("callbacks"), cfg.trainer, started)]
    if cfg.compile:  # the first steps compile the model: say so before the bar sits at 0/N
        callbacks.append(LambdaCallback(on_fit_start=_say_compiling))
    loggers = [RunCSVLogger(run_dir, resume_step), *extra_loggers(cfg.get("logger"), run_dir)]
    # every checkpoint written beside its target and renamed onto it: whole or not at all, on any filesystem
    trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers, callbacks=callbacks, plugins=[AtomicCheckpointIO()])
    # The optimizer and scheduler reach the module as partials, which its saved hyperparameters leave out: the
    # loggers get their settings here (Lightning adds the module's at fit).
    optimization = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("optim", "optimizer", "scheduler")
                    if cfg.get(key) is not None}
    for logger in trainer.loggers:
        logger.log_hyperparams(optimization)
    return module, datamodule, trainer


def _say_compiling(trainer, pl_module) -> None:
    if trainer.is_global_zero:
        log.info("compiling the model (compile=true): the first steps take a minute or more")


def run_threads(threads: int | str | None) -> int | None:
    """The intra-op threads a run sets for ``threads`` (:func:`vqattn.utils.pick_threads`: a positive int itself,
    None torch's default, "auto" the idle cores as the run starts), said in one line by rank 0; None keeps torch's
    default."""
    chosen, line = pick_threads(threads, "training")
    if is_rank_zero():
        log.info("%s", line)
    return chosen


@contextlib.contextmanager
def intra_op_threads(threads: int | str | None):
    """torch.set_num_threads(:func:`run_threads` (threads)) for the run, restored after."""
    before = torch.get_num_threads()
    chosen = run_threads(threads)
    if chosen is not None:
        torch.set_num_threads(chosen)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Train, validate once at the end (reusing the last in-fit validation when it was at the final step), write
    results.json; returns the results (raises Interrupted after Ctrl-C or SIGTERM, with the checkpoint saved, and
    Aborted after a second one); a Weights & Biases run the job started ends with it."""
    from .loggers import wandb_run_finished

    with intra_op_threads(cfg.get("threads")), wandb_run_finished():
        return _train(cfg, run_dir)


def _train(cfg: DictConfig, run_dir: Path) -> dict:
    import lightning as L

    from ..files import WriteFailed, write_text
    from ..utils import tune_cpu_allocator
    from .callbacks import GracefulInterrupt, TokenThroughput
    from .saving import note_failure, stop_on_failure

    start = time.perf_counter()
    code = code_version()  # as the run starts: a checkout may move on while it trains
    tune_cpu_allocator()  # CPU steps reuse freed memory instead of page-faulting every temporary again
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    module, datamodule, trainer = build(cfg, run_dir, started=start)
    if trainer.world_size > 1 and trainer.local_rank == 0 and HydraConfig.initialized():
        hc = HydraConfig.get()
        os.environ[DDP_ARGV] = json.dumps(
            [*hc.overrides.task, f'hydra.run.dir="{hc.runtime.output_dir}"', "hydra.output_subdir=null"])
    if trainer.strategy.root_device.type == "cuda" and torch.cuda.is_initialized():
        # an earlier run in this process (a sweep, a notebook) must not count; before CUDA's first use the
        # peak is zero already, and resetting it then raises "Invalid device argument"
        torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
    interrupt = next(c for c in trainer.callbacks if isinstance(c, GracefulInterrupt))
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
    except SystemExit as exit:  # Lightning's answer to a KeyboardInterrupt: a second Ctrl-C or SIGTERM, or one
        # before training
        raise Aborted(f"aborted at step {trainer.global_step}") from exit
    if interrupt.interrupted_at is not None:
        raise Interrupted(interrupt.interrupted_at, interrupt.signum)
    if module.last_validation is None or module.last_validation["step"] != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    results = summarize(cfg, module, datamodule, trainer, run_dir, code)
    throughput = next((c for c in trainer.callbacks if isinstance(c, TokenThroughput)), None)
    if throughput is not None:  # callbacks.throughput (dropped with ~callbacks.throughput or callbacks=none)
        tokens, seconds = throughput.totals(trainer.world_size)
        results["tokens_per_sec"], results["train_tokens"] = tokens / max(seconds, 1e-9), tokens
        results["wall_seconds"] = throughput.wall_seconds()
    if trainer.global_rank == 0:
        try:
            write_text(run_dir / "results.json", json.dumps(strict_json(results), indent=2, allow_nan=False) + "\n")
        except WriteFailed as failure:
            note_failure(failure)
    stop_on_failure()  # every rank alike: a write noted since the last save, results.json's
    if trainer.global_rank == 0:
        log.info("%s", summary_text(results, run_dir))
    return results


def strict_json(results: dict) -> dict:
    """``results`` as strict JSON allows it: each value that is not a finite number (NaN and infinities, which
    ``json.dumps`` would write as the non-JSON ``NaN`` and ``Infinity``) becomes null, and ``not_finite`` names
    each such key (dotted for nested ones) with the value it stands for, e.g. {"val_bpb": "nan"}."""
    reasons = {}

    def clean(value, key: str):
        if isinstance(value, float) and not math.isfinite(value):
            reasons[key] = str(value)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{key}.{i}") for i, v in enumerate(value)]
        return value

    out = clean(results, "")
    if reasons:
        out["not_finite"] = reasons
    return out


def summarize(cfg: DictConfig, module, datamodule, trainer, run_dir: Path, code: str) -> dict:
    from .callbacks import NonFiniteGuard

    val = module.last_validation
    memory, memory_kind = peak_memory_mb(trainer.strategy.root_device)
    results = {
        "attention": module.model.config.stack_name,  # ovq, or a hybrid's ovq×3+softmax
        "layer_attentions": module.model.config.layer_attentions,
        "params": module.model.num_params(),
        "steps": trainer.global_step,
        "headline": "val_bpb",
        "val_loss": val["val_loss"],  # nats per token
        "val_bpb": val["val_bpb"],  # bits per byte of the validation text, whatever the tokenizer
        "val_acc": val["val_acc"],
        **{k: val[k] for k in ("val_bpb_carried", "val_loss_carried", "val_acc_carried") if k in val},
        # per bucket "A_B" of positions A..B in the validation windows (LitLM's position_edges)
        **{f"val_{k}_by_position": {name: bucket[k] for name, bucket in val["by_position"].items()}
           for k in ("bpb", "acc", "tokens")},
        "state_floats": module.model.state_floats(cfg.data.seq_len),  # per layer (a hybrid's mean)
        "state_floats_total": module.model.state_floats(cfg.data.seq_len, total=True),  # summed layer by layer
        "carry_state": cfg.carry_state,
        "seed": cfg.seed,
        "lr": cfg.optim.lr,
        "tokens_per_sec": None,
        "peak_memory_mb": memory,
        "peak_memory_kind": memory_kind,
        "wall_seconds": None,
        "train_tokens": None,
        "data": type(datamodule).__name__,
        "corpus": datamodule.corpus(),
        "tokenizer": "bytes",  # MQAR's tokens are byte ids; a corpus's tokenizer is in the fields below
        "threads": torch.get_num_threads(),
        **tokenizer_fields(datamodule, val),
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.data.batch_size,
        "world_size": trainer.world_size,
        "device": device_name(trainer.strategy.root_device),
        "date": time.strftime("%Y-%m-%d"),
        "code": code,  # code_version() when the run started
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "codebook": module.model.codebook_stats(),
        "ddp_buffer_divergence": module.buffer_divergence,
        "nonfinite": cfg.nonfinite,
        "nonfinite_skipped": next(c.skipped for c in trainer.callbacks if isinstance(c, NonFiniteGuard)),
    }
    if results["data"] == "MQARDataModule":  # labels only at the answers: recall accuracy is the measure
        results["headline"], results["recall_acc"] = "recall_acc", val["val_acc"]
    return results


def tokenizer_fields(datamodule, val: dict) -> dict:
    """results.json's tokenizer (data.tokenizer), its vocabulary (the model's is padded from it) and bytes per token
    of the validation split and of the validation windows, for a corpus that has a tokenizer (not MQAR)."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is None:
        return {}
    return {"tokenizer": tokenizer.spec, "tokenizer_vocab_size": tokenizer.vocab_size,
            "val_bytes_per_token": datamodule.val_bytes_per_token, "val_window_bytes_per_token": val["bytes_per_token"]}


def code_version() -> str:
    """The code a run measured: the checkout's short commit (with "+changes" when its tracked files differ from it),
    else the installed package's version, so that a table or figure built from results.json can name it."""
    import subprocess

    from .. import __version__

    root = Path(__file__).resolve().parents[2]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return f"vqattn {__version__}"


def summary_text(r: dict, run_dir: Path) -> str:
    """The readable end of a run: the headline metric, speed (with callbacks.throughput), and where the files are."""
    head = (f"recall accuracy {r['recall_acc']:.4f} (val bpb {r['val_bpb']:.4f})" if r["headline"] == "recall_acc"
            else f"val bpb {r['val_bpb']:.4f} (val acc {r['val_acc']:.4f})")
    done = f"done: {r['attention']}, {r['steps']} steps"
    if r["tokens_per_sec"] is not None:
        done += f" in {r['wall_seconds'] / 60:.1f} min"
        head += f", {r['tokens_per_sec']:,.0f} tokens/s"
    return (f"{done}: {head}\nrun dir {run_dir}: results.json, metrics.csv, hparams.yaml, checkpoints/last.ckpt, "
            "train.log")


def quiet_console() -> None:
    """One copy of each Lightning INFO line (through Hydra's handlers, so train.log has them too), no adverts,
    and no deprecation warnings from inside Lightning that a user cannot act on."""
    import lightning  # noqa: F401  (it adds its own console handlers on import; remove them after)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda r: "litlogger" not in r.getMessage() and "configured with model summary" not in r.getMessage())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # Lightning's all_gather calls torch's deprecated autograd all_gather, once per rank
    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated.*")
    # bf16-mixed keeps fp32 weights: the summary's 32-bit size estimate is right
    warnings.filterwarnings("ignore", message=r".*is not supported by the model summary.*")
    # A resumed run's epoch is its remaining steps; train rows are still logged every log_every_n_steps global steps.
    warnings.filterwarnings("ignore", message=r".*is smaller than the logging interval.*")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    """One job: Hydra's return value is the run's headline metric (a sweeper's objective)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run_job(cfg, run_dir)
    return results.get("recall_acc", results["val_bpb"])


@task_wrapper
def run_job(cfg: DictConfig, run_dir: Path) -> dict:
    quiet_console()
    return train(cfg, run_dir)


def main() -> None:
    """Hydra's command line: what ``vqattn-train`` and ``python train.py`` run (through :mod:`vqattn.train.entry`).

    An option no config group has (attention=foo) is one line naming the group's options, exit status 2; so is a
    key the config does not have (model.block_len=5000), naming the nearest valid key (block_len). Hydra reports
    other command lines it cannot compose itself; that is a configuration error like those train() finds, so it
    exits 2 as they do. Ctrl-C at any point exits 130, SIGTERM
    143.
    """
    with hold_interrupts(), composition_errors_raised():
        try:
            sys.argv = ddp_child_argv(sys.argv, os.environ)
            unknown = unknown_option(sys.argv[1:], config_groups())
            if unknown is not None:
                print(f"error: {unknown}", file=sys.stderr)
                raise SystemExit(USER_ERROR_STATUS)
            hydra_main()
        except SystemExit as exit:
            if exit.code == 1 and not task_started():
                raise SystemExit(USER_ERROR_STATUS) from None
            raise
        except OSError as err:  # Hydra's own files of the job (its run dir, .hydra/, train.log): a full disk
            if task_started() or full_error_asked():
                raise
            run_dir = hydra_run_dir(err)
            path = err.filename or (run_dir if run_dir is not None else "the run dir")
            print(f"error: {WriteFailed(path, err)}; nothing was saved", file=sys.stderr)
            if run_dir is not None:
                discard_failed_run(run_dir)
            raise SystemExit(WRITE_FAILED_STATUS) from None
        except Exception as err:  # raised while Hydra composed the config (composition_errors_raised)
            if task_started() or full_error_asked():
                raise
            report_composition_error(err)
            raise SystemExit(USER_ERROR_STATUS) from None
    if interrupt_held():  # Ctrl-C or SIGTERM while Hydra composed the config, or after the last job of a multirun
        print("\n" + stopped_by(last_signal()) + ("" if task_started() else ": nothing was saved"), file=sys.stderr)
        raise SystemExit(exit_status())


def hydra_run_dir(err: BaseException) -> Path | None:
    """The run dir of the job whose setup raised ``err`` (Hydra writes .hydra/ and train.log there before the job
    starts), or None before Hydra knew it. Hydra's ``run_job`` holds it as ``output_dir``, and resets its
    HydraConfig as the error leaves, so it is read from that frame."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "run_job" and isinstance(tb.tb_frame.f_locals.get("output_dir"), str):
            return Path(tb.tb_frame.f_locals["output_dir"])
        tb = tb.tb_next
    return None


def report_composition_error(err: Exception) -> None:
    """What the command line prints for a config Hydra cannot compose: one line for an unknown key (with the nearest
    valid one), else Hydra's own report of its errors, or the traceback of anything else."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    line = unknown_key_error(err)
    if line is not None:
        print(f"error: {line}", file=sys.stderr)
    elif isinstance(err, CompactHydraException):  # as Hydra's run_and_report writes it
        cause = f"\n{err.__cause__}" if isinstance(err.__cause__, OmegaConfBaseException) else ""
        print(f"{err}{cause}\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
              file=sys.stderr)
    else:
        raise err


if __name__ == "__main__":
    main()
