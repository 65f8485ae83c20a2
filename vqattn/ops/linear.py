"""Linear (feature-map) attention: exp(q·k) replaced by a finite inner product φ(q)·φ(k).

With features φ: (B, H, T, D) -> (B, H, T, M) the attention weights are κ_ts = φ(q_t)·φ(k_s) and

    out_t = Σ_s κ_ts v_s / n_t = φ(q_t)ᵀ (Σ_s φ(k_s) v_sᵀ) / n_t,

so the T×T matrix is never formed: the key side collapses to an (M × Dv) matrix plus an (M) vector.
The causal form is the chunked ("chunk form" of flash-linear-attention) evaluation: inside a chunk of C
positions the masked C×C weights are used directly, across chunks an (M × Dv) prefix state carries the past.
Cost O(T·M·Dv + T·C·(M + Dv)); memory holds one (M × Dv) state per chunk, never one per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import check_4d, check_choice, check_positive_int, check_qkv, check_same_device_dtype, compute_dtype

NORMALIZERS = ("kernel", "count", "none")


@dataclass
class LinearState:
    """Running sums of a causal linear attention after ``length`` keys (all in the compute dtype).

    kv: (B, H, M, Dv) = Σ_s φ(k_s) v_sᵀ;  k_sum: (B, H, M) = Σ_s φ(k_s);  length: number of keys seen.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    length: int


