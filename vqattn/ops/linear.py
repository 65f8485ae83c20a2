"""Linear (feature-map) attention: exp(q·k) replaced by a finite inner product φ(q)·φ(k).

With features φ: (B, H, T, D) -> (B, H, T, M) the attention weights are κ_ts = φ(q_t)·φ(k_s) and

    out_t = Σ_s κ_ts v_s / n_t = φ(q_t)ᵀ (Σ_s φ(k_s) v_sᵀ) / n_t,

so the T×T matrix is never formed: the key side collapses to an (M × Dv) matrix plus an (M) vector.
The causal chunk impl is the chunked (flash-linear-attention's "chunk" mode) evaluation: inside a chunk of C
positions the masked C×C weights are used directly, across chunks an (M × Dv) prefix state carries the past.
Cost O(T·M·Dv + T·C·(M + Dv)); memory holds one (M × Dv) state per chunk, never one per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .blocks import check_block_len, resolve_block_len
from .common.segments import BlockLayout, segment_sums
from .utils import IMPLS as OP_IMPLS
from .utils import (
    autocast_off,
    check_4d,
    check_choice,
    check_qkv,
    check_same_device_dtype,
    compute_dtype,
    pick_impl,
    with_impl,
)
from .varlen import Segments, varlen

NORMALIZERS = ("kernel", "count", "none")
IMPLS = tuple(impl for impl in OP_IMPLS if impl != "triton")  # no fused kernel


@dataclass
class LinearState:
    """Running sums of a causal linear attention after ``length`` keys (all in the compute dtype).

    kv: (B, H, M, Dv) = Σ_s φ(k_s) v_sᵀ / e^r;  k_sum: (B, H, M) = Σ_s φ(k_s) / e^r;  length: keys seen;
    log_scale: (B, H) the reference r of the sums (None = 0), set when keys came with ``k_log_scale``.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    length: int
    log_scale: torch.Tensor | None = None


def _normalize(
    num: torch.Tensor, den: torch.Tensor, count: torch.Tensor, normalizer: str, eps: float | None
) -> torch.Tensor:
    """num: (..., T, Dv); den, count: (..., T). See ``linear_attention`` for the three normalisers."""
    if normalizer == "kernel":
        if eps is None:
            # the row sum itself, at any scale; a row of zero weights (relu) has num = 0 and gives 0. Dividing
            # it by 1, not by a tiny clamp, keeps its gradient finite (1/tiny overflows to inf, then 0·inf = NaN).
            return num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)
        # clamp_min instead of den + eps: an exact row sum is kept unbiased
        return num / den.clamp_min(eps).unsqueeze(-1)
    if normalizer == "count":
        return num / count.unsqueeze(-1)
    return num


def _check_eps(eps: float | None) -> None:
    """Raise unless ``eps``, the normalisers' row-sum floor, is None or > 0 (``kernel_attention`` checks it too)."""
    if eps is not None and not eps > 0:
        raise ValueError(f"eps must be > 0 or None, got {eps!r}")


@autocast_off
def _segmented(a: dict, segments: Segments) -> torch.Tensor:
    """A packed causal call given :class:`~vqattn.ops.varlen.Segments`: the sequences in their block layout
    (:mod:`vqattn.ops.common.segments`), the chunks' prefix states summed within each sequence."""
    phi_q, phi_k, v, ls, out_dtype = _checked_inputs(
        a["phi_q"], a["phi_k"], a["v"], a["k_log_scale"], causal=True, eps=a["eps"], normalizer=a["normalizer"],
        block_len=a["block_len"], state=None, return_state=False, impl=a["impl"])
    layout = segments.layout(resolve_block_len(a["block_len"]))
    phi_q, phi_k, v = (layout.gather(x) for x in (phi_q, phi_k, v))
    if ls is not None:  # a pad's features weigh nothing
        ls = layout.gather(ls).masked_fill(layout.pads, float("-inf"))
    out = _segmented_causal(phi_q, phi_k, v, ls, layout, a["normalizer"], a["eps"])
    return layout.scatter_back(out).to(out_dtype)


