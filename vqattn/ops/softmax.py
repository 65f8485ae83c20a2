"""Exact softmax attention: the baseline every codebook variant is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import check_qkv
from .varlen import Segments, varlen


def _segmented(a: dict, segments: Segments) -> torch.Tensor:
    """A packed causal call given :class:`~vqattn.ops.varlen.Segments`: one SDPA over the row, each query masked to
    the keys of its own sequence up to it (:meth:`~vqattn.ops.varlen.Segments.document_mask`, no host read)."""
    q, k, v = a["q"], a["k"], a["v"]
    check_qkv(q, k, v, causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=segments.document_mask().to(q.device), scale=a["scale"])


@varlen(("q", "k", "v"), segmented=_segmented)
def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q kᵀ + causal mask) v via ``F.scaled_dot_product_attention``.

    q, k: (B, H, T, D); v: (B, H, T, Dv) -> (B, H, T, Dv). ``scale`` defaults to D**-0.5.
    """
    check_qkv(q, k, v, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
