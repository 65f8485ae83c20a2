"""The LightningModule that trains ``vqattn.model.GPT``.

loss = NLL + aux_weight * aux, where NLL is the mean next-token cross-entropy (nats) over labelled positions
and aux is the model's summed auxiliary (codebook commitment) loss. AdamW with linear warmup then cosine
decay to ``min_lr_ratio * lr``; gradient clipping is the Trainer's ``gradient_clip_val``.

Logged: train_loss, train_nll, train_aux, train_bpb, lr, tokens_per_sec (all ranks' tokens per second of
training step: forward, backward, optimizer; no data loading or validation), and on each validation
val_loss, val_bpb, val_acc (next-byte accuracy; recall accuracy for MQAR, whose labels are the answers only)
and the codebook usage stats (codebook_perplexity, codebook_dead_codes, codebook_quant_error).
With ``carry_state`` each training step continues the previous step's rows from their detached state (vqattn.carry;
the data must then be consecutive segments, ``data.stream``). A datamodule with a second validation loader (the
carried pass, ``data.val_carried``) adds val_loss_carried, val_bpb_carried and val_acc_carried.
At the end of training ``buffer_divergence`` records how far the ranks' model buffers drifted apart (0 when
the codebook EMA and feature redraws stay identical across DDP ranks, as they must).
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from .carry import CarriedState
from .data import IGNORE_INDEX
from .model import GPT, GPTConfig

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


def rng_state() -> dict:
    """The torch RNG states of this process: CPU, and every CUDA device's when there are any."""
    state = {"rng_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


class LitLM(L.LightningModule):
    """Args:
        model: GPTConfig keyword arguments (a plain dict, so it is saved in the checkpoint's hyperparameters).
        optim: lr, weight_decay, betas, warmup_steps, min_lr_ratio, total_steps (the cosine horizon;
            None = trainer.max_steps; fix it explicitly to stop early and resume on the same schedule).
        aux_weight: weight of the auxiliary (commitment) loss.
        carry_state: train on consecutive segments, each step starting from the previous step's detached state.
    """

    def __init__(self, model: dict, optim: dict | None = None, aux_weight: float = 1.0, carry_state: bool = False):
        super().__init__()
        if carry_state and model.get("pos_emb", GPTConfig.pos_emb) == "learned":
            raise ValueError("carry_state=true needs model.pos_emb=rope or none: carried positions grow past "
                             "model.seq_len, which learned absolute positions cannot encode")
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(**model))
        self.optim = {"lr": 2e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "warmup_steps": 100,
                      "min_lr_ratio": 0.1, "total_steps": None, **(optim or {})}
        self.aux_weight = aux_weight
        self.val_nll = SummedNLL()
        self.val_nll_carried = SummedNLL()
        self.carry = CarriedState() if carry_state else None  # the training rows' state
        self.val_carry = CarriedState()  # the carried validation pass's state
        self.train_tokens = 0  # all ranks' tokens trained on in this process's fit
        self.train_seconds = 0.0  # time in training steps (see module docstring)
        self._step_start = 0.0
        self._rng: dict | None = None  # the RNG state as the last training step left it (see on_save_checkpoint)
        self.buffer_divergence = 0.0  # set by on_train_end, see rank_divergence

    def forward(self, idx: torch.Tensor):
        return self.model(idx)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.carry is not None and not getattr(self.trainer.datamodule, "stream", False):
            raise ValueError("carry_state=true trains on consecutive segments: it needs a datamodule with stream=True "
                             "(data.stream=true, a byte corpus), whose row r of batch i + 1 continues row r of batch i")

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T) each
        out = self.model(x) if self.carry is None else self.carry.forward(self.model, x)
        nll = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
        loss = nll + self.aux_weight * out.aux_loss
        self.log_dict({"train_loss": loss, "train_nll": nll, "train_aux": out.aux_loss})
        self.log("train_bpb", nll / LN2, prog_bar=True)
        self._rng = rng_state()
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self._rng is not None:
            set_rng_state(self._rng)
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        seconds = time.perf_counter() - self._step_start
        tokens = batch[0].numel() * self.trainer.world_size
        self.train_tokens += tokens
        self.train_seconds += seconds
        self.log("tokens_per_sec", tokens / max(seconds, 1e-9), prog_bar=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self):
        self.buffer_divergence = self.rank_divergence()

    def rank_divergence(self) -> float:
        """Largest |difference| between this rank's model buffers (codebook EMA state, feature-map draws, ...)
        and rank 0's; 0.0 without DDP. Parameters are synchronised by DDP itself; buffers must be by their layers."""
        buffers = [b.detach().double().flatten() for _, b in self.model.named_buffers()]
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
        passes = [(self.val_nll, "")]
        if self.val_nll_carried.update_count:  # a carried loader ran (on every rank alike)
            passes.append((self.val_nll_carried, "_carried"))
        for metric, suffix in passes:
            vals = metric.compute()  # already summed over ranks: identical everywhere
            metric.reset()
            self.log_dict({f"val_{k}{suffix}": v.float() for k, v in vals.items()}, prog_bar=not suffix,
                          sync_dist=True)
        self.val_carry.reset()
        self.log_dict({f"codebook_{k}": float(v) for k, v in self.model.codebook_stats().items()}, sync_dist=True)

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

    # The RNG state travels with the checkpoint so that a resumed run draws the same random numbers
    # (dropout, codebook restarts) as an uninterrupted one. Training steps draw from the state the previous step
    # left, so that what happens between steps (validation, a resumed run's new loader iterator) changes nothing.
    # The carried state travels with it too, every rank's (saving is a collective under DDP: see vqattn.carry).
    def on_save_checkpoint(self, checkpoint):
        checkpoint.update(self._rng or rng_state())
        if self.carry is not None:
            checkpoint["carry_state"] = self.carry.gathered(self.trainer.world_size)

    def on_load_checkpoint(self, checkpoint):
        if "rng_cpu" in checkpoint:
            self._rng = {k: checkpoint[k] for k in ("rng_cpu", "rng_cuda") if k in checkpoint}
            set_rng_state(self._rng)
        if self.carry is not None and "carry_state" in checkpoint and self._trainer is not None:  # resuming a fit
            self.carry.load(checkpoint["carry_state"], self.trainer.global_rank, self.trainer.world_size)
