"""Codebook attention: Transformer-VQ (hard), its Gaussian-mixture generalisation (soft) and the
unnormalised Gaussian-kernel assignment that turns it into Performer (kernel).

Notation (per batch and head): queries q_i, keys k_j, values v_j, codebook c_s (S codes), scale σ.
An assignment matrix Δ (T, S) spreads every key over the codes:

    hard    Δ_js = 1[s = argmin_s' ‖k_j − c_s'‖]                       (one-hot, straight-through)
    soft    Δ_js = softmax_s(−‖k_j − c_s‖² / 2τ)                        (GMM posterior p(s | k_j))
    kernel  Δ_js = exp(−‖k_j − c_s‖² / 2τ + ‖c_s‖² / 2τ)                (unnormalised, = FAVOR+ for c = ω/√σ, τ = 1/σ)

and attention reads the keys through the codes:

    out_i = Σ_s e^{σ q_i·c_s} Σ_j Δ_js v_j  /  Σ_s e^{σ q_i·c_s} Σ_j Δ_js          (j ≤ i when causal)

For hard Δ this is exactly softmax attention over the quantised keys k̂_j = c_{z_j}, and equals softmax
attention when the keys lie on the codebook.

Causal attention runs in blocks of ``block_len`` L (the Transformer-VQ algorithm). Block b attends to

* an uncompressed window: blocks b−1 and b, with one logit per key (causally masked), and
* a compressed cache: per-code counts n_s = Σ_j Δ_js and value sums Σ_j Δ_js v_j of blocks ≤ b−2,
  entering as S extra "keys" with logit σ q_i·c_s + log n_s and value (Σ_j Δ_js v_j) / n_s.

Both groups share one softmax (one max), so nothing overflows and empty codes (log 0 = −inf) drop out.
Cost O(T·(L + S)·D); memory O(T·(L + S) + S·D) on CPU, where the blocks read one running value-sum cache, and
O(T·(L + S) + (T/L)·S·D) on GPUs and under torch.compile, which form every block's cache at once; no T×T tensor.
The code logits σ q·cᵀ are computed once and serve both the cache and the soft/kernel window mixtures.

Window logits: hard uses σ q_i·k̂_j with the straight-through k̂_j = c_{z_j} + (k_j − sg(k_j)), so keys get the
gradient k̂ would get; ``exact_window`` uses the raw keys σ q_i·k_j; soft/kernel use the exact mixture
log Σ_s e^{σ q_i·c_s} Δ_js. In the cache (and in non-causal mode, which is all cache) hard keys get no gradient,
as in Transformer-VQ: their contribution is a count.

Soft attention runs in linear form (:class:`~vqattn.ops.vq_blocks.MixtureAttention`): with P_is = e^{σ q_i·c_s − m_i},
the window weights (P Δᵀ)_ij and the cache weights P_is n_s share one exp and need no log. Kernel keys carry per-key
scales whose spread exceeds the float range, so their window stays in logs (the mixture logits above).

Kernel weights are kept per key as Δ_js = w_js e^{r_j} with max_s w_js = 1, so no key underflows; the window
mixture adds r_j exactly, and the statistics are stored in units of e^G, G the largest r_j seen so far.

Decoding (a ``state`` and at most :data:`RECURRENT_MAX_LEN` new tokens) runs the recurrent form in
:mod:`vqattn.ops.vq_recurrent`: O((2L + S)·D) per token. Everything else runs the block algorithm.
"""

from __future__ import annotations

import dataclasses

import torch

from ._checks import check_4d, check_choice, check_positive_int, check_qkv, check_same_device_dtype, compute_dtype, \
    size_max, size_min
