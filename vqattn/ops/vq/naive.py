"""The definition of codebook attention, written as the math: explicit assignment matrices and one (T, T)
softmax, no blocks, no caches, no stabilising tricks beyond a max shift. Quadratic in T: the reference that the
chunk and recurrent forms are tested against (in float64), not a path to run.
"""

from __future__ import annotations

import torch

from ..blocks import DEFAULT_BLOCK_LEN
from .assign import Assignment


def naive_assignment(k: torch.Tensor, codebook: torch.Tensor, assign: str, temperature=1.0) -> torch.Tensor:
    """Δ (B, H, T, S) of keys k (B, H, T, D) to codes c (H, S, D): hard one-hot at argmin_s ‖k − c_s‖ (no gradient),
    soft softmax_s(−‖k − c_s‖²/2τ)."""
    d2 = (k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)).pow(2).sum(-1)  # (B, H, T, S)
    if assign == "hard":
        return torch.nn.functional.one_hot(d2.argmin(-1), codebook.shape[1]).to(k.dtype)
    tau = torch.as_tensor(temperature, dtype=k.dtype, device=k.device).reshape(-1, 1, 1)
    return torch.softmax(-d2 / (2 * tau), -1)


def naive_vq_attention(q, k, v, codebook, *, causal: bool, assign: str = "hard", temperature=1.0,
                       block_len: int = DEFAULT_BLOCK_LEN, scale: float | None = None, exact_window: bool = False,
                       q_rot=None, k_rot=None, assignment: Assignment | None = None):
    """Codebook attention (see :mod:`vqattn.ops.vq`) as one softmax over the keys.

    Query i scores key j by log Σ_s e^{σ q_i·c_s} Δ_js (the key read through the codes). Causal: j ≤ i, and keys
    of the window (the blocks of L keys from block(i) − 1 on) are scored instead by σ q_i·k_j (``exact_window``),
    by σ q_i·k̂_j with the straight-through code key k̂_j = c_{z_j} + (k_j − sg(k_j)) (hard), or by the same
    mixture (soft). With ``q_rot``, ``k_rot`` (RoPE-rotated q and k) the exact window scores σ q_rot_i·k_rot_j.
    ``assignment``: the keys' Assignment, Δ given instead of computed from k; with it and q_rot, k_rot, q and the
    codebook may have another width Dc than k (the codes scored on Dc dims).
    q, k: (B, H, T, D), v: (B, H, T, Dv), codebook (H, S, D) or (S, D) -> (B, H, T, Dv).
    """
    B, H, T, _ = q.shape
    c = codebook if codebook.dim() == 3 else codebook.expand(H, -1, -1)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if assignment is None:
        delta = naive_assignment(k, c, assign, temperature)  # (B, H, Tk, S)
    elif assignment.index is not None:  # hard: the one-hot matrix of the code index
        delta = torch.nn.functional.one_hot(assignment.index, c.shape[1]).to(q.dtype)
    else:
        delta = assignment.weights
    code_logits = scale * q @ c.transpose(-1, -2)  # (B, H, Tq, S)
    m = code_logits.detach().amax(-1, keepdim=True)
    through_codes = torch.log(torch.exp(code_logits - m) @ delta.transpose(-1, -2)) + m  # (B, H, Tq, Tk)
    if not causal:
        return torch.softmax(through_codes, -1) @ v
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    in_window = j // block_len >= i // block_len - 1
    if exact_window:
        window = scale * (q if q_rot is None else q_rot) @ (k if k_rot is None else k_rot).transpose(-1, -2)
    elif assign == "hard":
        k_hat = delta @ c + (k - k.detach())  # c_{z_j}: the one-hot row picks the code
        window = scale * q @ k_hat.transpose(-1, -2)
    else:
        window = through_codes
    logits = torch.where(in_window, window, through_codes).masked_fill(j > i, float("-inf"))
    return torch.softmax(logits, -1) @ v
