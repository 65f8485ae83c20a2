"""Attention layers (nn.Modules) built on the functional ops, and a registry to pick them by name.

Every layer maps x: (B, T, C) -> (B, T, C) and is causal. It owns

* a fused q/k/v projection and an output projection,
* optional per-head RMS normalisation of q and k (``qk_norm``, as in Transformer-VQ),
* optional rotary position embedding (``rope``); learned absolute positions live in the model,
  so a layer with ``rope=False`` is position-free,
* ``aux_loss``: a scalar tensor set by every forward (the commitment loss for vq layers, 0 otherwise),
* ``usage_stats()``: codebook usage for vq layers, ``{}`` otherwise,
* a recurrent decoding path: ``forward(x, state, return_state=True)`` consumes a chunk of tokens that
  follows the tokens summarised by ``state`` and returns the state after the chunk. Feeding a sequence in
  chunks gives the same outputs as one call on the whole sequence.

Build a layer with ``build_attention(name, dim=..., num_heads=..., **kwargs)``; ``ATTENTIONS`` maps each
name to its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .functional import softmax_attention
from .ops._checks import check_positive_int


@dataclass
class AttentionState:
    """Decoding state of one layer after ``pos`` tokens: the op's own state plus the position counter.

    ``inner`` is a ``KVCache`` for softmax, the op's ``VQState`` for vq layers and its ``LinearState``
    for the kernel family.
    """

    pos: int
    inner: Any


class KVCache(NamedTuple):
    """Softmax decoding state: all past keys (already rotated when RoPE is on) and values, (B, H, P, D)."""

    k: torch.Tensor
    v: torch.Tensor


def rope_rotate(x: torch.Tensor, start: int, base: float) -> torch.Tensor:
    """Rotary position embedding of x: (B, H, T, D) at absolute positions start..start+T-1.

    Feature pairs (x_m, x_{m+D/2}) are rotated by the angle pos * base^(-2m/D), so that
    <rope(q, i), rope(k, j)> depends on i and j only through i - j. Angles are computed in float64
    and the rotation in at least float32, so fp64 decoding matches the full pass to rounding.
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / d)  # (D/2,)
    pos = torch.arange(start, start + x.shape[-2], dtype=torch.float64, device=x.device)  # (T,)
    angle = pos[:, None] * inv_freq[None, :]  # (T, D/2)
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Base class: projections, q/k normalisation, RoPE and the chunked-state protocol.

    Subclasses implement ``_attend(q, k, v, pos, state, return_state)`` on (B, H, T, Dh) tensors, where
    q and k are projected and normalised but not rotated (each variant decides where RoPE goes), ``pos``
    is the absolute position of the first token and ``state`` the op state (or None for a fresh start).
    """

    supports_rope: ClassVar[bool] = True

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        qk_norm: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
    ):
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        if rope and not self.supports_rope:
            raise ValueError(f"{type(self).__name__} does not support rope: {self.rope_unsupported_reason()}")
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got dim // num_heads = {self.head_dim}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if rope_base <= 0:
            raise ValueError(f"rope_base must be > 0, got {rope_base!r}")
        self.rope, self.rope_base = rope, rope_base
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        # Transformer-VQ RMS-normalises q and k per head; this bounds |q.k| and keeps codes comparable.
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.aux_loss = torch.zeros(())

    @classmethod
    def rope_unsupported_reason(cls) -> str:
        return ""

    def rotate(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """RoPE at positions pos.. when this layer uses it, else x unchanged."""
        return rope_rotate(x, pos, self.rope_base) if self.rope else x

    def forward(self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False):
        """x: (B, T, C) -> (B, T, C), or (out, AttentionState) when ``return_state``.

        ``state`` summarises the tokens before x (from a previous call with ``return_state=True``).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, T, {self.dim}), got {tuple(x.shape)}")
        if state is not None and not isinstance(state, AttentionState):
            raise ValueError(f"state must be an AttentionState or None, got {type(state).__name__}")
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = 0 if state is None else state.pos
        self.aux_loss = x.new_zeros(())
        out, inner = self._attend(q, k, v, pos, None if state is None else state.inner, return_state)  # (B, H, T, Dh)
        y = self.resid_dropout(self.proj(out.transpose(1, 2).reshape(b, t, c)))  # (B, T, C)
        return (y, AttentionState(pos + t, inner)) if return_state else y

    def _attend(self, q, k, v, pos: int, state, return_state: bool):
        raise NotImplementedError

    def usage_stats(self) -> dict[str, float]:
        """Codebook usage statistics (vq layers); empty for the others."""
        return {}


class SoftmaxAttention(Attention):
    """Exact causal softmax attention; decoding keeps a KV cache (memory grows with the sequence)."""

    def _attend(self, q, k, v, pos, state: KVCache | None, return_state):
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        if state is not None:
            k, v = torch.cat((state.k, k), dim=2), torch.cat((state.v, v), dim=2)  # (B, H, P+T, Dh)
        past, t = k.shape[2] - q.shape[2], q.shape[2]
        if past == 0:
            out = softmax_attention(q, k, v, causal=True)
        else:
            # Query i sits at position past + i and sees keys 0..past+i.
            rows = torch.arange(t, device=q.device)[:, None] + past
            mask = torch.arange(past + t, device=q.device)[None, :] <= rows  # (T, P+T)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out, (KVCache(k, v) if return_state else None)


ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
}


def build_attention(name: str, **kwargs) -> Attention:
    """Instantiate the attention layer registered as ``name``; kwargs go to its constructor."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; valid names are: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name](**kwargs)
