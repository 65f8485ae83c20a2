"""Naive float64 references for the kernel family, written independently of the library code.

They loop over query positions and spell out each formula directly, trading speed for obviousness.
"""

from __future__ import annotations

import math

import torch


def _rows(weights_fn, Tq, Tk, causal, v, normalizer, eps):
    """Build out_t = Σ_{s allowed} w_ts v_s / n_t one query position at a time."""
    outs = []
    for t in range(Tq):
        stop = t + 1 if causal else Tk
        w = weights_fn(t, stop)  # (B, H, stop)
        num = (w.unsqueeze(-1) * v[:, :, :stop]).sum(2)
        if normalizer == "kernel":
            den = w.sum(-1)
            den = torch.where(den > 0, den, 1.0) if eps is None else den.clamp_min(eps)  # 0 rows give 0
        elif normalizer == "count":
            den = torch.full_like(w[..., 0], stop)
        else:
            den = torch.ones_like(w[..., 0])
        outs.append(num / den.unsqueeze(-1))
    return torch.stack(outs, dim=2)


def naive_linear_attention(phi_q, phi_k, v, *, causal, normalizer="kernel", k_log_scale=None):
    """k_log_scale (B, H, Tk): true key features are phi_k · exp(k_log_scale). The kernel normaliser is the row
    sum (rows of zero weights give 0)."""
    Tq, Tk = phi_q.shape[2], phi_k.shape[2]
    if k_log_scale is not None:
        phi_k = phi_k * torch.exp(k_log_scale).unsqueeze(-1)

    def weights(t, stop):
        return (phi_q[:, :, t : t + 1] * phi_k[:, :, :stop]).sum(-1)

    return _rows(weights, Tq, Tk, causal, v, normalizer, eps=None)


def naive_kernel_attention(q, k, v, *, kernel, causal, scale=None, degree=2, normalizer="kernel", position=None):
    Tq, Tk, D = q.shape[2], k.shape[2], q.shape[-1]
    s = 1 / math.sqrt(D) if scale is None else scale

    def weights(t, stop):
        qt, ks = q[:, :, t : t + 1], k[:, :, :stop]
        if kernel == "exp":
            w = torch.exp(s * (qt * ks).sum(-1))
        elif kernel == "rbf":
            w = torch.exp(-s * ((qt - ks) ** 2).sum(-1) / 2)
        elif kernel == "poly":
            w = (s * (qt * ks).sum(-1)) ** degree
        else:
            w = s * (qt * ks).sum(-1)
        if position is not None:
            w = w * position[..., t, :stop]
        return w

    return _rows(weights, Tq, Tk, causal, v, normalizer, eps=None)


def naive_softmax_attention(q, k, v, *, causal, scale=None):
    return naive_kernel_attention(q, k, v, kernel="exp", causal=causal, scale=scale)


def taylor_kernel(q, k, order, scale=1.0):
    """Σ_{m ≤ order} (scale q·k)^m / m!  for all pairs (Nq, Nk)."""
    x = scale * q @ k.T
    return sum(x**m / math.factorial(m) for m in range(order + 1))


def exp_definition_kernel(q, k, n, scale=1.0):
    return (1 + scale * q @ k.T / n) ** n


def favor_features(x, omega, scale):
    """exp(ω·x' − ‖x'‖²/2)/√m element by element, x' = √scale x: (..., D), (m, D) -> (..., m)."""
    xs = x * math.sqrt(scale)
    sq = (xs**2).sum(-1, keepdim=True)
    cols = [torch.exp((xs * omega[j]).sum(-1, keepdim=True) - sq / 2) for j in range(omega.shape[0])]
    return torch.cat(cols, dim=-1) / math.sqrt(omega.shape[0])


def naive_favor_attention(q, k, v, omega, scale, *, causal):
    """Normalised FAVOR+ attention with the given ω, spelled out in float64 log domain, so that it holds at any
    scale of q and k: log κ_ts = log Σ_j exp(a_tj + b_sj) − log m with a = ω·q' − ‖q'‖²/2, b likewise,
    q' = √scale q; out_t = Σ_s softmax_s(log κ_ts) v_s over the allowed s."""
    q, k, v, omega = (x.double() for x in (q, k, v, omega))
    m = omega.shape[0]

    def logits(x):  # (B, H, T, m), one feature column at a time
        cols = [(x * math.sqrt(scale) * omega[j]).sum(-1) for j in range(m)]
        return torch.stack(cols, -1) - scale * (x**2).sum(-1, keepdim=True) / 2

    a, b = logits(q), logits(k)
    outs = []
    for t in range(q.shape[2]):
        stop = t + 1 if causal else k.shape[2]
        log_kappa = torch.logsumexp(a[:, :, t : t + 1] + b[:, :, :stop], dim=-1) - math.log(m)  # (B, H, stop)
        w = torch.softmax(log_kappa, dim=-1)
        outs.append((w.unsqueeze(-1) * v[:, :, :stop]).sum(2))
    return torch.stack(outs, dim=2)


def naive_sparsity(row):
    """E|a| / sqrt(E a²) of one 1-d row."""
    n = row.numel()
    return (row.abs().sum() / n) / torch.sqrt((row**2).sum() / n)
