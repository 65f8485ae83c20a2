"""Per-head codebooks for :func:`vqattn.functional.vq_attention`.

Hard mode (Transformer-VQ) quantises keys to their nearest code and learns the codes either by

* ``learning="ema"``: exponential-moving-average k-means. With the batch counts n_s = Σ_j 1[z_j = s] and sums
  m_s = Σ_j 1[z_j = s] k_j (all-reduced across ``torch.distributed`` ranks, so every replica holds the same
  codebook), N_s ← γ N_s + (1 − γ) n_s, M_s ← γ M_s + (1 − γ) m_s and c_s = M_s / Ñ_s with the Laplace-smoothed
  counts Ñ_s = (N_s + ε) / (Σ N + S ε) · Σ N; or
* ``learning="grad"``: the VQ-VAE codebook loss ‖sg(k) − c_z‖².

Both add the commitment loss β ‖k − sg(c_z)‖² (mean over elements), initialise the codes from the first
training batch's keys and restart dead codes (EMA usage below ``dead_code_threshold`` keys per step, summed over ranks) from the
current batch's keys, broadcast from rank 0.

Soft mode (GMM) learns the codes, and optionally a per-head temperature, by gradient through the attention.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .ops._checks import check_4d, check_choice, check_positive_int
from .ops.vq import vq_assign


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(*tensors: torch.Tensor) -> None:
    if _distributed():
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    if _distributed():
        dist.broadcast(t, src=0)
    return t


class Codebook(nn.Module):
    """Per-head codebooks (H, S, D) with EMA k-means or gradient learning.

    ``forward(k)`` with keys (B, H, T, D) returns ``(codebook (H, S, D), aux_loss)``; in training mode it first
    initialises / restarts codes, and after assigning updates the EMA statistics. Pass ``self.assign`` and
    ``self.temperature`` on to ``vq_attention``.
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
        commitment: float = 0.25,
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
        log_t = torch.full((num_heads,), math.log(temperature))
        self.log_temperature = nn.Parameter(log_t) if learn_temperature else None
        self.fixed_temperature = temperature
        self.last_stats: dict[str, torch.Tensor] = {}

    @property
    def temperature(self) -> float | torch.Tensor:
        """τ of the soft assignment: a float, or a learnable (H,) tensor."""
        return self.fixed_temperature if self.log_temperature is None else self.log_temperature.exp()

    def forward(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k: (B, H, T, D) -> (codebook (H, S, D), aux_loss scalar)."""
        check_4d("k", k)
        if k.shape[1] != self.num_heads or k.shape[3] != self.dim:
            raise ValueError(f"k must have H={self.num_heads} and D={self.dim}, got shape {tuple(k.shape)}")
        keys = k.detach().to(self.codes.dtype).transpose(0, 1).reshape(self.num_heads, -1, self.dim)  # (H, B·T, D)
        if self.training:
            if not bool(self.initialized):
                self._replace_codes(torch.ones_like(self.ema_counts, dtype=torch.bool), keys)
                self.initialized.fill_(True)
            elif self.dead_code_threshold > 0:
                self._replace_codes(self.ema_counts < self.dead_code_threshold, keys)

        # EMA codes are updated in place below, so attention gets a copy that autograd may keep.
        codes = self.codes.clone() if self.learning == "ema" else self.codes
        codes_cd = codes.to(k.dtype)
        weights, index, _ = vq_assign(k.detach(), codes_cd.detach(), assign=self.assign,
                                   temperature=self.fixed_temperature if self.log_temperature is None
                                   else self.temperature.detach())
        if index is None:  # soft: usage statistics from the most probable code
            index = weights.argmax(-1)
        nearest = torch.gather(codes_cd.unsqueeze(0).expand(k.shape[0], -1, -1, -1), 2,
                               index.unsqueeze(-1).expand(-1, -1, -1, self.dim))  # (B, H, T, D)
        aux = k.new_zeros(())
        if self.assign == "hard":
            aux = self.commitment * (k - nearest.detach()).pow(2).mean()
            if self.learning == "grad":
                aux = aux + (k.detach() - nearest).pow(2).mean()

        counts = weights.detach().to(self.codes.dtype).sum((0, 2))  # (H, S)
        self._record_stats(counts, (k.detach() - nearest.detach()).pow(2).sum(-1).mean())
        if self.training:
            self._update_ema(counts, weights, keys)
        return codes_cd, aux

    @torch.no_grad()
    def _update_ema(self, counts: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> None:
        counts = counts.clone()
        sums = None
        if self.learning == "ema":
            w = weights.detach().to(keys.dtype).transpose(0, 1).reshape(self.num_heads, -1, self.num_codes)  # (H, B·T, S)
            sums = w.transpose(1, 2) @ keys  # (H, S, D)
            _all_reduce_sum(counts, sums)
        else:
            _all_reduce_sum(counts)
        # Global sums: DDP is exactly EMA k-means on the union of the ranks' batches.
        self.ema_counts.lerp_(counts, 1 - self.decay)
        if sums is None:
            return
        self.ema_sums.lerp_(sums, 1 - self.decay)
        total = self.ema_counts.sum(-1, keepdim=True)
        smoothed = (self.ema_counts + self.eps) / (total + self.num_codes * self.eps) * total
        self.codes.copy_(self.ema_sums / smoothed.unsqueeze(-1))

    @torch.no_grad()
    def _replace_codes(self, mask: torch.Tensor, keys: torch.Tensor) -> None:
        """Set the codes where mask (H, S) is True to random keys of this batch (rank 0's, on every rank)."""
        mask = _broadcast_from_rank0(mask.clone())
        if not bool(mask.any()):
            return
        n = keys.shape[1]
        pick = torch.randint(n, (self.num_heads, self.num_codes), device=keys.device)
        candidates = torch.gather(keys, 1, pick.unsqueeze(-1).expand(-1, -1, self.dim))  # (H, S, D)
        candidates = _broadcast_from_rank0(candidates.contiguous())
        new_codes = torch.where(mask.unsqueeze(-1), candidates.to(self.codes.dtype), self.codes)
        self.codes.copy_(new_codes)
        # A restarted code starts with the usage of a just-alive code, so it is not restarted again at once.
        restart_count = max(self.dead_code_threshold, 1.0)
        self.ema_counts.copy_(torch.where(mask, torch.full_like(self.ema_counts, restart_count), self.ema_counts))
        if self.learning == "ema":
            self.ema_sums.copy_(torch.where(mask.unsqueeze(-1), new_codes * restart_count, self.ema_sums))

    def _record_stats(self, counts: torch.Tensor, quant_error: torch.Tensor) -> None:
        probs = counts / counts.sum(-1, keepdim=True).clamp_min(1e-12)  # (H, S)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)  # (H,)
        usage = self.ema_counts if self.assign == "hard" else counts
        # Tensors, not floats: converting here would synchronise the GPU on every step.
        self.last_stats = {
            "perplexity": entropy.exp().mean(),
            "dead_codes": (usage < max(self.dead_code_threshold, 1e-12)).sum(-1).float().mean(),
            "quant_error": quant_error,
        }

    def usage_stats(self) -> dict[str, float]:
        """Of the last forward: code-usage perplexity (mean over heads; S means uniform use), dead codes per head,
        mean squared quantisation error ‖k − c_z‖²."""
        return {name: float(value) for name, value in self.last_stats.items()}

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, codes={self.num_codes}, dim={self.dim}, assign={self.assign}, "
                f"learning={self.learning}, decay={self.decay}, commitment={self.commitment}")
