"""Assignments Δ of keys to codes and the per-code statistics built from them (see :mod:`vqattn.ops.vq`)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ._checks import compute_dtype
from .vq_blocks import no_autocast

ASSIGNMENTS = ("hard", "soft", "kernel")


class Assignment(NamedTuple):
    """Δ_js = weights_js · exp(log_scale_j).

    hard: ``index`` (B, H, T) long, the code of every key; ``weights`` None (the one-hot matrix is never built),
        ``log_scale`` 0.
    soft: ``weights`` (B, H, T, S), rows summing to 1; ``index`` None, ``log_scale`` 0.
    kernel: ``weights`` (B, H, T, S) with row max 1, ``log_scale`` (B, H, T, 1) the (detached) per-key log of the
        largest raw weight; ``index`` None. Keeping the per-key scale apart is what keeps large keys from
        underflowing to 0: exp(−‖k − c‖²/2τ + ‖c‖²/2τ) is e^{−2500} at τ = 0.05, ‖k‖ = 17.
    """

    weights: torch.Tensor | None
    index: torch.Tensor | None
    log_scale: torch.Tensor | float


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


def _scores(k: torch.Tensor, c: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """k·c_s + bias_s as one matmul of [k, 1] with [c_s, bias_s]: no pass that adds the bias to a (T, S) copy.
    k: (B, H, T, D), c: (H, S, D), bias: (H, 1, S) -> (B, H, T, S)."""
    B, H, T, D = k.shape
    k1 = torch.cat([k, k.new_ones(B, H, T, 1)], -1).view(B * H, T, D + 1)
    c1 = torch.cat([c, bias.transpose(-1, -2)], -1).transpose(-1, -2)  # (H, D + 1, S)
    return torch.bmm(k1, c1.repeat(B, 1, 1)).view(B, H, T, -1)


def vq_assign(k: torch.Tensor, codebook: torch.Tensor, *, assign: str, temperature=1.0) -> Assignment:
    """Assignment Δ of keys k (B, H, T, D) to the codes of codebook (H, S, D), computed in float32 (float64
    stays float64) whatever the autocast state. Soft and kernel weights carry the autograd graph to k, the
    codebook and the temperature, so an Assignment computed once per layer can be handed to ``vq_attention``.
    """
    with no_autocast(k.device):
        dtype = compute_dtype(k.dtype)
        k, c = k.to(dtype), codebook.to(dtype)  # c: (H, S, D)
        c_sq = (c * c).sum(-1)[:, None, :]  # (H, 1, S)
        if assign == "hard":
            # ‖k‖² is the same for every code, so it does not change the argmin: the nearest code maximises
            # k·c_s − ‖c_s‖²/2. torch.max's indices: the same first maximum as argmax, but about twice as fast on CPU
            # (measured at (4, 8192, 512): 7.9 against 16.9 ms), whose arg-reductions are not vectorised.
            return Assignment(None, _scores(k, c, -c_sq / 2).max(-1).indices, 0.0)
        tau = temperature_tensor(temperature, c.shape[0], k)
        if assign == "soft":
            # −‖k − c‖²/2τ up to a per-key constant, which the softmax removes: (k/τ)·c − ‖c‖²/2τ, with the
            # divisions on the (T, D) and (S,) operands instead of passes over the (T, S) logits.
            return Assignment(torch.softmax(_scores(k / tau, c, -c_sq / (2 * tau)), dim=-1), None, 0.0)
        kc = k @ c.transpose(-1, -2)  # (B, H, T, S)
        # log Δ = (k·c − ‖k‖²/2)/τ = −‖k − c‖²/2τ + ‖c‖²/2τ, split as log w + r with r the per-key max. The
        # weights subtract max_s k·c before dividing by τ, so the large ‖k‖²/2τ never rounds them; r − sg(r) adds
        # nothing but routes r's gradient (to k and τ) through the weights, as r itself is a detached scale.
        kc_max = kc.detach().amax(-1, keepdim=True)  # (B, H, T, 1)
        r = (kc_max - (k * k).sum(-1, keepdim=True) / 2) / tau
        return Assignment(torch.exp((kc - kc_max) / tau + (r - r.detach())), None, r.detach())


def map_time(fn: Callable[[torch.Tensor], torch.Tensor], a: Assignment) -> Assignment:
    """Apply ``fn`` to every per-position tensor of an Assignment (time is dim 2 of each)."""
    return Assignment(*(fn(x) if isinstance(x, torch.Tensor) else x for x in a))


def cat_time(a: Assignment, b: Assignment) -> Assignment:
    return Assignment(*(torch.cat([x, y], 2) if isinstance(x, torch.Tensor) else x for x, y in zip(a, b)))


def count_scale(a: Assignment, previous: torch.Tensor | float = 0.0) -> torch.Tensor | float:
    """Log-unit G of the code statistics: counts and sums are stored divided by e^G, G (B, H, 1, 1) the largest
    per-key scale seen so far (kernel), or 0 (hard, soft)."""
    if not isinstance(a.log_scale, torch.Tensor):
        return previous
    g = a.log_scale.amax(2, keepdim=True)
    return g if not isinstance(previous, torch.Tensor) else torch.maximum(g, previous)


def log_counts(counts: torch.Tensor) -> torch.Tensor:
    """log n with log 0 = −inf and no NaN gradient for empty codes."""
    tiny = torch.finfo(counts.dtype).tiny
    return torch.where(counts > 0, counts.clamp_min(tiny).log(), float("-inf"))


def code_bias(counts: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """log n_s + G: the cache logit offset of counts (B, H, ..., S) stored in units of e^G, G (B, H, 1, 1)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.view(*scale.shape[:2], *[1] * (counts.dim() - 2))
    return log_counts(counts) + scale


