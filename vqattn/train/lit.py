"""The LightningModule that trains ``vqattn.model.GPT``.

loss = NLL + aux_weight * aux, where NLL is the mean next-token cross-entropy (nats) over labelled positions
and aux is the model's summed auxiliary (codebook commitment) loss. AdamW with linear warmup then cosine
decay to ``min_lr_ratio * lr``; gradient clipping is the Trainer's ``gradient_clip_val``.

Logged: train_loss, train_nll, train_aux, train_bpb, and after each validation (one row at step =
global_step) val_loss, val_bpb, val_acc (next-byte accuracy; recall accuracy for MQAR, whose labels are the
answers only) and the codebook usage stats (codebook_perplexity, codebook_dead_codes, codebook_quant_error).
train.py adds Lightning's LearningRateMonitor and ThroughputMonitor (vqattn.train.callbacks) for the learning rate
and tokens per second.
With ``carry_state`` each training step continues the previous step's rows from their detached state (vqattn.train.carry;
the data must then be consecutive segments, ``data.stream``). A datamodule with a second validation loader (the
carried pass, ``data.val_carried``) adds val_loss_carried, val_bpb_carried and val_acc_carried.
At the end of training ``buffer_divergence`` records how far the ranks' model buffers drifted apart (0 when
the codebook EMA and feature redraws stay identical across DDP ranks, as they must).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from .carry import CarriedState
from ..feature_maps import set_feature_step
from ..model import GPT, IGNORE_INDEX, GPTConfig

LN2 = math.log(2.0)


class SummedNLL(Metric):
    """Sum of per-token NLL (nats), token count and correct argmax predictions over labelled positions.

    The states are sums reduced with ``dist_reduce_fx="sum"``, so under DDP ``compute`` returns the exact
    mean over all ranks' tokens, however unevenly the ranks' batches are sized:
        loss = sum NLL / count,  bpb = loss / ln 2 (one token is one byte),  acc = correct / count.
    """

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nll_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("correct", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits (B, T, V), targets (B, T) with IGNORE_INDEX at unlabelled positions."""
        mask = targets != IGNORE_INDEX  # (B, T)
        logits, targets = logits[mask].float(), targets[mask]  # (N, V), (N,)
        self.nll_sum += F.cross_entropy(logits, targets, reduction="sum").double()
        self.count += targets.numel()
        self.correct += (logits.argmax(dim=-1) == targets).sum()

    def compute(self) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise ValueError("SummedNLL.compute: no labelled tokens were seen (empty validation set?)")
        loss = self.nll_sum / self.count
        return {"loss": loss, "bpb": loss / LN2, "acc": self.correct.double() / self.count}


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: (step + 1) / warmup during warmup, then cosine from 1 to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class OptimConfig:
    """AdamW and its schedule: linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at
    ``total_steps`` (the cosine horizon; None = trainer.max_steps; fix it to stop early and resume on the same
    schedule)."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    total_steps: int | None = None

    def __post_init__(self):
        self.betas = tuple(self.betas)  # a list when it comes from a config
        rules = {  # key: (test, what is allowed)
            "lr": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, ">= 0"),
            "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
            "warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an int >= 0"),
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "total_steps": (lambda v: v is None or isinstance(v, int) and v > 0, "a positive int or None"),
        }
        for key, (test, allowed) in rules.items():
            value = getattr(self, key)
            try:
                ok = not isinstance(value, (bool, str)) and test(value)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"optim.{key} must be {allowed}, got {value!r}")


def model_config(model: dict) -> GPTConfig:
    """GPTConfig(**model), with errors about a field named as the config key a user types (model.seq_len)."""
    try:
        return GPTConfig(**model)
    except ValueError as err:
        first = str(err).split(" ", 1)[0]
        if first in {f.name for f in fields(GPTConfig)}:
            raise ValueError(f"model.{err}") from None
        raise


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path``, loaded safely (``weights_only=True``: tensors and plain values only).

    Raises FileNotFoundError or a one-line ValueError when it is missing or is not a valid checkpoint (never
    with torch's advice to load untrusted files with ``weights_only=False``).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated, not a zip, not a torch file, or unsafe pickled objects
        raise ValueError(f"{str(path)!r} is not a valid checkpoint (torch.load failed: {type(err).__name__})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint written by train.py (no state_dict/global_step)")
    return checkpoint


class LitLM(L.LightningModule):
    """Args:
        model: GPTConfig keyword arguments (a plain dict, so it is saved in the checkpoint's hyperparameters).
        optim: OptimConfig keyword arguments (missing ones take OptimConfig's defaults).
        aux_weight: weight of the auxiliary (commitment) loss.
        compile: ``torch.compile`` the model (in place: checkpoints keep the eager parameter names).
        carry_state: train on consecutive segments, each step starting from the previous step's detached state.
        carry_segments: with ``carry_state``, the carried state starts afresh every ``carry_segments`` optimizer
            steps (None: never), so a training sequence is carry_segments × seq_len tokens (Transformer-VQ's
            sequence length, made of update-length segments). Without a reset the vq caches' counts grow over the
            whole run (millions of keys per code) and the model learns cache biases that no evaluation context has.
    """

    def __init__(self, model: dict, optim: dict | None = None, aux_weight: float = 1.0, compile: bool = False,
                 carry_state: bool = False, carry_segments: int | None = 16):
        super().__init__()
        if carry_segments is not None and (isinstance(carry_segments, bool) or not isinstance(carry_segments, int)
                                           or carry_segments < 1):
            raise ValueError(f"carry_segments must be a positive int or None (never reset), got {carry_segments!r}")
        if carry_state and model.get("pos_emb", GPTConfig.pos_emb) == "learned":
            raise ValueError("carry_state=true needs model.pos_emb=rope or none: carried positions grow past "
                             "model.seq_len, which learned absolute positions cannot encode")
        self.save_hyperparameters()
        self.model = GPT(model_config(model))
        if compile:
            self.model.compile()
        self.optim = asdict(OptimConfig(**(optim or {})))
        self.aux_weight = aux_weight
        self.val_nll = SummedNLL()
        self.val_nll_carried = SummedNLL()
        self.carry = CarriedState() if carry_state else None  # the training rows' state
        self.carry_segments = carry_segments
        self._carry_reset_step = -1  # the optimizer step whose first micro-batch last reset the carried state
        self.val_carry = CarriedState()  # the carried validation pass's state
        self.last_validation: dict | None = None  # {"step", "val_loss", "val_bpb", "val_acc", "codebook_..."}
        self.buffer_divergence = 0.0  # set by on_train_end, see rank_divergence

    flops_per_batch = None  # read by ThroughputMonitor; FLOPs are not counted

    def forward(self, idx: torch.Tensor):
        return self.model(idx)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.carry is not None and not getattr(self.trainer.datamodule, "stream", False):
            raise ValueError("carry_state=true trains on consecutive segments: it needs a datamodule with stream=True "
                             "(data.stream=true, a byte corpus), whose row r of batch i + 1 continues row r of batch i")

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T) each
        step = self.trainer.global_step
        if self.carry is not None and self.carry_segments and step % self.carry_segments == 0 \
                and step != self._carry_reset_step:
            # A function of the global step only (first micro-batch of that step): resumed runs reset alike.
            self.carry.reset()
            self._carry_reset_step = step
        out = self.model(x) if self.carry is None else self.carry.forward(self.model, x)
        nll = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
        loss = nll + self.aux_weight * out.aux_loss
        self.log_dict({"train_loss": loss, "train_nll": nll, "train_aux": out.aux_loss})
        self.log("train_bpb", nll / LN2, prog_bar=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        set_feature_step(self.model, self.trainer.global_step)  # Performer redraws follow the global step

    def on_train_end(self):
        self.buffer_divergence = self.rank_divergence()

    def rank_divergence(self) -> float:
        """Largest |difference| between this rank's persistent model buffers (codebook EMA state, feature-map
        draws, ...) and rank 0's; 0.0 without DDP. Parameters are synchronised by DDP itself; buffers must be by
        their layers. Non-persistent buffers (e.g. the codebook's usage stats of this rank's last batch) are
        per-rank diagnostics and are left out."""
        persistent = self.model.state_dict().keys()
        buffers = [b.detach().double().flatten() for name, b in self.model.named_buffers() if name in persistent]
        if self.trainer.world_size == 1 or not buffers:
            return 0.0
        flat = torch.cat(buffers)
        gathered = self.all_gather(flat)  # (world, N)
        return float((gathered - gathered[0]).abs().max())

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        """Loader 0: independent windows. Loader 1 (data.val_carried): consecutive segments, state carried."""
        x, y = batch
        if dataloader_idx == 0:
            self.val_nll.update(self.model(x).logits, y)
            return
        if batch_idx == 0:
            self.val_carry.reset()
        self.val_nll_carried.update(self.val_carry.forward(self.model, x).logits, y)

    def on_validation_epoch_end(self):
        metrics = {}
        passes = [(self.val_nll, "")]
        if self.val_nll_carried.update_count:  # a carried loader ran (on every rank alike)
            passes.append((self.val_nll_carried, "_carried"))
        for metric, suffix in passes:
            vals = metric.compute()  # already summed over ranks: identical everywhere
            metric.reset()
            metrics.update({f"val_{k}{suffix}": float(v) for k, v in vals.items()})
        self.val_carry.reset()
        metrics.update({f"codebook_{k}": float(v) for k, v in self.model.codebook_stats().items()})
        for key, value in metrics.items():  # progress bar and callback_metrics; the logger row is written below
            self.log(key, value, prog_bar=key.startswith("val_") and "_carried" not in key, logger=False, sync_dist=True)
        # Written at global_step, the number of optimizer steps done (Lightning's own step for epoch-end logging
        # is the last batch index, 199 for the validation after 200 steps).
        if self.logger is not None and not self.trainer.sanity_checking:
            self.logger.log_metrics(metrics, step=self.global_step)
        self.last_validation = {"step": self.global_step, **metrics}

    def configure_optimizers(self):
        o = self.optim
        total = o["total_steps"] or self.trainer.max_steps
        if total is None or total <= 0:
            raise ValueError("the cosine schedule needs trainer.max_steps > 0 or optim.total_steps")
        # Matrices decay; norms, biases, scalars (e.g. learned temperatures) and codebooks do not.
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.ndim >= 2 and "codebook" not in name else no_decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o["lr"], betas=tuple(o["betas"]),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, warmup_steps=o["warmup_steps"], total_steps=total,
                                            min_lr_ratio=o["min_lr_ratio"]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # The carried state travels with the checkpoint, every rank's (saving is a collective under DDP: see
    # vqattn.train.carry), so that a resumed run continues its rows from the state it stopped with.
    def on_save_checkpoint(self, checkpoint):
        if self.carry is not None:
            checkpoint["carry_state"] = self.carry.gathered(self.trainer.world_size)

    def on_load_checkpoint(self, checkpoint):
        if self.carry is not None and "carry_state" in checkpoint and self._trainer is not None:  # resuming a fit
            self.carry.load(checkpoint["carry_state"], self.trainer.global_rank, self.trainer.world_size)