def _normalize(num: torch.Tensor, den: torch.Tensor, count: torch.Tensor, normalizer: str, eps: float) -> torch.Tensor:
    """num: (..., T, Dv); den, count: (..., T). See ``linear_attention`` for the three normalisers."""
    if normalizer == "kernel":
        # clamp_min instead of den + eps: an exact row sum is kept unbiased, and a row whose weights are all
        # zero (relu features) gives 0 instead of 0/0.
        return num / den.clamp_min(eps).unsqueeze(-1)
    if normalizer == "count":
        return num / count.unsqueeze(-1)
    return num


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    eps: float = 1e-6,
    normalizer: str = "kernel",
    chunk_len: int | None = None,
    state: LinearState | None = None,
    return_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, LinearState]:
    """Attention with weights κ_ts = φ(q_t)·φ(k_s), in O(T·M·Dv).

    phi_q: (B, H, Tq, M), phi_k: (B, H, Tk, M), v: (B, H, Tk, Dv) -> (B, H, Tq, Dv) in v's dtype.

    Non-causal: out = φ(Q) (φ(K)ᵀ V) / n.  Causal: out_t sums over s ≤ t only, computed chunk by chunk
    (``chunk_len`` positions, default 64; T need not be a multiple of it).

    normalizer, the divisor n_t of row t:
      * ``"kernel"`` (default): n_t = max(Σ_s κ_ts, eps), the usual normalised attention. Valid when the
        kernel values are non-negative (performer, elu+1, relu, even-order taylor / exp-definition; see
        ``FeatureMap.nonnegative``). With signed kernels (identity) the row sum can be ≤ 0 and the clamp
        would flip signs, so use one of the other two.
      * ``"count"``: n_t = number of keys attended (a mean). Bounded for any kernel; the safe choice for
        identity features, whose "minimal linear attention" row is the raw scores q·k.
      * ``"none"``: n_t = 1.

    state / return_state (causal only): ``state`` holds the sums over all earlier keys (``LinearState``);
    with ``return_state=True`` the call returns ``(out, new_state)``. Feeding a sequence in pieces with the
    returned state gives the same outputs as a single call. Half precision is computed in float32; the
    state stays float32.
    """
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_4d(name, x)
    check_same_device_dtype(phi_q=phi_q, phi_k=phi_k)
    # features may be wider than v (feature maps give float32 features for half-precision inputs)
    out_dtype = v.dtype
    dt = torch.promote_types(compute_dtype(phi_k.dtype), compute_dtype(v.dtype))
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    check_qkv(phi_q, phi_k, v, causal=causal)
    check_choice("normalizer", normalizer, NORMALIZERS)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if chunk_len is not None:
        check_positive_int("chunk_len", chunk_len)
    if not causal and (state is not None or return_state):
        raise ValueError("state and return_state are only supported with causal=True")
    B, H, T, M = phi_k.shape
    Dv = v.shape[-1]

    if not causal:
        kv = torch.einsum("bhsm,bhsd->bhmd", phi_k, v)  # (B, H, M, Dv)
        num = torch.einsum("bhtm,bhmd->bhtd", phi_q, kv)  # (B, H, Tq, Dv)
        den = torch.einsum("bhtm,bhm->bht", phi_q, phi_k.sum(dim=2))  # (B, H, Tq)
        count = torch.full_like(den, T)
        return _normalize(num, den, count, normalizer, eps).to(out_dtype)

    if state is None:
        kv0 = phi_k.new_zeros(B, H, M, Dv)
        ksum0 = phi_k.new_zeros(B, H, M)
        length0 = 0
    else:
        _check_state(state, phi_k, v)
        kv0, ksum0, length0 = state.kv.to(dt), state.k_sum.to(dt), state.length

    C = min(chunk_len or 64, T)
    N = -(-T // C)
    pad = N * C - T
    # zero padding at the end: padded keys come after every real query, so causally they are never seen
    qc = F.pad(phi_q, (0, 0, 0, pad)).view(B, H, N, C, M)
    kc = F.pad(phi_k, (0, 0, 0, pad)).view(B, H, N, C, M)
    vc = F.pad(v, (0, 0, 0, pad)).view(B, H, N, C, Dv)

    # prefix states at the start of each chunk: one (M x Dv) matrix per chunk, never per position
    chunk_kv = torch.einsum("bhncm,bhncd->bhnmd", kc, vc)  # (B, H, N, M, Dv)
    chunk_ksum = kc.sum(dim=3)  # (B, H, N, M)
    prefix_kv = kv0.unsqueeze(2) + torch.cumsum(chunk_kv, dim=2) - chunk_kv  # exclusive scan
    prefix_ksum = ksum0.unsqueeze(2) + torch.cumsum(chunk_ksum, dim=2) - chunk_ksum

    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    intra = torch.einsum("bhncm,bhnsm->bhncs", qc, kc).masked_fill(~mask, 0.0)  # (B, H, N, C, C)
    num = torch.einsum("bhncs,bhnsd->bhncd", intra, vc) + torch.einsum("bhncm,bhnmd->bhncd", qc, prefix_kv)
    den = intra.sum(dim=-1) + torch.einsum("bhncm,bhnm->bhnc", qc, prefix_ksum)
    num, den = num.reshape(B, H, N * C, Dv)[:, :, :T], den.reshape(B, H, N * C)[:, :, :T]
    count = torch.arange(length0 + 1, length0 + T + 1, device=v.device, dtype=dt).expand(B, H, T)
    out = _normalize(num, den, count, normalizer, eps).to(out_dtype)
    if not return_state:
        return out
    new_state = LinearState(
        kv=prefix_kv[:, :, -1] + chunk_kv[:, :, -1], k_sum=prefix_ksum[:, :, -1] + chunk_ksum[:, :, -1], length=length0 + T
    )
    return out, new_state


def _check_state(state: LinearState, phi_k: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(state, LinearState):
        raise ValueError(f"state must be a LinearState or None, got {type(state).__name__}")
    B, H, _, M = phi_k.shape
    want_kv, want_ksum = (B, H, M, v.shape[-1]), (B, H, M)
    if tuple(state.kv.shape) != want_kv or tuple(state.k_sum.shape) != want_ksum:
        raise ValueError(
            f"state does not match the inputs: expected kv {want_kv} and k_sum {want_ksum}, "
            f"got kv {tuple(state.kv.shape)} and k_sum {tuple(state.k_sum.shape)}"
        )
    if state.kv.device != v.device:
        raise ValueError(f"state is on {state.kv.device} but the inputs are on {v.device}")


__all__ = ["LinearState", "linear_attention", "NORMALIZERS"]
