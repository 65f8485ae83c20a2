"""Exact softmax attention: the baseline every codebook variant is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_qkv
from .varlen import varlen


@varlen(("q", "k", "v"))
def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q kᵀ + causal mask) v via ``F.scaled_dot_product_attention``.

    q, k: (B, H, T, D); v: (B, H, T, Dv) -> (B, H, T, Dv). ``scale`` defaults to D**-0.5.
    """
    check_qkv(q, k, v, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
