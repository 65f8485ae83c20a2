"""The delta rule token by token in its rank-one form: decoding, O(Dv·Dk) per token."""

from __future__ import annotations

import torch


def recurrent_forward(q, k, v, beta, log_decay, scale: float, S0):
    """Each token updates the state by one outer product: with S' = exp(g_t) S_{t−1} (the decayed state), the new
    value u_t = β_t (v_t − S' k_t) replaces what S' recalled for k_t, S_t = S' + u_t k_tᵀ (equal to the definition's
    exp(g_t) S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ) and out_t = S_t (scale · q_t). Shapes as
    :func:`~vqattn.ops.delta_rule.naive.naive_forward`; differentiable by autograd."""
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, v.shape[-1], Dk) if S0 is None else S0
    outs = []
    for t in range(T):
        k_t = k[:, :, t]  # (B, H, Dk)
        if log_decay is not None:
            S = S * torch.exp(log_decay[:, :, t])[..., None, None]
        u = beta[:, :, t, None] * (v[:, :, t] - (S @ k_t.unsqueeze(-1)).squeeze(-1))  # (B, H, Dv)
        S = S + u.unsqueeze(-1) * k_t.unsqueeze(-2)
        outs.append((S @ (scale * q[:, :, t]).unsqueeze(-1)).squeeze(-1))
    return torch.stack(outs, 2), S
