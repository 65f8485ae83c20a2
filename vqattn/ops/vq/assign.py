"""Assignments Δ of keys to a learned codebook (see :mod:`vqattn.ops.vq`; the statistics built from them are in
:mod:`vqattn.ops.common.statistics`).

    hard    Δ_js = 1[s = argmin_s' ‖k_j − c_s'‖]              (one-hot, kept as the code index z_j)
    soft    Δ_js = softmax_s(−‖k_j − c_s‖² / 2τ)               (GMM posterior p(s | k_j), rows summing to 1)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..common.statistics import Assignment, log_counts
from ..triton.nearest import nearest_codes
from ..triton.soft import soft_weights
from ..triton.utils import runs_kernels
from ..utils import autocast_off, check_choice, check_positive_int, compute_dtype

ASSIGNMENTS = ("hard", "soft")


def temperature_tensor(temperature, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    """Temperature as a (H, 1, 1) tensor broadcasting over (B, H, T, S); validates positivity."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() not in (1, num_heads):
            raise ValueError(
                f"temperature must be a number, a 1-element tensor or one value per head ({num_heads}), "
                f"got shape {tuple(temperature.shape)}"
            )
        # Checked on the device: reading the values on the host would synchronise a GPU on every step (and break
        # a torch.compile graph).
        torch._assert_async((temperature > 0).all(), "temperature must be > 0")
        return temperature.to(device=like.device, dtype=like.dtype).reshape(-1, 1, 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    return like.new_full((1, 1, 1), float(temperature))


# Score tiles of about this size on CPU in eager mode (see :func:`row_tiles`).
TILE_BYTES = 4 * 2**20


def row_tiles(num_rows: int, row_bytes: int, device: torch.device, tile_rows: int | None = None) -> list[slice]:
    """Consecutive ranges of keys whose (rows, S) scores are formed at once. On CPU in eager mode, tiles of about
    :data:`TILE_BYTES` (or ``tile_rows`` keys): a fresh (T, S) temporary costs more in zero-filled pages than the
    softmax over it (:func:`~vqattn.ops.blocks.block_groups`), while a tile stays in cache and reuses freed memory.
    Elsewhere (GPUs, compiled graphs) one tile, i.e. few kernels."""
    if tile_rows is None:
        if device.type != "cpu" or torch.compiler.is_compiling():
            return [slice(None)]  # no loop over a length that a compiled graph may hold as a symbol
        tile_rows = TILE_BYTES // max(row_bytes, 1)
    tile_rows = max(1, min(tile_rows, num_rows))
    return [slice(r, min(r + tile_rows, num_rows)) for r in range(0, num_rows, tile_rows)]


def _augmented(k: torch.Tensor, c: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[k, 1] (B·H, T, D + 1) and [c_s, bias_s] (B·H, D + 1, S), whose product is k·c_s + bias_s: one matmul, and no
    pass adding the bias to a (T, S) tensor. k: (B, H, T, D), c: (H, S, D), bias: (H, 1, S)."""
    B, H, T, D = k.shape
    k1 = torch.cat([k, k.new_ones(B, H, T, 1)], -1).view(B * H, T, D + 1)
    c1 = torch.cat([c, bias.transpose(-1, -2)], -1).transpose(-1, -2)  # (H, D + 1, S)
    return k1, c1.repeat(B, 1, 1)


def _nearest(k: torch.Tensor, c: torch.Tensor, bias: torch.Tensor, tiles: list[slice]) -> torch.Tensor:
    """argmax_s k·c_s + bias_s (B, H, T), tile by tile; k: (B, H, T, D), c: (H, S, D), bias: (H, 1, S). The bias is
    added to each tile while it is in cache (no augmented copy of k). torch.max's indices: the same first maximum as
    argmax, but about twice as fast on CPU, whose arg-reductions are not vectorised."""
    codes = c.transpose(-1, -2)  # (H, D, S)
    return torch.cat([(k[:, :, rows] @ codes).add_(bias).max(-1).indices for rows in tiles], 2)


class _ScoreSoftmax(torch.autograd.Function):
    """softmax_s(k1·c1) (N, T, S) of :func:`_augmented`'s operands, normalised in place tile by tile. The backward
    pass forms the scores' gradient y ⊙ (g − Σ_s g y) one tile at a time, so neither pass writes a (T, S) temporary
    besides the output."""

    @staticmethod
    def forward(ctx, k1, c1, tiles):
        weights = torch.bmm(k1, c1)  # (N, T, S): the scores, then their softmax
        for rows in tiles:
            weights[:, rows] = torch.softmax(weights[:, rows], -1)
        ctx.save_for_backward(k1, c1, weights)
        ctx.tiles = tiles
        return weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        k1, c1, weights = ctx.saved_tensors
        need_k1, need_c1 = ctx.needs_input_grad[:2]
        grad_k1, grad_c1 = [], torch.zeros_like(c1) if need_c1 else None
        for rows in ctx.tiles:
            y = weights[:, rows]
            ds = grad[:, rows] * y
            ds.addcmul_(y, ds.sum(-1, keepdim=True), value=-1)  # y ⊙ (g − Σ_s g y)
            if need_k1:
                grad_k1.append(ds @ c1.transpose(-1, -2))
            if need_c1:
                grad_c1.baddbmm_(k1[:, rows].transpose(-1, -2), ds)
        return torch.cat(grad_k1, 1) if need_k1 else None, grad_c1, None


class SoftMixture(NamedTuple):
    """The soft assignment of ``keys`` (B, H, T, D) to ``codes`` (H, S, D) at ``temperature``, not formed: the fused
    impl recomputes its weights wherever it needs them (:mod:`vqattn.ops.triton.soft`), so no (T, S) tensor
    reaches memory; any other impl forms it (:meth:`formed`). What ``vq_assign(..., formed=False)`` returns."""

    keys: torch.Tensor
    codes: torch.Tensor
    temperature: float | torch.Tensor

    def formed(self) -> Assignment:
        return vq_assign(self.keys, self.codes, assign="soft", temperature=self.temperature)


@autocast_off
def vq_assign(k: torch.Tensor, codebook: torch.Tensor, *, assign: str, temperature=1.0,
              tile_rows: int | None = None, formed: bool = True) -> Assignment | SoftMixture:
    """Assignment Δ of keys k (B, H, T, D) to the codes of codebook (H, S, D), computed in float32 (float64
    stays float64) whatever the autocast state. Soft weights carry the autograd graph to k, the codebook and the
    temperature, so an Assignment computed once per layer can be handed to ``vq_attention``. ``tile_rows``: keys
    whose scores are formed at once (default: :func:`row_tiles`); never changes the result. On a GPU the
    assignments are Triton kernels (:mod:`vqattn.ops.triton.nearest`, :mod:`vqattn.ops.triton.soft`).
    ``formed=False`` (soft only): a :class:`SoftMixture`, the weights left to the op (the temperature validated).
    """
    check_choice("assign", assign, ASSIGNMENTS)
    if tile_rows is not None:
        check_positive_int("tile_rows", tile_rows)
    if not formed:
        if assign != "soft":
            raise ValueError(f"formed=False is for assign='soft' (a hard assignment is its code index), got {assign!r}")
        temperature_tensor(temperature, codebook.shape[0], codebook)  # validated now, as a formed one would be
        return SoftMixture(k, codebook, temperature)
    if runs_kernels(k):  # kernels on a GPU: no (T, S) scores in memory, tensor-core products
        if assign == "hard":
            return Assignment(None, nearest_codes(k, codebook))
        tau = temperature_tensor(temperature, codebook.shape[0], codebook.float())  # validated, float32
        return Assignment(soft_weights(k, codebook, tau), None)
    dtype = compute_dtype(k.dtype)
    k, c = k.to(dtype), codebook.to(dtype)  # c: (H, S, D)
    B, H, T, _ = k.shape
    c_sq = (c * c).sum(-1)[:, None, :]  # (H, 1, S)
    tiles = row_tiles(T, B * H * c.shape[1] * k.element_size(), k.device, tile_rows)
    if assign == "hard":
        # ‖k‖² is the same for every code, so it does not change the argmin: the nearest code maximises
        # k·c_s − ‖c_s‖²/2.
        return Assignment(None, _nearest(k, c, -c_sq / 2, tiles))
    tau = temperature_tensor(temperature, c.shape[0], k)
    # −‖k − c‖²/2τ up to a per-key constant, which the softmax removes: (k/τ)·c − ‖c‖²/2τ, with the divisions on
    # the (T, D) and (S,) operands instead of passes over the (T, S) logits.
    weights = _ScoreSoftmax.apply(*_augmented(k / tau, c, -c_sq / (2 * tau)), tiles)
    return Assignment(weights.view(B, H, T, -1), None)


def mixture_logits(code_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log Σ_s exp(code_logits_is) Δ_js for every (query, key) pair: the log-sum-exp over the codes of
    code_logits_is + log Δ_js, exact at any magnitude (shifting by a query's best code logit alone underflows when
    its best codes hold none of the key's mass). A weight of exactly 0 adds nothing and gets no gradient.
    code_logits: (..., Lq, S); weights Δ: (..., Lk, S) -> (..., Lq, Lk). Forms an (Lq, Lk, S) tensor: decoding's
    one query, or the definition."""
    return torch.logsumexp(code_logits.unsqueeze(-2) + log_counts(weights).unsqueeze(-3), -1)


def check_assignment(a, *, assign: str, shape: tuple[int, int, int], num_codes: int, device) -> None:
    """``a`` is the Assignment that ``vq_assign(k, codebook, assign=assign)`` returns for keys of (B, H, T)."""
    B, H, T = shape
    if isinstance(a, SoftMixture):
        if assign != "soft" or a.keys.shape[:3] != (B, H, T) or a.codes.shape[:2] != (H, num_codes) \
                or a.keys.shape[-1] != a.codes.shape[-1]:
            raise ValueError(f"a SoftMixture assignment needs assign='soft', keys (B, H, T, D) with (B, H, T) = "
                             f"{(B, H, T)} and codes (H, S, D) with (H, S) = {(H, num_codes)}, got assign={assign!r}, "
                             f"keys {tuple(a.keys.shape)}, codes {tuple(a.codes.shape)}")
        if a.keys.device != device:
            raise ValueError(f"assignment is on {a.keys.device} but q is on {device}")
        return
    if not isinstance(a, Assignment):
        raise ValueError(f"assignment must be an Assignment or SoftMixture returned by vq_assign, got "
                         f"{type(a).__name__}")
    if assign == "hard":
        if a.index is None or a.weights is not None or a.index.shape != (B, H, T) or a.index.is_floating_point():
            got = "weights" if a.index is None else f"index {tuple(a.index.shape)} {a.index.dtype}"
            raise ValueError(f"assign='hard' needs an assignment with an integer code index of shape "
                             f"(B, H, T) = {(B, H, T)} and no weights, got {got}")
        x = a.index
    else:
        if a.weights is None or a.index is not None or a.weights.shape != (B, H, T, num_codes):
            got = "a code index" if a.weights is None else f"weights {tuple(a.weights.shape)}"
            raise ValueError(f"assign={assign!r} needs an assignment with weights of shape (B, H, T, S) = "
                             f"{(B, H, T, num_codes)}, got {got}")
        x = a.weights
    if x.device != device:
        raise ValueError(f"assignment is on {x.device} but q is on {device}")


def straight_through_keys(k: torch.Tensor, codebook: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """k̂_j = c_{z_j} + (k_j − sg(k_j)): the hard window's keys, whose gradient reaches both the code and the key.
    k (B, H, T, D), codebook (H, S, D), index (B, H, T) -> (B, H, T, D)."""
    B, H, T, D = k.shape
    codes = codebook.unsqueeze(0).expand(B, -1, -1, -1).gather(2, index.unsqueeze(-1).expand(B, H, T, D))
    return codes + (k - k.detach())