from .nonfinite import nonfinite_keys, visible_poison, zero_assignment_rows, zero_rows
from .vq_assign import (
    ASSIGNMENTS,
    Assignment,
    cat_time,
    check_assignment,
    code_bias,
    code_means,
    code_counts,
    code_statistics,
    count_scale,
    map_time,
    mixture_logits,
    unit_weights,
    vq_assign,
)
from .vq_blocks import (
    DEFAULT_BLOCK_LEN,
    CacheUpdates,
    block_bias,
    block_groups,
    blocks,
    group_windows,
    mixture_attention,
    no_autocast,
    pad_to_blocks,
    previous_blocks,
    split_groups,
    window_bias,
    window_code_attention,
)
from .vq_recurrent import RECURRENT_MAX_LEN, VQState, vq_recurrent, window_start

__all__ = ["vq_attention", "vq_assign", "Assignment", "VQState", "window_start", "DEFAULT_BLOCK_LEN",
           "RECURRENT_MAX_LEN"]

def _causal(q, k, v, c, a: Assignment | None, *, L, scale, exact_window, detach_cache, counts0, sums0, G, assign,
            assign_keys, fold_blocks=0):
    """Block algorithm, run group by group (:func:`block_groups`), each group starting from the cache the previous
    one leaves. q, k: (B, H, T, D), c: (H, S, D); ``a`` the keys' Assignment, or None to assign each group's keys
    with ``assign_keys`` (so no (T, S) tensor exists at once); counts0/sums0: the cache before position 0 in units
    of e^G. Returns out (B, H, T, Dv) and the cache after the first ``fold_blocks`` blocks (for a state)."""
    B, H, T, D = q.shape
    S = c.shape[1]
    # Padding sits after every real query, so the causal mask hides it; its block statistics are never read
    # because block b's cache only holds blocks ≤ b−1. Padded kernel keys get scale e^{−inf} = 0.
    q, k, v = (pad_to_blocks(x, L) for x in (q, k, v))
    if a is not None:
        a = Assignment(pad_to_blocks(a.weights, L), pad_to_blocks(a.index, L),
                       pad_to_blocks(a.log_scale, L, float("-inf")) if isinstance(a.log_scale, torch.Tensor) else 0.0)
    nb = q.shape[2] // L
    # A soft/kernel window logit is the cache's own formula, so the previous block can be read through the
    # cache (lag 1) and the mixture only runs over the current block: half the (L, S) × (S, ·) products.
    # Not with detach_cache, where the previous block must keep its gradient.
    lag = 2 if assign == "hard" or exact_window or detach_cache else 1
    groups = block_groups(nb, B * H * L * (S + 2 * L) * q.element_size(), q.device)
    splits = [split_groups(x, groups, L) for x in (q, k, v)]
    if a is not None:
        a_splits = [split_groups(x, groups, L) if isinstance(x, torch.Tensor) else [(x, x)] * len(groups) for x in a]
    # The counts of block b's cache are ``run`` plus the counts of the blocks between; ``tail`` holds those of the
    # last ``lag`` blocks, which enter the caches of the next group. ``sums`` is the value-sum cache of the next
    # group's first block.
    run, tail, sums = counts0, q.new_zeros(B, H, lag, S), sums0
    outs, fold_counts, fold_sums = [], counts0, sums0
    for i, (b0, b1) in enumerate(groups):
        (q_g, _), (k_g, k_before), (v_g, v_before) = (split[i] for split in splits)
        a_g, a_before = (None, None) if a is None else \
            (Assignment(*parts) for parts in zip(*(split[i] for split in a_splits)))
        out, run, tail, sums, fold = _group(
            # q is scaled per group (cheaper than scaling the logits, and no full-size temporary)
            q_g * scale, k_g, k_before, v_g, v_before, a_g, a_before, run, tail, sums, c=c, G=G, L=L, lag=lag,
            first=b0 == 0, exact_window=exact_window, detach_cache=detach_cache, assign_keys=assign_keys,
            fold=size_min(size_max(fold_blocks - b0, 0), b1 - b0))
        outs.append(out)
        if fold is not None:
            fold_counts, fold_sums = fold_counts + fold[0], fold_sums + fold[1]
    return torch.cat(outs, 2)[:, :, :T], fold_counts, fold_sums