def _segmented_causal(phi_q, phi_k, v, ls, layout: BlockLayout, normalizer, eps):
    """:func:`_causal` over the sequences of a block layout, chunk = block: each block's prefix state holds the
    earlier blocks of its own sequence (without log scales by :func:`~vqattn.ops.common.segments.segment_sums`,
    with them by the (N × N) weights of :func:`_scaled_prefix`, masked to the sequence), and every reference is the
    running max of the query's own sequence."""
    B, H, T, M = phi_k.shape
    C, Dv = layout.block_len, v.shape[-1]
    N = T // C
    qc, kc, vc = phi_q.view(B, H, N, C, M), phi_k.view(B, H, N, C, M), v.view(B, H, N, C, Dv)
    first = layout.first_blocks()
    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    intra = qc @ kc.transpose(-1, -2)  # (B, H, N, C, C)
    if ls is None:
        intra = intra.masked_fill(~mask, 0.0)
        prefix_kv = segment_sums(kc.transpose(-1, -2) @ vc, first, 1)  # (B, H, N, M, Dv)
        prefix_ksum = segment_sums(kc.sum(3), first, 1)
        inter_num, inter_den = qc @ prefix_kv, (qc @ prefix_ksum.unsqueeze(-1)).squeeze(-1)
    else:
        lsc = ls.view(B, H, N, C)
        chunk_scale = lsc.detach().amax(-1)  # (B, H, N), finite: every block holds a real key
        b = torch.arange(N, device=v.device)
        earlier = (b[None, :] < b[:, None]) & (b[None, :] >= first[:, None])  # (N, N): block j is before b in b's seq
        # references (detached, they cancel): the running max over the earlier blocks (−inf at a first block)
        # and per query over its sequence so far
        rel = chunk_scale.unsqueeze(-2).masked_fill(~earlier, float("-inf")).amax(-1)  # (B, H, N)
        ref = torch.maximum(lsc.detach().cummax(-1).values, rel.unsqueeze(-1))  # (B, H, N, C)
        intra = intra * torch.exp((lsc.unsqueeze(-2) - ref.unsqueeze(-1)).masked_fill(~mask, float("-inf")))
        kc = kc * torch.exp(lsc - chunk_scale.unsqueeze(-1)).unsqueeze(-1)
        w = torch.exp((chunk_scale.unsqueeze(-2) - rel.unsqueeze(-1)).masked_fill(~earlier, float("-inf")))
        prefix_kv = torch.einsum("bhnk,bhkmd->bhnmd", w, kc.transpose(-1, -2) @ vc)
        prefix_ksum = torch.einsum("bhnk,bhkm->bhnm", w, kc.sum(3))
        to_query = torch.exp(rel.unsqueeze(-1) - ref)  # ≤ 1; 0 at a sequence's first block
        inter_num = (qc @ prefix_kv) * to_query.unsqueeze(-1)
        inter_den = (qc @ prefix_ksum.unsqueeze(-1)).squeeze(-1) * to_query
    num = (intra @ vc + inter_num).reshape(B, H, T, Dv)
    den = (intra.sum(-1) + inter_den).reshape(B, H, T)
    if ls is not None and normalizer != "kernel":  # back to the true scale (the kernel normaliser cancels it)
        num = num * torch.exp(ref.reshape(B, H, T)).unsqueeze(-1)
    count = (torch.arange(T, device=v.device) - layout.starts + 1).to(v.dtype).expand(B, H, T)
    return _normalize(num, den, count, normalizer, eps)


