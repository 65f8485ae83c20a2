"""The LightningModule that trains ``vqattn.model.GPT``.

loss = NLL + aux_weight * aux, where NLL is the mean next-token cross-entropy (nats) over labelled positions
and aux is the model's summed auxiliary (codebook commitment) loss. The optimizer and its schedule are partials
(lightning-hydra-template's ``_partial_`` targets, conf/optimizer and conf/scheduler): by default AdamW with
linear warmup then cosine decay to ``min_lr_ratio * lr`` (:class:`OptimConfig`), or with ``optimizer=muon``
Muon on the blocks' weight matrices and AdamW on the rest (:class:`MuonAdamW`); gradient clipping is the
Trainer's ``gradient_clip_val``. Every metric goes through ``self.log``.

Logged: train_loss, train_nll, train_aux, train_bpb, and after each validation (one row at step =
global_step) val_loss, val_bpb, val_acc (next-byte accuracy; recall accuracy for MQAR, whose labels are the
answers only), per bucket of positions A..B of the validation windows val_bpb_pos_A_B and val_acc_pos_A_B
(``position_edges``; does the model use its context?) and the codebook usage stats (codebook_perplexity,
codebook_dead_codes, codebook_quant_error).
The trainer's callbacks (conf/callbacks) add Lightning's LearningRateMonitor for the learning rate and
TokenThroughput (vqattn.train.callbacks) for tokens per second.
With ``carry_state`` each training step continues the previous step's rows from their detached state (vqattn.train.carry;
the data must then be consecutive segments, ``data.stream``). A datamodule with a second validation loader (the
carried pass, ``data.val_carried``) adds val_loss_carried, val_bpb_carried and val_acc_carried.
At the end of training ``buffer_divergence`` records how far the ranks' model buffers drifted apart (0 when
the codebook EMA and feature redraws stay identical across DDP ranks, as they must).
Packed documents (``data.pack_documents``): a batch (x, y, starts) runs as one packed row of B·T tokens cut at the
documents' starts and at every row's start (:func:`packed_forward`), so no document sees another; the loss is the
same mean over tokens, and the validation's position buckets count positions within each document.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from ..checkpoint import model_config
from ..feature_maps import set_feature_step
from ..model import GPT, IGNORE_INDEX, GPTConfig, GPTOutput
from ..ops.varlen import Packing
from .carry import CarriedState

LN2 = math.log(2.0)


DEFAULT_POSITION_EDGES = (0, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def check_position_edges(edges) -> tuple[int, ...]:
    """``edges`` as a tuple, or ValueError: ints, strictly increasing, starting at 0."""
    edges = tuple(edges)
    if (not edges or edges[0] != 0 or any(isinstance(e, bool) or not isinstance(e, int) for e in edges)
            or any(a >= b for a, b in zip(edges, edges[1:]))):
        raise ValueError(f"position_edges must be strictly increasing ints starting at 0, e.g. [0, 64, 256, 1024], "
                         f"got {list(edges)!r}")
    return edges


class SummedNLL(Metric):
    """Sum of per-token NLL (nats), token count and correct argmax predictions over labelled positions, in total
    and per position bucket.

    Bucket k holds the targets at positions t (0-based, within the validation window, or within its document for
    packed documents: ``update``'s ``positions``; the target at t follows t + 1 tokens of context) with
    edges[k] <= t < edges[k + 1]; the last bucket is open-ended. The states are
    per-bucket sums reduced with ``dist_reduce_fx="sum"``, so under DDP ``compute`` returns the exact means over
    all ranks' tokens, however unevenly the ranks' batches are sized:
        loss = sum NLL / count (nats per token),  bpb = sum NLL / (ln 2 · bytes),  acc = correct / count,
    where bytes sums ``token_bytes[target]``, the bytes of text each target token stands for (None: one byte per
    token, the byte tokenizer's), so that bpb compares runs with different tokenizers; the byte-weighted mean of
    the buckets' bpb is the total bpb. ``update`` reads nothing on the host.
    """

    full_state_update = False

    def __init__(self, position_edges=DEFAULT_POSITION_EDGES, **kwargs):
        super().__init__(**kwargs)
        edges = check_position_edges(position_edges)
        self.register_buffer("edges", torch.tensor(edges[1:]), persistent=False)  # upper edges, for bucketize
        self.lower_edges = edges
        k = len(edges)
        self.add_state("nll_sum", torch.zeros(k, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("correct", torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("bytes", torch.zeros(k, dtype=torch.long), dist_reduce_fx="sum")
        self.token_bytes: torch.Tensor | None = None  # (V,) bytes per token id; None: one each
        self.add_state("last_position", torch.tensor(0), dist_reduce_fx="max")  # names the open-ended bucket

    def update(self, logits: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """logits (B, T, V), targets (B, T) with IGNORE_INDEX at unlabelled positions; ``positions`` (B, T) long:
        each target's position (None: its index t in the row)."""
        mask = targets != IGNORE_INDEX  # (B, T)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none")  # (B T,), 0 where unlabelled
        correct = (logits.argmax(dim=-1) == targets) & mask  # (B, T)
        if positions is None:
            positions = torch.arange(targets.shape[1], device=targets.device)  # (T,)
            self.last_position.clamp_(min=targets.shape[1] - 1)
        else:
            self.last_position.copy_(torch.maximum(self.last_position, positions.max().to(self.last_position)))
        bucket = torch.bucketize(positions, self.edges.to(targets.device), right=True)  # (T,) or (B, T)
        bucket = bucket.expand_as(targets).flatten()  # (B T,)
        self.nll_sum.index_add_(0, bucket, nll.double())
        self.count.index_add_(0, bucket, mask.flatten().long())
        if self.token_bytes is None:
            self.bytes.index_add_(0, bucket, mask.flatten().long())
        else:
            table = self.token_bytes.to(targets.device)
            size = table[targets.clamp(0, len(table) - 1)] * mask  # (B, T), 0 where unlabelled
            self.bytes.index_add_(0, bucket, size.flatten().long())
        self.correct.index_add_(0, bucket, correct.flatten().long())

    def compute(self) -> dict:
        """{"loss", "bpb", "acc", "bytes_per_token"} (0-dim tensors) over all tokens and ``"by_position"``: {"A_B":
        {"bpb", "acc", "tokens"}} for each bucket of positions A..B that holds labelled tokens (B: its upper edge - 1, or the
        last position seen if smaller)."""
        count = self.count.sum()
        if count == 0:
            raise ValueError("SummedNLL.compute: no labelled tokens were seen (empty validation set?)")
        loss = self.nll_sum.sum() / count
        end = int(self.last_position) + 1
        uppers = [min(edge, end) for edge in (*self.lower_edges[1:], end)]
        by_position = {
            f"{lo}_{hi - 1}": {"bpb": float(nll / max(int(b), 1) / LN2), "acc": float(c / n), "tokens": int(n)}
            for lo, hi, nll, n, c, b in zip(self.lower_edges, uppers, self.nll_sum, self.count, self.correct,
                                            self.bytes) if n > 0
        }
        n_bytes = self.bytes.sum().clamp(min=1)
        return {"loss": loss, "bpb": self.nll_sum.sum() / n_bytes / LN2, "acc": self.correct.sum().double() / count,
                "bytes_per_token": n_bytes.double() / count, "by_position": by_position}


def packed_forward(model: GPT, x: torch.Tensor, starts: torch.Tensor,
                   traced: bool = False) -> tuple[GPTOutput, torch.Tensor]:
    """The model on the rows of x (B, T) packed into one row of B·T tokens, cut into sequences at ``starts`` (B, T)
    bool, True at each document's first token, and at every row's first token whatever it holds (a row continues
    no other): ``model(x.reshape(1, B·T), cu_seqlens=...)``, so no document attends to another. The boundaries are
    read on the host once (:meth:`~vqattn.ops.varlen.Packing.from_starts`) and handed to the model as a Packing,
    which no layer reads again; for a ``traced`` (compiled) model, as :class:`~vqattn.ops.varlen.Segments`, tensors
    alone, so that the graph traces the packed call whole and does not recompile for new documents. Returns the
    output with its logits back in (B, T, V), and each token's position within its document, (B, T) long."""
    b, t = x.shape
    starts = starts.to(dtype=torch.bool).clone()
    starts[:, 0] = True
    packing = Packing.from_starts(starts.reshape(-1), x.device)
    out = model(x.reshape(1, b * t), cu_seqlens=packing.segments(model.block_lens()) if traced else packing)
    return out._replace(logits=out.logits.reshape(b, t, -1)), packing.positions(x.device).reshape(b, t)


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: (step + 1) / warmup during warmup, then cosine from 1 to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, min_lr_ratio: float,
                           total_steps: int | None = None, max_steps: int | None = None):
    """LambdaLR of :func:`warmup_cosine`, stepped every optimizer step; the cosine horizon is ``total_steps``, or
    the run's ``max_steps`` when that is None."""
    horizon = total_steps or max_steps
    if horizon is None or horizon <= 0:
        raise ValueError("the cosine schedule needs trainer.max_steps > 0 or optim.total_steps")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        warmup_cosine, warmup_steps=warmup_steps, total_steps=horizon, min_lr_ratio=min_lr_ratio))


