"""Per-head codebooks for :func:`vqattn.functional.vq_attention`.

Hard mode (Transformer-VQ) quantises keys to their nearest code and learns the codes either by

* ``learning="ema"``: exponential-moving-average k-means. With the batch counts n_s = Σ_j 1[z_j = s] and sums
  m_s = Σ_j 1[z_j = s] k_j (all-reduced across ``torch.distributed`` ranks, so every replica holds the same
  codebook), N_s ← γ N_s + (1 − γ) n_s, M_s ← γ M_s + (1 − γ) m_s and c_s = M_s / Ñ_s with the Laplace-smoothed
  counts Ñ_s = (N_s + ε) / (Σ N + S ε) · Σ N; or
* ``learning="grad"``: the VQ-VAE codebook loss ‖sg(k) − c_z‖².

Both add the commitment loss β ‖k − sg(c_z)‖² (mean over elements), β = 1e-4 by default as in Transformer-VQ: with
the exact window the raw keys also score the window, and the VQ-VAE value 0.25 pulled them onto the codes at the
window's expense (docs/vq_ablations.md). Every training step keeps S random keys per
head (rank 0's, on every rank) as restart candidates; at the start of the next training step the codes are
initialised from them (once, with ``data_init``), and codes whose EMA usage fell below ``dead_code_threshold``
keys per step are restarted on them. (Applied at the start of a step, not the end, because the step's autograd
graph still holds the codes.)

Soft mode (GMM) learns the codes, and optionally a per-head temperature, by gradient through the attention.

The assignment is computed once per step, here, and handed to ``vq_attention`` (``assignment=``). A training step
never reads a tensor on the host (no ``.item()``, ``bool(tensor)``): initialisation and restarts are masked
``torch.where`` updates. Under DDP the statistics and the restart candidates travel in one all-reduce per step.
Assignments and statistics are computed in float32 (autocast is disabled inside), and the statistics buffers stay
float32 when the module is cast to a half-precision dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .ops.common.statistics import code_slots
from .ops.triton.nearest import code_residuals
from .ops.triton.soft import soft_statistics
from .ops.triton.utils import runs_kernels
from .ops.utils import autocast_off, check_4d, check_choice, check_positive_int, empty_like_order, memory_order
from .ops.vq import Assignment, vq_assign
from .ops.vq.assign import row_tiles, temperature_tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)


class _QuantisationLoss(torch.autograd.Function):
    """The quantisation error E = mean over (B, H, T, D) of (k − c_z)², keys k (B, H, T, D), codes c (H, S, D), index
    z (B, H, T), as the loss w_k·E(k, sg c) + w_c·E(sg k, c) (a commitment loss and a codebook loss in one pass),
    through the per-code counts n_s and key sums m_s = Σ_{z_j = s} k_j (H, S) and (H, S, D), also returned:

        n·E = Σ_j ‖k_j‖² − 2 Σ_s c_s·m_s + Σ_s n_s ‖c_s‖²,   dE/dk_j = 2 (k_j − c_{z_j}) / n,   dE/dc_s = 2 (n_s c_s − m_s) / n

    (n = B·H·T·D). One scatter-add pass over the keys and no (B, H, T, D) temporary in the forward pass (a gather of the
    codes, its difference and square, as ``F.mse_loss`` has, cost 96 MB of fresh memory per step at T = 32768); the
    backward pass gathers the codes once, into the keys' gradient itself. Half-precision keys stay so: the sums and
    the error accumulate in the codes' dtype (float32 or float64), and the keys' gradient, formed in it, is written
    in theirs and in their memory order (no float32 copy of the keys kept for the backward pass, nor a float32
    gradient cast afterwards; :mod:`~vqattn.ops.utils`). float32 keys take it in place, in the gathered
    codes' memory. On a GPU the keys' gradient is one kernel's pass (:func:`~vqattn.ops.triton.nearest.code_residuals`)
    instead of the gather, the subtraction and the scaling."""

    @staticmethod
    def forward(ctx, keys, codes, index, key_weight: float, code_weight: float):
        B, H, T, D = keys.shape
        S = codes.shape[1]
        slots = code_slots(index, S, 1)  # (B, H, T) rows of the flat (H·S) statistics
        counts = codes.new_zeros(H * S).index_add_(0, slots.flatten(), codes.new_ones(()).expand(slots.numel()))
        # In tiles of keys, as the assignment's scores: k is often a strided view (of a layer's projections) that one
        # flattening would copy whole. A half tile converts to the codes' dtype in one copy, dense in the keys' memory
        # order, and is flattened in that order (the slots with it): no second copy.
        sums = codes.new_zeros(H * S, D)
        for rows in row_tiles(T, B * H * D * codes.element_size(), keys.device):
            tile = keys[:, :, rows].to(codes.dtype)
            lead = [d for d in memory_order(tile) if d != 3]
            sums.index_add_(0, slots[:, :, rows].permute(lead).flatten(), tile.permute(*lead, 3).reshape(-1, D))
        counts, sums = counts.view(H, S), sums.view(H, S, D)
        total = (torch.linalg.vector_norm(keys, dtype=codes.dtype).square() - 2 * (codes * sums).sum()
                 + (counts * codes.square().sum(-1)).sum())
        error = total.clamp_min(0) / keys.numel()  # ≥ 0 also where rounding cancels to below
        ctx.save_for_backward(keys, codes, index, counts, sums)
        ctx.weights = key_weight, code_weight
        ctx.mark_non_differentiable(error, counts, sums)
        return error * (key_weight + code_weight), error, counts, sums

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_error, grad_counts, grad_sums):
        keys, codes, index, counts, sums = ctx.saved_tensors
        need_keys, need_codes = ctx.needs_input_grad[:2]
        B, H, T, D = keys.shape
        scale = grad * (2 / keys.numel())
        grad_keys = grad_codes = None
        if need_keys and runs_kernels(keys):  # a GPU: one pass (the tensor scale read in the kernel)
            grad_keys = code_residuals(keys, codes, index, scale * ctx.weights[0])
        elif need_keys:
            nearest = codes.unsqueeze(0).expand(B, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(B, H, T, D))
            nearest.sub_(keys)
            if nearest.dtype == keys.dtype:  # in place: no fresh memory
                grad_keys = nearest.mul_(-scale * ctx.weights[0])
            else:  # half keys: formed in float32, written once in their dtype and memory order
                grad_keys = torch.mul(nearest, -scale * ctx.weights[0], out=empty_like_order(keys))
        if need_codes:
            grad_codes = (counts.unsqueeze(-1) * codes - sums).mul_(scale * ctx.weights[1])
        return grad_keys, grad_codes, None, None, None


def quantisation_loss(keys: torch.Tensor, codes: torch.Tensor, index: torch.Tensor, *, key_weight: float = 1.0,
                      code_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For keys (B, H, T, D), their codes' index z (B, H, T) into codes (H, S, D) and the quantisation error
    E = mean (k − c_z)² over keys and dims: (the loss key_weight·E(k, sg c) + code_weight·E(sg k, c), whose
    gradient reaches the keys times key_weight and the codes times code_weight; E itself; the counts n_s (H, S);
    the key sums Σ_{z_j = s} k_j (H, S, D)). One pass for both terms: :class:`_QuantisationLoss`."""
    return _QuantisationLoss.apply(keys, codes, index, key_weight, code_weight)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _all_reduce_sum(flat: torch.Tensor) -> None:
    """Sum a flat tensor over all ranks, in place (a no-op without DDP): the codebook's one collective per step."""
    if _distributed():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)


