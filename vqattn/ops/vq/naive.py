"""The definition of codebook attention, written as the math: explicit assignments and one (T, T) softmax, no
blocks, no caches. Every logit is formed in log space (log-sum-exp over the codes, log-softmax assignments), so the
definition stays finite at any logit magnitude. Quadratic in T: the reference that the chunk and recurrent impls
are tested against (in float64), not a path to run.
"""

from __future__ import annotations

import torch

from ..blocks import DEFAULT_BLOCK_LEN
from ..common.memory_cap import query_memory_bias
from ..utils import resolve_scale
from .assign import Assignment, mixture_logits


def _distances(k: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """‖k_j − c_s‖² (B, H, T, S) of keys k (B, H, T, D) to codes c (H, S, D)."""
    return (k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)).pow(2).sum(-1)


def naive_log_assignment(k: torch.Tensor, codebook: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log Δ (B, H, T, S) of the soft assignment, log_softmax_s(−‖k − c_s‖²/2τ): finite where Δ underflows."""
    tau = torch.as_tensor(temperature, dtype=k.dtype, device=k.device).reshape(-1, 1, 1)
    return torch.log_softmax(-_distances(k, codebook) / (2 * tau), -1)


def _through_codes(code_logits, k, c, *, assign, temperature, assignment):
    """The logit of every (query, key) pair read through the codes, log Σ_s e^{σ q_i·c_s} Δ_js (B, H, Tq, Tk), and
    the hard code index z (B, H, Tk) or None: hard Δ_js picks one code, so the pair's logit is σ q_i·c_{z_j};
    soft takes the log-sum-exp over the codes of σ q_i·c_s + log Δ_js."""
    if assignment is not None and assignment.index is not None:
        z = assignment.index
    elif assign == "hard" and assignment is None:
        z = _distances(k, c).argmin(-1)
    else:
        if assignment is not None:
            return mixture_logits(code_logits, assignment.weights), None
        log_delta = naive_log_assignment(k, c, temperature)  # (B, H, Tk, S), finite where Δ underflows
        return torch.logsumexp(code_logits.unsqueeze(3) + log_delta.unsqueeze(2), -1), None
    Tq = code_logits.shape[2]
    return code_logits.gather(-1, z.unsqueeze(2).expand(-1, -1, Tq, -1)), z


def naive_vq_attention(q, k, v, codebook, *, causal: bool, assign: str = "hard", temperature=1.0,
                       block_len: int = DEFAULT_BLOCK_LEN, scale: float | None = None, exact_window: bool = False,
                       q_rot=None, k_rot=None, assignment: Assignment | None = None, memory_cap: int | None = None):
    """Codebook attention (see :mod:`vqattn.ops.vq`) as one softmax over the keys.

    Query i scores key j by log Σ_s e^{σ q_i·c_s} Δ_js (the key read through the codes). Causal: j ≤ i, and keys
    of the window (the blocks of L keys from block(i) − 1 on) are scored instead by σ q_i·k_j (``exact_window``),
    by σ q_i·k̂_j with the straight-through code key k̂_j = c_{z_j} + (k_j − sg(k_j)) (hard), or by the same
    mixture (soft). With ``q_rot``, ``k_rot`` (RoPE-rotated q and k) the exact window scores σ q_rot_i·k_rot_j.
    ``assignment``: the keys' Assignment, Δ given instead of computed from k; with it and q_rot, k_rot, q and the
    codebook may have another width Dc than k (the codes scored on Dc dims). ``memory_cap`` M: the keys before the
    window, n_i = max(0, block(i) − 1)·L of them, get the bias log min(1, M / n_i) (causal, not the mixture window).
    q, k: (B, H, T, D), v: (B, H, T, Dv), codebook (H, S, D) or (S, D) -> (B, H, T, Dv).
    """
    B, H, T, _ = q.shape
    c = codebook if codebook.dim() == 3 else codebook.expand(H, -1, -1)
    scale = resolve_scale(scale, k.shape[-1])
    code_logits = scale * q @ c.transpose(-1, -2)  # (B, H, Tq, S)
    through_codes, z = _through_codes(code_logits, k, c, assign=assign, temperature=temperature,
                                      assignment=assignment)  # (B, H, Tq, Tk)
    if not causal:
        return torch.softmax(through_codes, -1) @ v
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    in_window = j // block_len >= i // block_len - 1
    if exact_window:
        window = scale * (q if q_rot is None else q_rot) @ (k if k_rot is None else k_rot).transpose(-1, -2)
    elif assign == "hard":
        k_hat = c[torch.arange(H, device=q.device).view(1, H, 1), z] + (k - k.detach())  # c_{z_j}, straight-through
        window = scale * q @ k_hat.transpose(-1, -2)
    else:
        window = through_codes
    bias = query_memory_bias(T, block_len, memory_cap, device=q.device, dtype=q.dtype)  # (T, 1) or None
    memory = through_codes if bias is None else through_codes + bias
    logits = torch.where(in_window, window, memory).masked_fill(j > i, float("-inf"))
    return torch.softmax(logits, -1) @ v