def _group(q, k, k_before, v, v_before, a, a_before, run, tail, sums, *, c, G, L, lag, first, exact_window,
           detach_cache, assign_keys, fold):
    """One group of n blocks: q, k, v (B, H, n·L, ·) (q scaled), the block before the group k_before, v_before
    (B, H, L, ·) (zeros before block 0, masked); their assignments ``a``, ``a_before`` (None: ``assign_keys`` them).
    ``run`` are the counts of the group's first block's cache without the counts ``tail`` of the ``lag`` blocks
    before the group, ``sums`` (B, H, S, Dv) that cache's value sums. Returns out (B, H, n·L, Dv), the next
    group's run, tail and sums, and the statistics summed over the first ``fold`` blocks (None for 0)."""
    n, S = q.shape[2] // L, c.shape[1]
    if a is None:
        a = assign_keys(k)
        a_before = assign_keys(k_before) if lag == 2 else None
    detach = (lambda x: x.detach()) if detach_cache else (lambda x: x)  # noqa: E731
    folded = None
    if fold:
        folded = tuple(detach(x.squeeze(2)) for x in code_statistics(
            _split_time(a, [fold * L, (n - fold) * L])[0], v[:, :, : fold * L], S, 1, G))

    def cache_updates(v, v_before):
        """After block b, the sums cache takes in the block that leaves b's window: b−1 (lag 2) or b (lag 1)."""
        def leaving(x, x_before):
            return previous_blocks(x, x_before, L) if lag == 2 else blocks(x, L)

        if a.index is not None:
            return CacheUpdates(detach(leaving(v, v_before)), leaving(a.index, a_before.index), None)
        weights_before = None if a_before is None else unit_weights(a_before, G)
        return CacheUpdates(detach(leaving(v, v_before)), None, detach(leaving(unit_weights(a, G), weights_before)))

    # The kernels form the one q·cᵀ product (B, H, n, L, S) and take its gradient block by block; only kernel
    # assignments, whose window mixture needs the code logits too, get them.
    qb = blocks(q, L)
    # (n, L, 2L) causal mask; after the first block every block's mask is the same (1, L, 2L)
    bias = window_bias(n, L, q.device, q.dtype) if first else window_bias(2, L, q.device, q.dtype)[1:]
    if not exact_window and a.index is None and not isinstance(a.log_scale, torch.Tensor):
        # Soft: the linear form, one exp of the code logits for window and cache. The values get a column of ones,
        # so the cache's last column is the counts (the linear form keeps every count in ``run``; its tail stays 0).
        # The zero block before block 0 is no key: it counts 0.
        v, v_before = (torch.cat([x, x.new_full((*x.shape[:-1], 1), one)], -1)
                       for x, one in ((v, 1.0), (v_before, 0.0 if first else 1.0)))
        if lag == 1:  # the window is the current block, which is also what enters the cache after it
            mask, updates = block_bias(L, q.device, q.dtype).exp(), None
            wv, weights = blocks(v, L), blocks(a.weights, L)
        else:
            mask, wv = bias.exp(), group_windows(v, v_before, L)
            weights, updates = group_windows(a.weights, a_before.weights, L), cache_updates(v, v_before)
        out, run, sums = mixture_attention(qb, c, weights, mask, wv, run, sums, updates)
        return out, run, tail, sums, folded

    # The caches' counts add, in order, the tail and the group's own blocks but its last ``lag``, which are the
    # next group's tail. The group's counts are one reduction of its whole assignment (split afterwards, so the
    # backward pass hands the (n·L, S) weights one expanded gradient, not a cat of two).
    counts = torch.cat([tail, detach(code_counts(a, S, n, G, dtype=q.dtype))], 2)  # (B, H, lag + n, S)
    entering, tail = counts.split([n, lag], 2)
    cache_counts = run.unsqueeze(2) + entering.cumsum(2)  # (B, H, n, S), block b's cache
    run = cache_counts[:, :, -1]
    window_codes, wv = None, group_windows(v, v_before, L)
    if exact_window or a.index is not None:
        window_keys = group_windows(k, k_before, L)
        if not exact_window:
            # Hard: the logit σ q·k̂_j of the straight-through key k̂_j = c_{z_j} + (k_j − sg(k_j)) is a code logit,
            # gathered at z_j; the kernel routes k̂'s gradient to the raw keys.
            window_codes = group_windows(a.index, a_before.index, L)
        out, sums = window_code_attention(qb, window_keys, bias, wv, None, code_bias(cache_counts, G), cache_counts,
                                          sums, cache_updates(v, v_before), window_codes, codebook=c)
        return out, run, tail, sums, folded
    # Kernel keys carry per-key scales e^{r_j} whose spread exceeds the float range: their window mixture
    # log Σ_s e^{σ q·c_s} Δ_js stays in logs, and it is the whole window logit.
    if lag == 1:
        bias, wv = block_bias(L, q.device, q.dtype), blocks(v, L)
        window_a = map_time(lambda x: blocks(x, L), a)
    else:
        window_a = Assignment(*(group_windows(x, y, L) if isinstance(x, torch.Tensor) else x
                                for x, y in zip(a, a_before)))
    code_logits = blocks(q @ c.transpose(-1, -2), L)  # (B, H, n, L, S)
    bias = bias + mixture_logits(code_logits, window_a)
    out, sums = window_code_attention(None, None, bias, wv, code_logits, code_bias(cache_counts, G), cache_counts, sums,
                                      cache_updates(v, v_before))
    return out, run, tail, sums, folded