@varlen(("phi_q", "phi_k", "v", "k_log_scale"), segmented=_segmented)
@autocast_off
def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    k_log_scale: torch.Tensor | None = None,
    eps: float | None = None,
    normalizer: str = "kernel",
    block_len: int | None = None,
    state: LinearState | None = None,
    return_state: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, LinearState]:
    """Attention with weights κ_ts = φ(q_t)·φ(k_s), in O(T·M·Dv).

    phi_q: (B, H, Tq, M), phi_k: (B, H, Tk, M), v: (B, H, Tk, Dv) -> (B, H, Tq, Dv) in v's dtype.

    Non-causal: out = φ(Q) (φ(K)ᵀ V) / n.  Causal: out_t sums over s ≤ t only, computed chunk by chunk
    (``block_len`` positions, default 64; T need not be a multiple of it).

    k_log_scale: optional (B, H, Tk): the true key features are ``phi_k · exp(k_log_scale)``. Feature maps
    whose features span more than float32's range (Performer at large ‖k‖) pass keys divided by their own
    max this way (``FeatureMap.map_qk``). Query t then works relative to r_t = max_{s≤t} k_log_scale_s
    (causal: a running max, so no future key enters; chunk prefix states are rescaled between chunks), and
    every factor exp(log scale − r) is ≤ 1: nothing overflows, and a key underflows only when its weight is
    below 1e-38 of the largest visible one.

    normalizer, the divisor n_t of row t:
      * ``"kernel"`` (default): n_t = Σ_s κ_ts, the usual normalised attention, invariant to the scale of the
        features; a row whose weights are all 0 (relu features) gives 0. With ``eps`` given, n_t =
        max(Σ_s κ_ts, eps) instead (an absolute floor, which rescales rows of small weights). Valid when the
        kernel values are non-negative (performer, elu+1, relu, even-order taylor / exp-definition; see
        ``FeatureMap.nonnegative``). With signed kernels (identity) the row sum can be ≤ 0 and the division
        would flip signs, so use one of the other two.
      * ``"count"``: n_t = number of keys attended (a mean). Bounded for any kernel; the safe choice for
        identity features, whose "minimal linear attention" row is the raw scores q·k.
      * ``"none"``: n_t = 1.

    state / return_state (causal only): ``state`` holds the sums over all earlier keys (``LinearState``);
    with ``return_state=True`` the call returns ``(out, new_state)``. Feeding a sequence in pieces with the
    returned state gives the same outputs as a single call. Half precision is computed in float32; the
    state stays float32. Under ``torch.autocast`` the op still computes in float32 (autocast is disabled
    inside) and returns v's dtype.

    impl: "chunk" (the chunked evaluation above; non-causal: the two products), "recurrent" (causal, token by token
    from ``state``: decoding), "naive" (:func:`naive_linear_attention`, the (Tq, Tk) weights spelled out: for
    checking, no state), or "auto": recurrent for a ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens,
    chunk otherwise (:func:`~vqattn.ops.utils.pick_impl`). All give the same result to rounding.
    """
    phi_q, phi_k, v, k_log_scale, out_dtype = _checked_inputs(
        phi_q, phi_k, v, k_log_scale, causal=causal, eps=eps, normalizer=normalizer, block_len=block_len,
        state=state, return_state=return_state, impl=impl,
    )
    impl = pick_impl(impl, phi_q, state=state, fused_unsupported=None)
    if impl == "naive":
        out = naive_linear_attention(phi_q, phi_k, v, causal=causal, k_log_scale=k_log_scale, eps=eps,
                                     normalizer=normalizer)
        return out.to(out_dtype)
    if not causal:
        out = _noncausal(phi_q, phi_k, v, k_log_scale, normalizer, eps)
        return out.to(out_dtype)
    if impl == "recurrent":
        out, new_state = _recurrent(phi_q, phi_k, v, k_log_scale, state, normalizer, eps)
    else:
        out, new_state = _causal(phi_q, phi_k, v, k_log_scale, state, resolve_block_len(block_len), normalizer,
                                 eps)
    return (out.to(out_dtype), new_state) if return_state else out.to(out_dtype)


def naive_linear_attention(phi_q, phi_k, v, *, causal: bool, k_log_scale=None, eps=None, normalizer="kernel",
                           block_len: int | None = None):
    """The definition: the weights κ_ts = φ(q_t)·φ(k_s)·e^{k_log_scale_s} (Tq, Tk) spelled out, masked to s ≤ t
    when causal, out_t = Σ_s κ_ts v_s / n_t (``normalizer`` as :func:`linear_attention`). The log scales enter
    relative to their max (detached), which the kernel normaliser cancels and the others multiply back.
    ``block_len`` is the chunk impl's and never changes the result: taken so that every impl has the op's
    arguments.
    phi_q: (B, H, Tq, M), phi_k: (B, H, Tk, M), v: (B, H, Tk, Dv) -> (B, H, Tq, Dv)."""
    Tq, Tk = phi_q.shape[2], phi_k.shape[2]
    weights = phi_q @ phi_k.transpose(-1, -2)  # (B, H, Tq, Tk)
    ref = None
    if k_log_scale is not None:
        ref = k_log_scale.detach().amax(-1, keepdim=True)  # (B, H, 1)
        weights = weights * torch.exp(k_log_scale - ref).unsqueeze(-2)
    count = torch.full((Tq,), Tk, dtype=v.dtype, device=v.device)
    if causal:
        weights = weights.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=v.device).tril().logical_not(), 0)
        count = torch.arange(1, Tq + 1, dtype=v.dtype, device=v.device)
    num = weights @ v
    if ref is not None and normalizer != "kernel":
        num = num * torch.exp(ref).unsqueeze(-1)
    return _normalize(num, weights.sum(-1), count.expand(weights.shape[:-1]), normalizer, eps)


