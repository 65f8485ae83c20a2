"""Naive float64 references, written independently of the fast paths: full T×T matrices, no blocks, no caches."""

from __future__ import annotations

import math

import torch


def ref_softmax_attention(q, k, v, *, causal, scale=None):
    """softmax(scale q kᵀ) v with an explicit (T, T) matrix."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if causal:
        T = q.shape[2]
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        logits = logits.masked_fill(future, -math.inf)
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, -1), v)


def ref_assignment_log_weights(k, codebook, assign, temperature):
    """log Δ (B, H, T, S) from explicit distances ‖k − c‖² (torch.cdist)."""
    c = codebook if codebook.dim() == 3 else codebook.expand(k.shape[1], -1, -1)
    dist2 = torch.cdist(k, c.unsqueeze(0).expand(k.shape[0], -1, -1, -1)) ** 2  # (B, H, T, S)
    tau = torch.as_tensor(temperature, dtype=k.dtype).reshape(-1, 1, 1)
    if assign == "hard":
        one_hot = torch.nn.functional.one_hot(dist2.argmin(-1), c.shape[1]).to(k.dtype)
        return torch.log(one_hot)  # −inf off the chosen code
    if assign == "soft":
        return torch.log_softmax(-dist2 / (2 * tau), dim=-1)
    return -dist2 / (2 * tau) + (c * c).sum(-1).unsqueeze(1) / (2 * tau)  # kernel


def ref_vq_attention(q, k, v, codebook, *, causal, assign="hard", temperature=1.0, block_len=None, scale=None,
                     exact_window=False, q_rot=None, k_rot=None, memory_cap=None):
    """Codebook attention as one (T, T) softmax.

    Pair (i, j) has logit log Σ_s exp(scale q_i·c_s) Δ_js. Causal: j ≤ i, and j is "in the window" of i when
    block(j) ≥ block(i) − 1. Hard keys in the window use the straight-through key c_z + (k − sg k); everywhere
    else hard keys carry no gradient. ``exact_window`` uses scale q_i·k_j in the window (q_rot_i·k_rot_j when
    given). ``memory_cap`` M: the n_i = L·max(0, block(i) − 1) keys before the window weigh min(1, M / n_i) times.
    """
    B, H, T, D = q.shape
    scale = D**-0.5 if scale is None else scale
    c = codebook if codebook.dim() == 3 else codebook.expand(H, -1, -1)
    code_logits = scale * torch.einsum("bhid,hsd->bhis", q, c)  # (B, H, Tq, S)
    log_w = ref_assignment_log_weights(k, c, assign, temperature)  # (B, H, Tk, S)
    mixture = torch.logsumexp(code_logits.unsqueeze(3) + log_w.unsqueeze(2), dim=-1)  # (B, H, Tq, Tk)
    if not causal:
        return torch.einsum("bhij,bhjd->bhid", torch.softmax(mixture, -1), v)

    if block_len is None:
        raise ValueError("the reference needs an explicit block_len for causal attention")
    L = block_len
    pos = torch.arange(T)
    in_window = (pos[None, :] // L) >= (pos[:, None] // L) - 1  # (Tq, Tk)
    future = pos[None, :] > pos[:, None]
    if memory_cap is not None:
        before_window = (pos // L - 1).clamp(min=0).double() * L  # (Tq,) n_i
        weight = torch.where(before_window > memory_cap, memory_cap / before_window.clamp(min=1), 1.0)
        mixture = mixture + weight.log().to(mixture.dtype)[:, None]
    if exact_window:
        near = scale * torch.einsum("bhid,bhjd->bhij", q if q_rot is None else q_rot, k if k_rot is None else k_rot)
    elif assign == "hard":
        z = log_w.argmax(-1)  # (B, H, T)
        c_z = c[torch.arange(H)[None, :, None], z]  # (B, H, T, D)
        near = scale * torch.einsum("bhid,bhjd->bhij", q, c_z + (k - k.detach()))
    else:
        near = mixture
    logits = torch.where(in_window, near, mixture).masked_fill(future, -math.inf)
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, -1), v)


def ref_window_attention(q, k, v, *, block_len, scale=None):
    """Causal softmax attention restricted to the current and the previous block: an explicit (T, T) band mask."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    pos = torch.arange(q.shape[2])
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] // block_len >= pos[:, None] // block_len - 1)
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits.masked_fill(~visible, -math.inf), -1), v)


def ref_decay_attention(q, k, v, log_decay, *, scale=None, S0=None):
    """Linear attention with a scalar decay as one (T, T) matrix: out_t = Σ_{s≤t} exp(G_t − G_s) scale q_t·k_s v_s
    + exp(G_t) S0 (scale q_t), with G the cumulative log decay; and the final state Σ_s exp(G_T − G_s) v_s k_sᵀ
    + exp(G_T) S0 (B, H, Dv, Dk)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    G = log_decay.cumsum(-1)  # (B, H, T)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    weights = scale * torch.einsum("bhid,bhjd->bhij", q, k) * torch.exp((G[..., :, None] - G[..., None, :])
                                                                        .masked_fill(future, -math.inf))
    out = torch.einsum("bhij,bhjd->bhid", weights, v)
    to_end = torch.exp(G[..., -1:] - G)  # (B, H, T)
    S = torch.einsum("bhj,bhjv,bhjd->bhvd", to_end, v, k)
    if S0 is not None:
        out = out + torch.exp(G).unsqueeze(-1) * torch.einsum("bhvd,bhid->bhiv", S0, scale * q)
        S = S + torch.exp(G[..., -1])[..., None, None] * S0
    return out, S