class CodebookOutput(NamedTuple):
    codes: torch.Tensor  # (H, S, D), in the keys' dtype; pass to vq_attention
    assignment: Assignment  # of the keys to the codes; pass to vq_attention(assignment=...)
    aux_loss: torch.Tensor  # scalar: commitment (+ codebook) loss for hard, 0 for soft


class Codebook(nn.Module):
    """Per-head codebooks (H, S, D) with EMA k-means or gradient learning.

    ``forward(k)`` with keys (B, H, T, D) returns ``CodebookOutput(codes, assignment, aux_loss)``; in training mode
    it also updates the EMA statistics, initialises codes and restarts dead ones.
    """

    def __init__(
        self,
        num_heads: int,
        num_codes: int,
        dim: int,
        *,
        assign: str = "hard",
        learning: str = "ema",
        decay: float = 0.99,
        commitment: float = 1e-4,
        eps: float = 1e-5,
        temperature: float = 1.0,
        learn_temperature: bool = False,
        data_init: bool = True,
        dead_code_threshold: float = 1.0,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_codes", num_codes), ("dim", dim)):
            check_positive_int(name, value)
        check_choice("assign", assign, ("hard", "soft"))
        check_choice("learning", learning, ("ema", "grad"))
        if assign == "soft" and learning == "ema":
            learning = "grad"  # a soft codebook is learned through the attention itself
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if commitment < 0:
            raise ValueError(f"commitment must be >= 0, got {commitment}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if dead_code_threshold < 0:
            raise ValueError(f"dead_code_threshold must be >= 0, got {dead_code_threshold}")
        self.num_heads, self.num_codes, self.dim = num_heads, num_codes, dim
        self.assign, self.learning = assign, learning
        self.decay, self.commitment, self.eps = decay, commitment, eps
        self.dead_code_threshold = dead_code_threshold if assign == "hard" else 0.0

        init = torch.randn(num_heads, num_codes, dim) * dim**-0.5
        if learning == "ema":
            self.register_buffer("codes", init)
            self.register_buffer("ema_sums", init.clone())
        else:
            self.codes = nn.Parameter(init)
        # EMA of per-code usage (keys per step): the EMA counts in ema mode, dead-code detection in both.
        self.register_buffer("ema_counts", torch.ones(num_heads, num_codes))
        self.register_buffer("initialized", torch.tensor(not data_init))
        self.register_buffer("candidates", torch.zeros(num_heads, num_codes, dim))  # restart candidates, see above
        self.register_buffer("candidates_ready", torch.tensor(False))
        # perplexity, dead codes, quantisation error of the last forward; a buffer updated in place, not a Python
        # attribute, so that forward has no side effects torch.compile must trace.
        self.register_buffer("last_stats", torch.zeros(3), persistent=False)
        log_t = torch.full((num_heads,), math.log(temperature))
        self.log_temperature = nn.Parameter(log_t) if learn_temperature else None
        self.fixed_temperature = temperature

    def _apply(self, fn, recurse=True):
        # model.half() / .bfloat16() must not round the EMA statistics: keep every float buffer at least float32.
        super()._apply(fn, recurse)
        for name, buf in self._buffers.items():
            if buf is not None and buf.dtype in HALF_DTYPES:
                self._buffers[name] = buf.float()
        return self

    @property
    def temperature(self) -> float | torch.Tensor:
        """τ of the soft assignment: a float, or a learnable (H,) tensor."""
        return self.fixed_temperature if self.log_temperature is None else self.log_temperature.exp()

    @autocast_off
    def forward(self, k: torch.Tensor, record: bool = True) -> CodebookOutput:
        """k: (B, H, T, D) -> CodebookOutput(codes (H, S, D), assignment of k, aux_loss scalar).

        ``record=False`` skips the commitment loss (aux_loss is then 0) and the usage statistics outside training:
        a decoding step needs only the codes and the assignment, and a token's worth of statistics is noise. In
        training mode the loss and the statistics are always computed."""
        check_4d("k", k)
        if k.shape[1] != self.num_heads or k.shape[3] != self.dim:
            raise ValueError(f"k must have H={self.num_heads} and D={self.dim}, got shape {tuple(k.shape)}")
        acc = torch.promote_types(k.dtype, torch.float32)  # the codes', statistics' and loss's dtype
        if self.training:
            self._restart()
        # EMA codes are updated in place at the end of the step, so attention gets a copy autograd may keep.
        codes = (self.codes.clone() if self.learning == "ema" else self.codes).to(acc)
        temperature = self.temperature if self.assign == "soft" else 1.0
        # The keys in their own dtype: vq_assign scores in float32 either way, and half keys take the GPU kernels'
        # tensor-core products (float32 keys take IEEE ones, about four times slower). Soft keys on a GPU stay
        # unformed (a SoftMixture): the fused op recomputes their weights, and no (T, S) tensor reaches memory.
        formed = self.assign != "soft" or not runs_kernels(k)
        assignment = vq_assign(k if self.assign == "soft" else k.detach(), codes, assign=self.assign,
                               temperature=temperature, formed=formed)
        if not (record or self.training):
            return CodebookOutput(codes.to(k.dtype), assignment, codes.new_zeros(()))
        soft_counts = None
        if not formed:  # the statistics by a kernel that forms no (T, S) tensor either
            tau = temperature_tensor(temperature, self.num_heads, codes)
            soft_counts, index = soft_statistics(k.detach(), codes.detach(), tau)
        elif assignment.index is not None:
            index = assignment.index
        else:
            index = assignment.weights.detach().max(-1).indices
        # mean (k − c_z)² over keys and dims: the commitment loss (hard), and, times D, the quantisation error
        # recorded; with the hard assignment's counts and key sums, which the statistics reuse.
        aux = codes.new_zeros(())
        if self.assign == "hard":  # the commitment loss β·E(k, sg c), plus E(sg k, c) when the codes learn by gradient
            learned = self.learning == "grad"
            aux, error, counts, sums = quantisation_loss(k, codes if learned else codes.detach(), index,
                                                         key_weight=self.commitment, code_weight=float(learned))
        else:
            error, sums = quantisation_loss(k.detach(), codes.detach(), index)[1], None
            # the soft counts Σ_j p(s | k_j)
            counts = soft_counts if soft_counts is not None else assignment.weights.detach().sum((0, 2))
        counts = counts.to(self.ema_counts.dtype)  # (H, S)
        if self.training:
            self._training_update(counts, sums, k.detach())
        self._record_stats(counts, error.detach() * self.dim)
        return CodebookOutput(codes.to(k.dtype), assignment, aux)  # aux stays float32 (a loss term)

    @torch.no_grad()
    def _training_update(self, counts: torch.Tensor, sums: torch.Tensor | None, keys: torch.Tensor) -> None:
        """EMA update with the all-reduced batch statistics (counts (H, S); the key sums (H, S, D) of EMA learning),
        then initialisation / restart of codes."""
        H, S, D = self.num_heads, self.num_codes, self.dim
        B, _, T, _ = keys.shape
        dtype = self.ema_counts.dtype
        parts = [counts]
        if self.learning == "ema":
            parts.append(sums.to(dtype))
        # Restart candidates: S random keys per head; rank 0's reach every rank through the same all-reduce.
        batch, pos = (torch.randint(n, (H, S), device=keys.device) for n in (B, T))
        candidates = keys[batch, torch.arange(H, device=keys.device)[:, None], pos].to(dtype)  # (H, S, D)
        parts.append(candidates * (_rank() == 0))
        flat = torch.cat([p.flatten() for p in parts])
        _all_reduce_sum(flat)
        counts, rest = flat[: H * S].view(H, S), flat[H * S :]
        self.ema_counts.lerp_(counts, 1 - self.decay)
        if self.learning == "ema":
            self.ema_sums.lerp_(rest[: H * S * D].view(H, S, D), 1 - self.decay)
            total = self.ema_counts.sum(-1, keepdim=True)
            smoothed = (self.ema_counts + self.eps) / (total + S * self.eps) * total
            self.codes.copy_(self.ema_sums / smoothed.unsqueeze(-1))
        self.candidates.copy_(rest[-H * S * D :].view(H, S, D))
        self.candidates_ready.fill_(True)

    @torch.no_grad()
    def _restart(self) -> None:
        """Initialise or restart codes from the previous step's candidates, as masked updates (no host read)."""
        # (H, S), identical on every rank: the EMA counts and candidates come from the all-reduced statistics.
        dead = self.candidates_ready & (~self.initialized | (self.ema_counts < self.dead_code_threshold))
        self.codes.copy_(torch.where(dead.unsqueeze(-1), self.candidates.to(self.codes.dtype), self.codes))
        # A restarted code starts with the usage of a just-alive code, so it is not restarted again at once.
        restart_count = max(self.dead_code_threshold, 1.0)
        self.ema_counts.masked_fill_(dead, restart_count)
        if self.learning == "ema":
            self.ema_sums.copy_(torch.where(dead.unsqueeze(-1), self.codes * restart_count, self.ema_sums))
        self.initialized.logical_or_(self.candidates_ready)

    @torch.no_grad()
    def _record_stats(self, counts: torch.Tensor, quant_error: torch.Tensor) -> None:
        probs = counts / counts.sum(-1, keepdim=True).clamp_min(1e-12)  # (H, S)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)  # (H,)
        usage = self.ema_counts if self.assign == "hard" else counts
        dead = (usage < max(self.dead_code_threshold, 1e-12)).sum(-1).to(probs.dtype).mean()
        self.last_stats.copy_(torch.stack([entropy.exp().mean(), dead, quant_error.to(probs.dtype)]))

    def usage_stats(self) -> dict[str, float]:
        """Of the last forward: code-usage perplexity (mean over heads; S means uniform use), dead codes per head,
        mean squared quantisation error ‖k − c_z‖². Reads the device (call it outside the training step)."""
        return dict(zip(("perplexity", "dead_codes", "quant_error"), self.last_stats.tolist()))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, codes={self.num_codes}, dim={self.dim}, assign={self.assign}, "
                f"learning={self.learning}, decay={self.decay}, commitment={self.commitment}")