def _split_time(x, sizes: list[int]):
    """Split a tensor or an Assignment along time (dim 2) into parts of ``sizes``."""
    if isinstance(x, Assignment):
        return [Assignment(*p) for p in zip(*(_split_time(y, sizes) if isinstance(y, torch.Tensor) else [y] * len(sizes)
                                               for y in x))]
    return x.split(sizes, 2)


def _chunked(q, k, v, c, a, *, state, L, return_state, scale, exact_window, detach_cache, assign, assign_keys):
    """Causal block algorithm over new tokens that may continue ``state`` (whose raw window is re-run). ``a``: the
    keys' Assignment, or None (no state) to assign group by group."""
    B, H, T, _ = q.shape
    S, Dv = c.shape[1], v.shape[-1]
    if state is None:
        start, counts0, sums0, G0 = 0, q.new_zeros(B, H, S), q.new_zeros(B, H, S, Dv), 0.0
    else:
        start, counts0, sums0, G0 = state.length - state.keys.shape[2], state.counts, state.sums, state.log_scale
        prefix = state.keys.shape[2]
        q = torch.cat([q.new_zeros(B, H, prefix, q.shape[-1]), q], dim=2)
        k, v = torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2)
        a = cat_time(state.assignment, a)
    G = G0 if a is None else count_scale(a, G0)
    if isinstance(G, torch.Tensor) and isinstance(G0, torch.Tensor):
        rescale = torch.exp(G0 - G)  # (B, H, 1, 1)
        counts0, sums0 = counts0 * rescale.squeeze(-1), sums0 * rescale
    if detach_cache:
        counts0, sums0 = counts0.detach(), sums0.detach()
    # Short sequences fit in one block; a shorter block gives the same result with less padding.
    L_run = L if state is not None or return_state else size_min(L, k.shape[2])
    length = start + k.shape[2]
    keep = window_start(length, L) - start  # positions leaving the raw window: whole blocks
    out, counts, sums = _causal(q, k, v, c, a, L=L_run, scale=scale, exact_window=exact_window,
                                detach_cache=detach_cache, counts0=counts0, sums0=sums0, G=G, assign=assign,
                                assign_keys=assign_keys, fold_blocks=keep // L if return_state else 0)
    out = out[:, :, out.shape[2] - T :]
    if not return_state:
        return out, None
    return out, VQState(
        counts=counts,
        sums=sums,
        keys=k[:, :, keep:],
        values=v[:, :, keep:],
        length=length,
        block_len=L,
        assignment=assign_keys(k[:, :, keep:]) if a is None else map_time(lambda x: x[:, :, keep:], a),
        log_scale=G,
    )


def _non_causal(q, k, v, c, a: Assignment, scale) -> torch.Tensor:
    """exp(σ QCᵀ + log n) (ΔᵀV / n): every query reads every key through the codes."""
    G = count_scale(a)
    counts, sums = (x.squeeze(2) for x in code_statistics(a, v, c.shape[1], 1, G))  # (B, H, S), (B, H, S, Dv)
    logits = (q * scale) @ c.transpose(-1, -2) + code_bias(counts, G).unsqueeze(2)
    return torch.softmax(logits, dim=-1) @ code_means(counts, sums)


def _validate(q, k, v, codebook, *, causal, assign, block_len, exact_window, state, return_state) -> None:
    check_qkv(q, k, v, causal=causal)
    if not isinstance(codebook, torch.Tensor) or codebook.dim() not in (2, 3):
        shape = tuple(codebook.shape) if isinstance(codebook, torch.Tensor) else type(codebook).__name__
        raise ValueError(f"codebook must be a tensor of shape (H, S, D) or (S, D), got {shape}")
    check_same_device_dtype(q=q, codebook=codebook)
    if codebook.shape[-1] != k.shape[-1]:
        raise ValueError(f"codebook D={codebook.shape[-1]} differs from the key D={k.shape[-1]}")
    if codebook.dim() == 3 and codebook.shape[0] != k.shape[1]:
        raise ValueError(f"codebook has {codebook.shape[0]} heads but k has H={k.shape[1]}")
    if codebook.shape[-2] == 0:
        raise ValueError("codebook must have at least one code (S >= 1)")
    check_choice("assign", assign, ASSIGNMENTS)
    if assign == "kernel" and exact_window:
        raise ValueError(
            "assign='kernel' does not support exact_window=True: the window would score keys by e^{σ q·k} while the "
            "cache scores codes by the kernel estimate, which is larger by a query- and codebook-dependent factor "
            "(e^{σ‖q‖²/2}·S for FAVOR+ codes), so the cache would drown the window. Use exact_window=False."
        )
    if block_len is not None:
        check_positive_int("block_len", block_len)
    if not causal and (exact_window or state is not None or return_state):
        raise ValueError("exact_window, state and return_state need causal=True (non-causal attention has no window)")
    if state is not None:
        B, H, _, D = k.shape
        S, Dv = codebook.shape[-2], v.shape[-1]
        if not isinstance(state, VQState):
            raise ValueError(f"state must be a VQState returned by vq_attention, got {type(state).__name__}")
        if block_len is not None and block_len != state.block_len:
            raise ValueError(f"block_len={block_len} differs from the state's block_len={state.block_len}")
        if state.counts.shape != (B, H, S) or state.sums.shape != (B, H, S, Dv) or state.keys.shape[-1] != D:
            raise ValueError(
                f"state does not match the inputs: counts {tuple(state.counts.shape)}, sums {tuple(state.sums.shape)} "
                f"for B={B}, H={H}, S={S}, D={D}, Dv={Dv}"
            )
        check_4d("state.keys", state.keys)
        check_assignment(state.assignment, assign=assign, shape=tuple(state.keys.shape[:3]), num_codes=S,
                         device=q.device)


def vq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    causal: bool,
    assign: str = "hard",
    temperature: float | torch.Tensor = 1.0,
    block_len: int | None = None,
    scale: float | None = None,
    exact_window: bool = False,
    detach_cache: bool = False,
    state: VQState | None = None,
    return_state: bool = False,
    assignment: Assignment | None = None,
):
    """Codebook attention (see the module docstring for the math).

    Args:
        q, k: (B, H, T, D); v: (B, H, T, Dv). Non-causal calls may give k and v another length than q.
        codebook: (H, S, D), one codebook per head, or (S, D) shared by all heads.
        causal: block-wise linear-time causal attention; else exp(QCᵀ)(ΔᵀV) over all keys.
        assign: "hard" (Transformer-VQ), "soft" (GMM posterior) or "kernel" (unnormalised Gaussian kernel).
        temperature: τ > 0 of soft/kernel assignments: a number, or a tensor with 1 or H elements (learnable).
        block_len: causal block length L (default 64, or T when T < 64). The window is the current and the
            previous block; older blocks are compressed.
        scale: multiplies q·k and q·c; defaults to D**-0.5 as in SDPA.
        exact_window: the window uses the raw keys (exact softmax nearby, codes only for the far past); not with
            assign="kernel".
        detach_cache: stop gradients through the compressed cache (Transformer-VQ's truncation).
        state: a :class:`VQState` from an earlier call; the inputs then continue that sequence. Up to
            ``RECURRENT_MAX_LEN`` new tokens run the O(1)-per-token recurrence, longer chunks the block algorithm.
        return_state: also return the :class:`VQState` after this call (causal only).
        assignment: the keys' :class:`Assignment`, ``vq_assign(k, codebook, assign=assign, temperature=...)``,
            when the caller already has it (e.g. from its codebook module); computed here otherwise. With it,
            ``temperature`` is not used (it is in the assignment, with its gradient for soft).

    Returns:
        out (B, H, T, Dv) in the input dtype, or (out, state) when ``return_state``. Computed in float32 for
        half-precision inputs and inside autocast (float64 stays float64). As in softmax attention, a key with a NaN
        or infinite entry makes NaN exactly the outputs of the queries that see it (and a state's later ones).
    """
    _validate(q, k, v, codebook, causal=causal, assign=assign, block_len=block_len, exact_window=exact_window,
              state=state, return_state=return_state)
    if assignment is not None:
        check_assignment(assignment, assign=assign, shape=tuple(k.shape[:3]), num_codes=codebook.shape[-2],
                         device=q.device)
    with no_autocast(q.device):
        in_dtype, dtype = q.dtype, compute_dtype(q.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        c = codebook.to(dtype)
        c = c.unsqueeze(0).expand(q.shape[1], -1, -1) if c.dim() == 2 else c  # (H, S, D)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # Non-finite keys reach the outputs as NaN only through the poison: inside the kernels they would reach
        # queries that cannot see them too (see vqattn.ops.nonfinite).
        bad, poison = nonfinite_keys(k)
        k = zero_rows(k, bad)
        poison = visible_poison(poison, causal=causal, state_counts=None if state is None else state.counts)
        assign_keys = lambda keys: vq_assign(keys, c, assign=assign, temperature=temperature)  # noqa: E731
        if assignment is not None:
            a = zero_assignment_rows(map_time(lambda x: x.to(dtype) if x.is_floating_point() else x, assignment), bad)
        elif not causal or state is not None or assign == "kernel":
            a = assign_keys(k)  # kernel: the statistics' unit e^G is the largest scale of all keys
        else:
            a = None  # the block algorithm assigns group by group
        if not causal:
            return (_non_causal(q, k, v, c, a, scale) + poison).to(in_dtype)
        kw = dict(scale=scale, exact_window=exact_window, detach_cache=detach_cache)
        if state is not None and q.shape[2] <= RECURRENT_MAX_LEN:
            out, new_state = vq_recurrent(q, k, v, c, a, state=state.to(dtype), **kw)
        else:
            L = block_len or (state.block_len if state is not None else DEFAULT_BLOCK_LEN)
            out, new_state = _chunked(q, k, v, c, a, state=None if state is None else state.to(dtype), L=L,
                                      return_state=return_state, assign=assign, assign_keys=assign_keys, **kw)
        out = (out + poison).to(in_dtype)
        if not return_state:
            return out
        return out, dataclasses.replace(new_state, counts=new_state.counts + poison[:, :, -1])  # the state carries it