def code_means(counts: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    return sums / counts.clamp_min(torch.finfo(counts.dtype).tiny).unsqueeze(-1)


def unit_weights(a: Assignment, scale: torch.Tensor | float) -> torch.Tensor:
    """Δ e^{−G} of soft and kernel assignments, (B, H, T, S): the weights in the statistics' unit."""
    return a.weights if not isinstance(a.log_scale, torch.Tensor) else a.weights * torch.exp(a.log_scale - scale)


def _slots(index: torch.Tensor, num_codes: int, num_groups: int) -> torch.Tensor:
    """(B, H, T) codes -> their slots in a flattened (num_groups·S) axis of consecutive groups of keys."""
    T = index.shape[-1]
    return torch.arange(T, device=index.device) // (T // num_groups) * num_codes + index


def code_counts(a: Assignment, num_codes: int, num_groups: int, scale: torch.Tensor | float = 0.0, *,
                dtype: torch.dtype) -> torch.Tensor:
    """Per-group code counts Σ_j Δ_js e^{−G} over consecutive groups of keys: (B, H, G, S)."""
    if a.index is None:
        w = unit_weights(a, scale)
        return w.view(*w.shape[:2], num_groups, -1, num_codes).sum(3)
    B, H, T = a.index.shape
    ones = torch.ones((), device=a.index.device, dtype=dtype).expand(B, H, T)
    counts = ones.new_zeros(B, H, num_groups * num_codes).scatter_add_(2, _slots(a.index, num_codes, num_groups), ones)
    return counts.view(B, H, num_groups, num_codes)


def code_statistics(
    a: Assignment, v: torch.Tensor, num_codes: int, num_groups: int, scale: torch.Tensor | float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group code counts (:func:`code_counts`) and value sums Σ_j Δ_js v_j e^{−G} over consecutive groups.

    v: (B, H, G·L, Dv) -> counts (B, H, G, S), sums (B, H, G, S, Dv); ``scale`` is G from :func:`count_scale`.
    Hard assignments scatter-add (O(T·Dv)) instead of multiplying by the one-hot matrix (O(T·S·Dv)).
    """
    B, H, T, Dv = v.shape
    S = num_codes
    if a.index is not None and torch.compiler.is_compiling():
        # Inductor (torch 2.13, CPU) ran a kernel reading these scatter-adds' results before the scatters: compiled
        # decoding folded zeros into the value sums. Under compile the one-hot product, (B, H, T, G·S), instead.
        one_hot = torch.nn.functional.one_hot(_slots(a.index, S, num_groups), num_groups * S).to(v.dtype)
        return (one_hot.sum(2).view(B, H, num_groups, S),
                (one_hot.transpose(-1, -2) @ v).view(B, H, num_groups, S, Dv))
    counts = code_counts(a, S, num_groups, scale, dtype=v.dtype)
    if a.index is None:
        w = unit_weights(a, scale).view(B, H, num_groups, T // num_groups, S)
        return counts, w.transpose(-1, -2) @ v.view(B, H, num_groups, -1, Dv)
    slots = _slots(a.index, S, num_groups).unsqueeze(-1).expand(B, H, T, Dv)
    return counts, v.new_zeros(B, H, num_groups * S, Dv).scatter_add_(2, slots, v).view(B, H, num_groups, S, Dv)


def mixture_logits(code_logits: torch.Tensor, a: Assignment) -> torch.Tensor:
    """log Σ_s exp(code_logits_is) Δ_js for every (query, key) pair, stabilised by the per-query max and the
    per-key scale (both exact shifts).

    code_logits: (..., Lq, S); a.weights: (..., Lk, S), a.log_scale: (..., Lk, 1) or 0 -> (..., Lq, Lk).
    """
    m = code_logits.detach().amax(-1, keepdim=True)
    affinity = (code_logits - m).exp_() @ a.weights.transpose(-1, -2)
    out = affinity.clamp_min(torch.finfo(affinity.dtype).tiny).log() + m
    return out + a.log_scale.transpose(-1, -2) if isinstance(a.log_scale, torch.Tensor) else out


def check_assignment(a, *, assign: str, shape: tuple[int, int, int], num_codes: int, device) -> None:
    """``a`` is the Assignment that ``vq_assign(k, codebook, assign=assign)`` returns for keys of (B, H, T)."""
    if not isinstance(a, Assignment):
        raise ValueError(f"assignment must be an Assignment returned by vq_assign, got {type(a).__name__}")
    B, H, T = shape
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
        scaled = isinstance(a.log_scale, torch.Tensor)
        if scaled != (assign == "kernel") or (scaled and a.log_scale.shape != (B, H, T, 1)):
            raise ValueError(f"assignment.log_scale must be {'a (B, H, T, 1) tensor' if assign == 'kernel' else 0} "
                             f"for assign={assign!r}: pass the Assignment that vq_assign returns")
    if x.device != device:
        raise ValueError(f"assignment is on {x.device} but q is on {device}")
