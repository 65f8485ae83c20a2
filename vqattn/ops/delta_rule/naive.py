"""The delta rule's definition, one token at a time: the reference every other impl is tested against."""

from __future__ import annotations

import torch


def naive_forward(q, k, v, beta, log_decay, scale: float, S0):
    """S_t = exp(g_t) · S_{t−1} · (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ and out_t = S_t (scale · q_t), as written: the
    (Dk × Dk) matrix I − β_t k_t k_tᵀ is formed and multiplied, token after token, in the inputs' dtype (float64 for
    a reference). q, k (B, H, T, Dk), v (B, H, T, Dv), beta, log_decay (B, H, T) (None: g = 0), S0 (B, H, Dv, Dk) or
    None (zeros) -> (out (B, H, T, Dv), S_T)."""
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, v.shape[-1], Dk) if S0 is None else S0
    eye = torch.eye(Dk, dtype=q.dtype, device=q.device)
    outs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]  # (B, H, Dk), (B, H, Dv), (B, H, 1, 1)
        decay = 1.0 if log_decay is None else torch.exp(log_decay[:, :, t])[..., None, None]
        erase = eye - b_t * (k_t.unsqueeze(-1) * k_t.unsqueeze(-2))  # (B, H, Dk, Dk)
        S = decay * (S @ erase) + b_t * (v_t.unsqueeze(-1) * k_t.unsqueeze(-2))  # (B, H, Dv, Dk)
        outs.append(S @ (scale * q[:, :, t]).unsqueeze(-1))  # (B, H, Dv, 1)
    return torch.cat(outs, -1).transpose(-1, -2), S