@dataclass
class OptimConfig:
    """The ``optim`` keys a command line sets: AdamW's lr, weight_decay and betas, and the schedule: linear warmup
    over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps`` (the cosine horizon;
    None = trainer.max_steps; fix it to stop early and resume on the same schedule). conf/optimizer and
    conf/scheduler read them; :meth:`optimizer` and :meth:`scheduler` are the same partials, for Python.

    ``muon_lr``, ``muon_momentum`` and ``muon_weight_decay`` are read by ``optimizer=muon`` alone (:class:`MuonAdamW`):
    Muon's rule for the blocks' weight matrices, whose lr the same schedule scales; the other parameters keep
    AdamW's lr, weight_decay and betas. Their defaults are Keller Jordan's Muon of the modded-nanogpt speedrun (lr
    0.02, Nesterov momentum 0.95, no weight decay)."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    total_steps: int | None = None
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0

    def __post_init__(self):
        self.betas = tuple(self.betas)  # a list when it comes from a config
        rules = {  # key: (test, what is allowed)
            "lr": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, ">= 0"),
            "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
            "warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an int >= 0"),
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "total_steps": (lambda v: v is None or isinstance(v, int) and v > 0, "a positive int or None"),
            "muon_lr": (lambda v: v > 0, "> 0"),
            "muon_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "muon_weight_decay": (lambda v: v >= 0, ">= 0"),
        }
        for key, (test, allowed) in rules.items():
            value = getattr(self, key)
            try:
                ok = not isinstance(value, (bool, str)) and test(value)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"optim.{key} must be {allowed}, got {value!r}")

    def optimizer(self, name: str = "adamw") -> Callable:
        """The optimizer of conf/optimizer/NAME.yaml with these values, waiting for its parameter groups:
        torch.optim.AdamW ("adamw") or :class:`MuonAdamW` ("muon")."""
        adamw = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": self.betas}
        if name == "adamw":
            return functools.partial(torch.optim.AdamW, **adamw)
        if name == "muon":
            return functools.partial(MuonAdamW, **adamw, muon_lr=self.muon_lr, muon_momentum=self.muon_momentum,
                                     muon_weight_decay=self.muon_weight_decay)
        raise ValueError(f"optimizer must be adamw or muon, got {name!r}")

    def scheduler(self, max_steps: int | None = None) -> Callable:
        """:func:`warmup_cosine_schedule` with these values and the run's ``max_steps``, waiting for the optimizer."""
        return functools.partial(warmup_cosine_schedule, warmup_steps=self.warmup_steps,
                                 min_lr_ratio=self.min_lr_ratio, total_steps=self.total_steps, max_steps=max_steps)


