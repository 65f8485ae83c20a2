"""The scalar-decay recurrence token by token: decoding (O(Dk·Dv) per token) and, in float64, the reference."""

from __future__ import annotations

import torch


def recurrent_forward(q, k, v, g, scale: float, S0, starts: torch.Tensor | None = None):
    """S_t = exp(g_t) S_{t−1} + v_t k_tᵀ and out_t = S_t (scale · q_t), as written, in the inputs' dtype; a token of
    ``starts`` (T,) bool (a packed sequence's first) drops the state before it. q, k (B, H, T, Dk), v (B, H, T, Dv),
    g (B, H, T), S0 (B, H, Dv, Dk) or None (zeros) -> (out (B, H, T, Dv), S_T)."""
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, v.shape[-1], Dk) if S0 is None else S0
    outs = []
    for t in range(T):
        keep = torch.exp(g[:, :, t])  # (B, H)
        if starts is not None:
            keep = keep * ~starts[t]
        S = keep[..., None, None] * S + v[:, :, t].unsqueeze(-1) * k[:, :, t].unsqueeze(-2)  # (B, H, Dv, Dk)
        outs.append((S @ (scale * q[:, :, t]).unsqueeze(-1)).squeeze(-1))  # (B, H, Dv)
    return torch.stack(outs, 2), S