def _recurrent(phi_q, phi_k, v, ls, state, normalizer, eps):
    """Token by token from ``state`` (the recurrence the chunk impl evaluates a block at a time): with the sums'
    reference r ← max(r, ls_t), kv ← e^{r_old − r} kv + e^{ls_t − r} φ(k_t) v_tᵀ, k_sum likewise, and query t reads
    φ(q_t)·kv / n_t. Returns (out (B, H, T, Dv), the LinearState after the last token)."""
    B, H, T, M = phi_k.shape
    kv = phi_k.new_zeros(B, H, M, v.shape[-1]) if state is None else state.kv.to(v.dtype)
    k_sum = phi_k.new_zeros(B, H, M) if state is None else state.k_sum.to(v.dtype)
    length = 0 if state is None else state.length
    ref = None if state is None or state.log_scale is None else state.log_scale.to(v.dtype)
    if ls is not None and ref is None:  # the first key's scale (a state without one has the reference 0)
        ref = ls[:, :, 0].detach() if state is None else ls.new_zeros(B, H)
    if ref is not None and ls is None:  # a scaled state continued by unscaled keys: their log scale is 0
        ls = phi_k.new_zeros(B, H, T)
    outs = []
    for t in range(T):
        key = phi_k[:, :, t]  # (B, H, M)
        if ls is not None:
            new_ref = torch.maximum(ref, ls[:, :, t].detach())
            decay, key = torch.exp(ref - new_ref), key * torch.exp(ls[:, :, t] - new_ref).unsqueeze(-1)
            kv, k_sum, ref = kv * decay[..., None, None], k_sum * decay.unsqueeze(-1), new_ref
        kv = kv + key.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        k_sum = k_sum + key
        query = phi_q[:, :, t : t + 1]  # (B, H, 1, M)
        num, den = query @ kv, (query @ k_sum.unsqueeze(-1)).squeeze(-1)  # (B, H, 1, Dv), (B, H, 1)
        if ref is not None and normalizer != "kernel":
            num = num * torch.exp(ref)[..., None, None]
        outs.append(_normalize(num, den, den.new_full(den.shape, length + t + 1), normalizer, eps))
    return torch.cat(outs, 2), LinearState(kv=kv, k_sum=k_sum, length=length + T, log_scale=ref)


def _checked_inputs(phi_q, phi_k, v, k_log_scale, *, causal, eps, normalizer, block_len, state, return_state,
                    impl):
    """Check ``linear_attention``'s arguments; give phi_q, phi_k, v, k_log_scale in the compute dtype, and v's dtype."""
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        check_4d(name, x)
    check_same_device_dtype(phi_q=phi_q, phi_k=phi_k)
    # features may be wider than v (feature maps give float32 features for half-precision inputs)
    out_dtype = v.dtype
    dt = torch.promote_types(compute_dtype(phi_k.dtype), compute_dtype(v.dtype))
    phi_q, phi_k, v = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    check_qkv(phi_q, phi_k, v, causal=causal)
    check_choice("normalizer", normalizer, NORMALIZERS)
    _check_eps(eps)
    check_block_len(block_len)
    check_choice("impl", impl, IMPLS)
    if not causal and (state is not None or return_state or impl == "recurrent"):
        raise ValueError("state, return_state and impl='recurrent' are only supported with causal=True")
    if impl == "naive" and (state is not None or return_state):
        raise ValueError("impl='naive' takes no state and returns none; use impl='chunk' or 'recurrent'")
    if k_log_scale is not None:
        k_log_scale = _check_log_scale(k_log_scale, phi_k).to(dt)
    if state is not None:
        _check_state(state, phi_k, v)
    return phi_q, phi_k, v, k_log_scale, out_dtype


def _noncausal(phi_q, phi_k, v, ls, normalizer, eps):
    T = phi_k.shape[2]
    ref = None
    if ls is not None:  # one reference for all keys: the largest log scale (detached: it cancels exactly)
        ref = ls.amax(-1, keepdim=True).detach()  # (B, H, 1)
        phi_k = phi_k * torch.exp(ls - ref).unsqueeze(-1)
    kv = torch.einsum("bhsm,bhsd->bhmd", phi_k, v)  # (B, H, M, Dv)
    num = torch.einsum("bhtm,bhmd->bhtd", phi_q, kv)  # (B, H, Tq, Dv)
    den = torch.einsum("bhtm,bhm->bht", phi_q, phi_k.sum(dim=2))  # (B, H, Tq)
    if ref is not None and normalizer != "kernel":  # back to the true scale (the kernel normaliser cancels it)
        num = num * torch.exp(ref).unsqueeze(-1)
    return _normalize(num, den, torch.full_like(den, T), normalizer, eps)


