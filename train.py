"""Train a byte-level GPT with any vqattn attention: ``python train.py attention=vq_soft``.

Hydra composes conf/config.yaml (see the README, "Training, comparing and sampling"); every run writes into its Hydra run dir:
results.json, metrics.csv (train and validation metrics per step), checkpoints/last.ckpt and .hydra/.

Multi-GPU (``trainer=ddp trainer.devices=N``): Lightning re-launches this script once per extra local
rank. Rank 0 passes its resolved overrides and its run dir to those processes through the environment
(``VQATTN_DDP_ARGV``), so every rank composes the same config and writes into rank 0's run dir: one run
dir per job, also inside a ``-m`` sweep. After each job the process group is destroyed and the
environment Lightning modified is restored, so the next sweep job launches fresh ranks instead of hanging.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import sys
import time
from pathlib import Path

DDP_ARGV = "VQATTN_DDP_ARGV"


def _ddp_child_argv() -> None:
    """In a process Lightning launched for local rank > 0, replace the command line by rank 0's job overrides.

    Lightning would re-run ``sys.argv`` (which in a sweep still holds ``-m`` and the comma lists) with
    ``hydra.run.dir`` set to the *un-swept* run dir; rank 0's own overrides and output dir are what we need.
    Processes started by an external launcher (torchrun, SLURM) have no VQATTN_DDP_ARGV and keep their
    arguments; there, pass the same ``hydra.run.dir`` to every rank (README, "Multi-GPU and multi-node").
    """
    rank = os.environ.get("LOCAL_RANK", "0")
    if rank != "0" and DDP_ARGV in os.environ:
        sys.argv = [sys.argv[0], *json.loads(os.environ[DDP_ARGV]), f"hydra.job.name=rank{rank}"]
    elif os.environ.get("RANK", rank) != "0":
        sys.argv.append("hydra.output_subdir=null")  # one .hydra/ config copy per run dir, from rank 0


_ddp_child_argv()

import hydra  # noqa: E402  (after the argv rewrite, which must precede Hydra's parsing)
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

log = logging.getLogger("train")


def check_config(cfg: DictConfig) -> None:
    """Explain settings that cannot work before anything is built."""
    m, d = cfg.model, cfg.data
    if "path" in d.keys() and OmegaConf.is_missing(d, "path"):
        raise ValueError("data=text needs the file to train on: data.path=FILE (a file or a glob)")
    if d.seq_len > m.seq_len and m.pos_emb == "learned":
        raise ValueError(
            f"data.seq_len={d.seq_len} exceeds model.seq_len={m.seq_len}, the longest sequence learned absolute "
            f"positions can encode; set data.seq_len <= model.seq_len or model.pos_emb=rope"
        )
    if not cfg.trainer.max_steps or cfg.trainer.max_steps <= 0:
        raise ValueError(f"trainer.max_steps must be a positive number of optimizer steps, got {cfg.trainer.max_steps}")


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: CUDA max allocated on a GPU, otherwise the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def train(cfg: DictConfig, run_dir: Path) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from vqattn.utils import tune_cpu_allocator

    start = time.perf_counter()
    check_config(cfg)
    tune_cpu_allocator()  # CPU steps reuse freed memory instead of page-faulting every temporary again
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.module, _convert_="all")
    ckpt_dir = run_dir / "checkpoints"
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        logger=CSVLogger(save_dir=str(run_dir), name="", version=""),
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=True,
                                   every_n_train_steps=cfg.checkpoint_every)],
    )
    if trainer.world_size > 1 and trainer.local_rank == 0:
        hc = HydraConfig.get()
        os.environ[DDP_ARGV] = json.dumps(
            [*hc.overrides.task, f'hydra.run.dir="{hc.runtime.output_dir}"', "hydra.output_subdir=null"])
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    trainer.save_checkpoint(ckpt_dir / "last.ckpt")
    val = {k: v for loader in trainer.validate(module, datamodule=datamodule, verbose=False) for k, v in loader.items()}
    memory, memory_kind = peak_memory_mb(trainer.strategy.root_device)
    results = {
        "attention": cfg.model.attention,
        "params": module.model.num_params(),
        "steps": trainer.global_step,
        "val_loss": val["val_loss"],
        "val_bpb": val["val_bpb"],
        "val_acc": val["val_acc"],
        **{k: val[k] for k in ("val_bpb_carried", "val_loss_carried", "val_acc_carried") if k in val},
        "state_floats": module.model.state_floats(cfg.data.seq_len),
        "carry_state": cfg.carry_state,
        "tokens_per_sec": module.train_tokens / max(module.train_seconds, 1e-9),
        "peak_memory_mb": memory,
        "peak_memory_kind": memory_kind,
        "wall_seconds": time.perf_counter() - start,
        "train_tokens": module.train_tokens,
        "data": type(datamodule).__name__,
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.data.batch_size,
        "world_size": trainer.world_size,
        "device": device_name(trainer.strategy.root_device),
        "checkpoint": str(ckpt_dir / "last.ckpt"),
        "codebook": module.model.codebook_stats(),
        "ddp_buffer_divergence": module.buffer_divergence,
    }
    if trainer.global_rank == 0:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        log.info("results: %s", json.dumps(results))
    return results


def _user_error(err: BaseException) -> BaseException | None:
    """The error to report in one line when err is a configuration or data problem, else None."""
    if isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    from vqattn.data import DataUnavailableError

    return err if isinstance(err, (ValueError, FileNotFoundError, DataUnavailableError)) else None


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    env = dict(os.environ)
    try:
        return train(cfg, run_dir)["val_bpb"]
    except Exception as err:
        user = _user_error(err)
        if user is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {type(user).__name__}: {user}\n(set HYDRA_FULL_ERROR=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


if __name__ == "__main__":
    main()
