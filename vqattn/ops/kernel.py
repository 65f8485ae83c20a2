"""Kernel-smoother attention (Tsai et al. 2019, "Transformer Dissection"): out_t = Σ_s κ(q_t, k_s) v_s / n_t.

Quadratic in T on purpose: this is the exact analysis baseline that the linear (feature-map) forms
approximate. Softmax attention is the case κ = exp(scale·q·k) with the row-sum normaliser.
"""

from __future__ import annotations

import torch

from .linear import NORMALIZERS, _check_eps, _normalize
from .utils import autocast_off, check_choice, check_positive_int, check_qkv, compute_dtype, resolve_scale

KERNELS = ("exp", "rbf", "poly", "linear")


@autocast_off
def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: str = "exp",
    causal: bool,
    scale: float | None = None,
    degree: int = 2,
    normalizer: str | None = None,
    position_kernel: torch.Tensor | None = None,
    eps: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with an explicit kernel, s = ``scale`` (default D**-0.5):

      * ``"exp"``:    κ = exp(s·q·k)               (= softmax_attention with the "kernel" normaliser)
      * ``"rbf"``:    κ = exp(−s·‖q − k‖²/2)
      * ``"poly"``:   κ = (s·q·k)^degree
      * ``"linear"``: κ = s·q·k                    (signed)

    q: (B, H, Tq, D), k: (B, H, Tk, D), v: (B, H, Tk, Dv) -> (B, H, Tq, Dv). Causal attention allows Tq ≤ Tk:
    the queries are then the last Tq positions (query t sees keys ≤ Tk − Tq + t), as when decoding with a KV cache.

    position_kernel: optional non-negative tensor broadcastable to (B, H, Tq, Tk), e.g. (Tq, Tk); the
    weights become the product kernel κ(q_t, k_s)·P[t, s] (Tsai et al.'s content × position kernel).

    normalizer: as in ``linear_attention`` ("kernel": the row sum, scale-free, an all-zero row gives 0; with
    ``eps`` given the row sum clamped at eps; "count": number of keys attended, "none"). Default: "kernel" for
    the non-negative kernels (exp, rbf, even-degree poly) and "count" for signed ones (linear, odd-degree poly),
    whose row sums can be ≤ 0.
    mask: optional (Tq, Tk) bool, the keys each query may see besides causality (packed sequences: its own
    sequence's, :meth:`~vqattn.ops.varlen.Segments.document_mask`); the "count" normaliser counts those.
    Half precision is computed in float32, also under ``torch.autocast`` (disabled inside); the output has v's dtype.
    """
    normalizer = _check_args(
        q, k, v, kernel=kernel, causal=causal, scale=scale, degree=degree, normalizer=normalizer, eps=eps
    )
    out_dtype = v.dtype
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    s = float(resolve_scale(scale, D))
    if position_kernel is not None:
        position_kernel = _check_position_kernel(position_kernel, q, Tq, Tk).to(dt)

    keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril(Tk - Tq)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (Tq, Tk):
            raise ValueError(f"mask must be a ({Tq}, {Tk}) bool tensor, got {getattr(mask, 'shape', type(mask))}")
        keep = keep & mask
    weights = _kernel_weights(q, k, keep, kernel, s, degree, position_kernel, normalizer)
    num = weights @ v  # (B, H, Tq, Dv)
    count = keep.sum(-1).to(dt).expand(B, H, Tq)
    return _normalize(num, weights.sum(-1), count, normalizer, eps).to(out_dtype)


def _check_args(q, k, v, *, kernel, causal, scale, degree, normalizer, eps) -> str:
    """Check ``kernel_attention``'s arguments; return the normalizer, by default chosen by the kernel's sign."""
    check_qkv(q, k, v, causal=False)
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs q no longer than k, got q T={q.shape[2]} and k T={k.shape[2]}")
    check_choice("kernel", kernel, KERNELS)
    check_positive_int("degree", degree)
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be > 0 or None, got {scale!r}")
    _check_eps(eps)
    if normalizer is None:
        # signed kernels' row sums can be ≤ 0, and dividing by them would flip signs
        signed = kernel == "linear" or (kernel == "poly" and degree % 2 == 1)
        normalizer = "count" if signed else "kernel"
    check_choice("normalizer", normalizer, NORMALIZERS)
    return normalizer


def _kernel_weights(q, k, keep, kernel, s, degree, position_kernel, normalizer) -> torch.Tensor:
    """The (B, H, Tq, Tk) weights κ(q_t, k_s)·P[t, s] of ``kernel_attention``, zero where ``keep`` is False."""
    dots = torch.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, Tq, Tk)
    if kernel in ("exp", "rbf"):
        if kernel == "exp":
            logits = s * dots
        else:
            logits = -0.5 * s * (q.pow(2).sum(-1, keepdim=True) - 2 * dots + k.pow(2).sum(-1).unsqueeze(-2))
        if position_kernel is not None:
            logits = logits + position_kernel.log()  # log 0 = -inf: a zero position weight stays exactly 0
        logits = logits.masked_fill(~keep, float("-inf"))
        if normalizer == "kernel":
            # the row max cancels in the normalised weights; it keeps exp from overflowing
            shift = logits.amax(dim=-1, keepdim=True).detach()
            logits = logits - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        weights = torch.exp(logits)
    else:
        weights = (s * dots).pow(degree) if kernel == "poly" else s * dots
        if position_kernel is not None:
            weights = weights * position_kernel
        weights = weights.masked_fill(~keep, 0.0)
    return weights


def _check_position_kernel(p: torch.Tensor, q: torch.Tensor, Tq: int, Tk: int) -> torch.Tensor:
    if not isinstance(p, torch.Tensor) or not p.is_floating_point():
        raise ValueError("position_kernel must be a floating-point tensor broadcastable to (B, H, Tq, Tk)")
    if p.device != q.device:
        raise ValueError(f"position_kernel is on {p.device} but q is on {q.device}")
    if p.dim() < 2 or p.dim() > 4 or tuple(p.shape[-2:]) != (Tq, Tk):
        raise ValueError(
            f"position_kernel must end in (Tq, Tk) = ({Tq}, {Tk}) with at most 4 dims, got {tuple(p.shape)}"
        )
    try:
        torch.broadcast_shapes(p.shape, (q.shape[0], q.shape[1], Tq, Tk))
    except RuntimeError:
        raise ValueError(f"position_kernel of shape {tuple(p.shape)} does not broadcast to (B, H, Tq, Tk)") from None
    if bool((p < 0).any()):
        raise ValueError("position_kernel must be non-negative")
    return p


__all__ = ["KERNELS", "kernel_attention"]