def _causal(phi_q, phi_k, v, ls, state, C, normalizer, eps):
    """The causal chunk impl; see ``linear_attention``. Returns (out in the compute dtype, new LinearState)."""
    B, H, T, M = phi_k.shape
    Dv, dt = v.shape[-1], v.dtype
    scaled = ls is not None or (state is not None and state.log_scale is not None)
    if scaled and ls is None:
        ls = phi_k.new_zeros(B, H, T)
    kv0 = phi_k.new_zeros(B, H, M, Dv) if state is None else state.kv.to(dt)
    ksum0 = phi_k.new_zeros(B, H, M) if state is None else state.k_sum.to(dt)
    length0 = 0 if state is None else state.length
    C = min(C, T)
    N = -(-T // C)
    pad = N * C - T
    # zero padding at the end: padded keys come after every real query, so causally they are never seen
    qc = F.pad(phi_q, (0, 0, 0, pad)).view(B, H, N, C, M)
    kc = F.pad(phi_k, (0, 0, 0, pad)).view(B, H, N, C, M)
    vc = F.pad(v, (0, 0, 0, pad)).view(B, H, N, C, Dv)
    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    intra = torch.einsum("bhncm,bhnsm->bhncs", qc, kc)  # (B, H, N, C, C)
    if scaled:
        r0 = _initial_reference(state, ls, phi_k)
        rel, chunk_scale, pos_ref = _chunk_references(ls.detach(), r0, N, C, pad)
        ref = pos_ref.view(B, H, N, C)
        lsc = F.pad(ls, (0, pad), value=float("-inf")).view(B, H, N, C)
        # key s seen from query t: exp(ls_s − r_t) ≤ 1 for s ≤ t; masked before exp so s > t cannot overflow
        intra = intra * torch.exp((lsc.unsqueeze(-2) - ref.unsqueeze(-1)).masked_fill(~mask, float("-inf")))
        kc = kc * torch.exp(lsc - chunk_scale.unsqueeze(-1)).unsqueeze(-1)  # chunk sums relative to chunk max
        to_query = torch.exp(rel - ref)  # prefix reference -> query reference, ≤ 1
    else:
        intra = intra.masked_fill(~mask, 0.0)
    chunk_kv = torch.einsum("bhncm,bhncd->bhnmd", kc, vc)  # (B, H, N, M, Dv)
    chunk_ksum = kc.sum(dim=3)  # (B, H, N, M)
    if scaled:
        prefix_kv, prefix_ksum, last = _scaled_prefix(chunk_kv, chunk_ksum, kv0, ksum0, chunk_scale, rel[..., 0], r0)
    else:
        # prefix states at the start of each chunk: one (M x Dv) matrix per chunk, never per position
        prefix_kv = kv0.unsqueeze(2) + torch.cumsum(chunk_kv, dim=2) - chunk_kv  # exclusive scan
        prefix_ksum = ksum0.unsqueeze(2) + torch.cumsum(chunk_ksum, dim=2) - chunk_ksum
    inter_num = torch.einsum("bhncm,bhnmd->bhncd", qc, prefix_kv)
    inter_den = torch.einsum("bhncm,bhnm->bhnc", qc, prefix_ksum)
    if scaled:
        inter_num, inter_den = inter_num * to_query.unsqueeze(-1), inter_den * to_query
    num = torch.einsum("bhncs,bhnsd->bhncd", intra, vc) + inter_num
    den = intra.sum(dim=-1) + inter_den
    num, den = num.reshape(B, H, N * C, Dv)[:, :, :T], den.reshape(B, H, N * C)[:, :, :T]
    if scaled and normalizer != "kernel":  # back to the true scale (the kernel normaliser cancels it)
        num = num * torch.exp(pos_ref[:, :, :T]).unsqueeze(-1)
    count = torch.arange(length0 + 1, length0 + T + 1, device=v.device, dtype=dt).expand(B, H, T)
    out = _normalize(num, den, count, normalizer, eps)
    if scaled:
        kv, ksum, log_scale = last
    else:
        kv, ksum = prefix_kv[:, :, -1] + chunk_kv[:, :, -1], prefix_ksum[:, :, -1] + chunk_ksum[:, :, -1]
        log_scale = None
    return out, LinearState(kv=kv, k_sum=ksum, length=length0 + T, log_scale=log_scale)


def _initial_reference(state, ls, phi_k):
    """(B, H) reference of the incoming state's sums; without a state, the first key's log scale."""
    if state is None:
        return ls[:, :, 0].detach()
    if state.log_scale is None:
        return phi_k.new_zeros(phi_k.shape[:2])
    return state.log_scale.to(phi_k.dtype)


def _chunk_references(ls, r0, N, C, pad):
    """References (all detached, they cancel exactly): per chunk the exclusive running max ``rel`` (B, H, N, 1)
    of the state and earlier chunks, the chunk's own max (B, H, N), and per position the inclusive running
    max (B, H, N·C), where padded positions repeat the last real one."""
    B, H, T = ls.shape
    ls = F.pad(ls, (0, pad), value=float("-inf"))
    pos_ref = torch.cummax(torch.maximum(ls, r0.unsqueeze(-1)), dim=-1).values  # (B, H, N·C)
    chunk_scale = ls.view(B, H, N, C).amax(-1)  # (B, H, N), finite: every chunk holds a real key
    before = pos_ref.view(B, H, N, C)[..., -1]  # running max at each chunk's end
    rel = torch.cat([r0.unsqueeze(-1), before[..., :-1]], dim=-1).unsqueeze(-1)
    return rel, chunk_scale, pos_ref


def _scaled_prefix(chunk_kv, chunk_ksum, kv0, ksum0, chunk_scale, rel, r0):
    """Prefix sums at each chunk start relative to ``rel`` (B, H, N), and the final state.

    prefix_n = e^(r0 − rel_n) state + Σ_{n' < n} e^(c_n' − rel_n) chunk_n': every factor ≤ 1. Written as an
    (N × N) lower-triangular weight matrix, O(N²·M·Dv) — small next to O(T·M·Dv) while N ≤ C.
    """
    N = chunk_kv.shape[2]
    strict = torch.ones(N, N, dtype=torch.bool, device=chunk_kv.device).tril(-1)
    w = torch.exp((chunk_scale.unsqueeze(-2) - rel.unsqueeze(-1)).masked_fill(~strict, float("-inf")))  # (B,H,N,N)
    w0 = torch.exp(r0.unsqueeze(-1) - rel)  # (B, H, N)
    prefix_kv = torch.einsum("bhnk,bhkmd->bhnmd", w, chunk_kv) + w0[..., None, None] * kv0.unsqueeze(2)
    prefix_ksum = torch.einsum("bhnk,bhkm->bhnm", w, chunk_ksum) + w0.unsqueeze(-1) * ksum0.unsqueeze(2)
    end = torch.maximum(rel[..., -1], chunk_scale[..., -1])  # running max after the last chunk
    a, b = torch.exp(rel[..., -1] - end), torch.exp(chunk_scale[..., -1] - end)
    kv = a[..., None, None] * prefix_kv[:, :, -1] + b[..., None, None] * chunk_kv[:, :, -1]
    ksum = a.unsqueeze(-1) * prefix_ksum[:, :, -1] + b.unsqueeze(-1) * chunk_ksum[:, :, -1]
    return prefix_kv, prefix_ksum, (kv, ksum, end)


def _check_log_scale(ls, phi_k: torch.Tensor) -> torch.Tensor:
    if not isinstance(ls, torch.Tensor) or not ls.is_floating_point():
        raise ValueError(f"k_log_scale must be a floating-point tensor of shape (B, H, Tk), got {ls!r:.60}")
    if tuple(ls.shape) != tuple(phi_k.shape[:3]):
        raise ValueError(f"k_log_scale must have shape (B, H, Tk) = {tuple(phi_k.shape[:3])}, got {tuple(ls.shape)}")
    if ls.device != phi_k.device:
        raise ValueError(f"k_log_scale is on {ls.device} but phi_k is on {phi_k.device}")
    return ls


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
    if state.log_scale is not None and tuple(state.log_scale.shape) != (B, H):
        raise ValueError(f"state.log_scale must have shape (B, H) = {(B, H)}, got {tuple(state.log_scale.shape)}")


chunk_linear_attention = with_impl(linear_attention, "chunk")
recurrent_linear_attention = with_impl(linear_attention, "recurrent")

__all__ = ["LinearState", "linear_attention", "chunk_linear_attention", "recurrent_linear_attention",
           "naive_linear_attention", "NORMALIZERS", "IMPLS"]