def parameter_groups(model: torch.nn.Module, muon: bool = False) -> list[dict]:
    """The optimizer's parameter groups of ``model``, each parameter in exactly one (a tied head is the embedding's
    parameter, once): its matrices (embeddings, the head, the linear layers' weights, the short convolution's
    kernel), which decay, then its norms, biases, scalars (e.g. learned temperatures) and codebooks, with
    weight_decay 0 (a codebook's codes are centroids to fit, not weights to shrink).

    With ``muon`` (:class:`MuonAdamW`), the weights of the linear layers inside ``model.blocks`` (attention q/k/v
    and output projections, the MLP's two) leave the first group for a third, marked ``"muon": True``: the hidden
    matrices, to which modded-nanogpt gives Muon. The embeddings and the head stay with AdamW (their rows are
    per-token vectors, not a map between hidden spaces), and so does everything that is not a linear layer's 2-D
    weight (codebooks, the convolution's (C, 1, K) kernel, norms, biases). The groups are then named for the
    learning-rate monitor: adamw, adamw_no_decay and muon."""
    blocks = getattr(model, "blocks", None)
    hidden = ({id(m.weight) for m in blocks.modules() if isinstance(m, torch.nn.Linear)}
              if muon and blocks is not None else set())
    decay, no_decay, matrices = [], [], []
    for name, p in model.named_parameters():
        if id(p) in hidden:
            matrices.append(p)
        else:
            (decay if p.ndim >= 2 and "codebook" not in name else no_decay).append(p)
    if not muon:
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [{"params": decay, "name": "adamw"}, {"params": no_decay, "weight_decay": 0.0, "name": "adamw_no_decay"},
            {"params": matrices, "muon": True, "name": "muon"}]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer of two update rules: torch.optim.Muon on the parameter groups marked ``"muon": True`` (the
    blocks' weight matrices: :func:`parameter_groups`), torch.optim.AdamW on the others.

    One object, so that what takes the run's single optimizer works unchanged: Lightning's automatic optimization
    and gradient clipping, the learning-rate schedule (which scales every group's lr, Muon's and AdamW's, by the
    same factor), the learning-rate monitor, and the checkpoint's optimizer state. Its ``param_groups`` are the two
    inner optimizers' groups themselves (AdamW's first, then Muon's) and its ``state`` is theirs, so ``state_dict``
    and ``load_state_dict`` are torch's own over every group in order, and a resumed run continues both rules'
    moments.

    Args:
        params: parameter groups (dicts), at least one marked ``"muon": True``; a group's own lr or weight_decay
            overrides the rule's.
        lr, weight_decay, betas: AdamW's.
        muon_lr, muon_momentum, muon_weight_decay: Muon's, with torch.optim.Muon's other defaults (Nesterov momentum,
            5 Newton-Schulz steps, Keller Jordan's update scale sqrt(max(1, rows / cols))). Muon's weight decay is
            decoupled: each step multiplies a matrix by 1 - lr * weight_decay.
    """

    muon_groups = True  # LitLM.configure_optimizers hands it parameter_groups(model, muon=True)

    def __init__(self, params, lr: float = 2e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 muon_lr: float = 0.02, muon_momentum: float = 0.95, muon_weight_decay: float = 0.0):
        groups = list(params)
        if not all(isinstance(g, dict) for g in groups) or not any(g.get("muon") for g in groups):
            raise ValueError('MuonAdamW takes parameter groups (dicts), at least one marked "muon": True, e.g. '
                             "parameter_groups(model, muon=True)")
        adamw = [{**g, "muon": False} for g in groups if not g.get("muon")]
        muon = [g for g in groups if g.get("muon")]
        self._inner = [torch.optim.Muon(muon, lr=muon_lr, momentum=muon_momentum, weight_decay=muon_weight_decay)]
        if adamw:
            self._inner.insert(0, torch.optim.AdamW(adamw, lr=lr, weight_decay=weight_decay, betas=tuple(betas)))
        self._sizes = [len(opt.param_groups) for opt in self._inner]
        # No defaults of its own: each group holds its rule's values already (an outer default would be copied
        # into every group). The same group dicts: the schedule's lr changes reach the inner optimizers.
        super().__init__([g for opt in self._inner for g in opt.param_groups], {})
        self.defaults = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "muon_lr": muon_lr,
                         "muon_momentum": muon_momentum, "muon_weight_decay": muon_weight_decay}
        self._link()

    def _link(self) -> None:
        """The inner optimizers read this one's groups and state (``load_state_dict`` replaces both)."""
        start = 0
        for opt, size in zip(self._inner, self._sizes):
            opt.param_groups, opt.state = self.param_groups[start:start + size], self.state
            start += size

    @torch.no_grad()
    def step(self, closure=None):
        """One step of each rule; ``closure`` (Lightning's forward and backward) runs once, first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load over every group, with a one-line error for the state of another optimizer (or another
        model): its groups must be this one's, Muon's where this one has Muon's."""
        saved = [bool(g.get("muon")) for g in state_dict["param_groups"]]
        own = [bool(g.get("muon")) for g in self.param_groups]
        if saved != own:
            raise ValueError(f"the optimizer state to load is not optimizer=muon's ({len(saved)} parameter groups, "
                             f"{sum(saved)} of them Muon's; this one has {len(own)}, {sum(own)} of them Muon's): "
                             "resume with the optimizer it was trained with")
        super().load_state_dict(state_dict)
        self._link()


class LitLM(L.LightningModule):
    """Args:
        model: GPTConfig keyword arguments (a plain dict, so it is saved in the checkpoint's hyperparameters).
        optimizer: ``params -> Optimizer`` (a partial, e.g. of torch.optim.AdamW), given :func:`parameter_groups`:
            matrices, then norms, biases, scalars and codebooks with weight_decay 0, and for :class:`MuonAdamW`
            (optimizer=muon) the blocks' weight matrices as a third group; None: ``OptimConfig().optimizer()``.
        scheduler: ``optimizer -> LRScheduler`` (a partial), stepped every optimizer step; None:
            ``OptimConfig().scheduler(trainer.max_steps)``, warmup then cosine decay over the run.
        aux_weight: weight of the auxiliary (commitment) loss.
        compile: ``torch.compile`` the model (in place: checkpoints keep the eager parameter names).
        carry_state: train on consecutive segments, each step starting from the previous step's detached state.
        carry_segments: with ``carry_state``, the carried state starts afresh every ``carry_segments`` optimizer
            steps (None: never), so a training sequence is carry_segments × seq_len tokens (Transformer-VQ's
            sequence length, made of update-length segments); with G ``data.stream_groups``, every
            carry_segments × G steps, in which each group's streams advance carry_segments segments. Without a
            reset the vq caches' counts grow over the whole run (millions of keys per code) and the model learns
            cache biases that no evaluation context has.
        position_edges: lower edges of the position buckets of the validation metrics (val_bpb_pos_A_B,
            val_acc_pos_A_B for positions A..B of the window); None: DEFAULT_POSITION_EDGES (0, 64, 256, 1024,
            then doubling), the buckets the windows reach.
    """

    def __init__(self, model: dict, optimizer: Callable | None = None, scheduler: Callable | None = None,
                 aux_weight: float = 1.0, compile: bool = False, carry_state: bool = False,
                 carry_segments: int | None = 16, position_edges: list[int] | None = None):
        super().__init__()
        if carry_segments is not None and (isinstance(carry_segments, bool) or not isinstance(carry_segments, int)
                                           or carry_segments < 1):
            raise ValueError(f"carry_segments must be a positive int or None (never reset), got {carry_segments!r}")
        if carry_state and model.get("pos_emb", GPTConfig.pos_emb) == "learned":
            raise ValueError("carry_state=true needs model.pos_emb=rope or none: carried positions grow past "
                             "model.seq_len, which learned absolute positions cannot encode")
        # The partials are not plain values: a checkpoint (loaded with weights_only) cannot hold them.
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.model = GPT(model_config(model))
        if compile:
            self.model.compile()
        self.optimizer = optimizer or OptimConfig().optimizer()
        self.scheduler = scheduler
        self._configured_lrs: list[float] | None = None  # set by configure_optimizers
        self.aux_weight = aux_weight
        self.val_nll = SummedNLL(DEFAULT_POSITION_EDGES if position_edges is None else position_edges)
        self.val_nll_carried = SummedNLL()
        self.carry = CarriedState() if carry_state else None  # the training rows' state
        self.carry_segments = carry_segments
        self._carry_step, self._carry_micro = -1, 0  # the optimizer step of the last carried batch, its micro-batch
        self._stream_groups = 1  # the datamodule's stream_groups, read in setup
        self.val_carry = CarriedState()  # the carried validation pass's state
        self.last_validation: dict | None = None  # {"step", "val_loss", "val_bpb", "val_acc", "codebook_..."}
        self.buffer_divergence = 0.0  # set by on_train_end, see rank_divergence
        self.tokenizer = None  # the data's (vqattn.tokenizer), kept in checkpoints; None: bytes

    def forward(self, idx: torch.Tensor):
        return self.model(idx)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.carry is not None and not getattr(self.trainer.datamodule, "stream", False):
            raise ValueError("carry_state=true trains on consecutive segments: it needs a datamodule with stream=True "
                             "(data.stream=true, a byte corpus), whose row r of batch i + 1 continues row r of batch i")
        if stage == "fit":
            self._stream_groups = getattr(self.trainer.datamodule, "stream_groups", 1)
        token_bytes = getattr(self.trainer.datamodule, "token_bytes", None)  # bits per byte of text, any tokenizer
        self.val_nll.token_bytes = self.val_nll_carried.token_bytes = token_bytes

    def training_step(self, batch, batch_idx):
        x, y, *packed = batch  # (B, T) each; packed documents add their starts (B, T) bool
        if packed and self.carry is not None:
            raise ValueError("carry_state=true continues each row from the last step's state: it cannot train on "
                             "packed documents (data.pack_documents=true)")
        if packed:
            out, _ = packed_forward(self.model, x, packed[0], traced=self.hparams.get("compile", False))
        else:
            out = self.model(x) if self.carry is None else self._carried_forward(x)
        nll = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
        loss = nll + self.aux_weight * out.aux_loss
        self.log_dict({"train_loss": loss, "train_nll": nll, "train_aux": out.aux_loss})
        self.log("train_bpb", nll / LN2, prog_bar=True)
        return loss

    def _carried_forward(self, x: torch.Tensor):
        """The model on training batch x continuing its stream group's carried state. The batch's index (hence its
        group, index mod G) and the resets are functions of the global step and the micro-batch within it, so a
        resumed run (which starts at a step's first micro-batch) carries and resets alike."""
        step, groups = self.trainer.global_step, self._stream_groups
        if step != self._carry_step:  # the first micro-batch of an optimizer step
            self._carry_step, self._carry_micro = step, 0
            if self.carry_segments and step % (self.carry_segments * groups) == 0:
                self.carry.reset()
        else:
            self._carry_micro += 1
        batch = step * self.trainer.accumulate_grad_batches + self._carry_micro
        return self.carry.forward(self.model, x, group=batch % groups)

    def on_train_batch_start(self, batch, batch_idx):
        set_feature_step(self.model, self.trainer.global_step)  # Performer redraws follow the global step

    def on_train_start(self):
        """A resumed run trains at the configured learning rates (``optim.lr``, and ``optim.muon_lr`` for
        optimizer=muon), not at those its checkpoint's optimizer and schedule saved: each parameter group's schedule
        is scaled by configured / saved lr (nothing changes when they agree), so that a run resumed from its last
        finite checkpoint with a lower lr, as a divergence advises, takes it."""
        configured = self._configured_lrs
        for config in self.trainer.lr_scheduler_configs:
            scheduler, optimizer = config.scheduler, config.scheduler.optimizer
            saved = list(getattr(scheduler, "base_lrs", []))
            if configured is None or not len(saved) == len(configured) == len(optimizer.param_groups):
                continue
            for i, (group, lr, was) in enumerate(zip(optimizer.param_groups, configured, saved)):
                if not was or lr == was:
                    continue
                ratio = lr / was
                scheduler.base_lrs[i] = was * ratio
                group["lr"] *= ratio
                group["initial_lr"] = group.get("initial_lr", was) * ratio
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

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
        """Loader 0: independent windows (packed documents: cut at their starts, positions counted in each document).
        Loader 1 (data.val_carried): consecutive segments, state carried."""
        x, y, *packed = batch
        if dataloader_idx == 0:
            if packed:
                out, pos = packed_forward(self.model, x, packed[0], traced=self.hparams.get("compile", False))
                self.val_nll.update(out.logits, y, pos)
            else:
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
            if not suffix:  # positions of the independent windows (a carried segment continues earlier ones)
                by_position, bytes_per_token = vals["by_position"], float(vals["bytes_per_token"])
            metrics.update({f"val_{k}{suffix}": float(v) for k, v in vals.items()
                            if k not in ("by_position", "bytes_per_token")})
        self.val_carry.reset()
        metrics.update({f"codebook_{k}": float(v) for k, v in self.model.codebook_stats().items()})
        metrics.update({f"val_{k}_pos_{name}": bucket[k] for name, bucket in by_position.items() for k in ("bpb", "acc")})
        for key, value in metrics.items():  # identical on every rank already: sync_dist only keeps Lightning quiet
            self.log(key, value, prog_bar=key.startswith("val_") and "_carried" not in key and "_pos_" not in key,
                     sync_dist=True)
        # The row's step is global_step, the number of optimizer steps done (Lightning's own step for epoch-end
        # logging is the last batch index, 199 for the validation after 200 steps); a logged "step" sets it.
        self.log("step", float(self.global_step), sync_dist=True)
        self.last_validation = {"step": self.global_step, **metrics, "by_position": by_position,
                                "bytes_per_token": bytes_per_token}  # of the validation windows: not a curve to log

    def configure_optimizers(self):
        # Matrices decay; norms, biases, scalars (e.g. learned temperatures) and codebooks do not. An optimizer
        # that says so (MuonAdamW) gets the blocks' weight matrices as a group of their own.
        muon = getattr(getattr(self.optimizer, "func", self.optimizer), "muon_groups", False)
        optimizer = self.optimizer(parameter_groups(self.model, muon=muon))
        # each group's configured lr, before the schedule scales it: a resumed run trains at these (on_train_start)
        self._configured_lrs = [group["lr"] for group in optimizer.param_groups]
        scheduler = (self.scheduler or OptimConfig().scheduler(self.trainer.max_steps))(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # The carried state travels with the checkpoint, every rank's (saving is a collective under DDP: see
    # vqattn.train.carry), so that a resumed run continues its rows from the state it stopped with.
    def on_save_checkpoint(self, checkpoint):
        if self.tokenizer is not None:  # the checkpoint decodes its own samples (read_tokenizer)
            checkpoint["tokenizer"] = {"spec": self.tokenizer.spec, "json": self.tokenizer.to_json()}
        if self.carry is not None:
            checkpoint["carry_state"] = self.carry.gathered(self.trainer.world_size)

    def on_load_checkpoint(self, checkpoint):
        if self.carry is not None and "carry_state" in checkpoint and self._trainer is not None:  # resuming a fit
            self.carry.load(checkpoint["carry_state"], self.trainer.global_rank, self.trainer.world_size)
