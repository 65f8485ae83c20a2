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
Cost O(T·(L + S)·D); memory O(T·(L + S) + (T/L)·S·D); no T×T tensor.

Window logits: hard uses σ q_i·k̂_j with the straight-through k̂_j = c_{z_j} + (k_j − sg(k_j)), so keys get the
gradient k̂ would get; ``exact_window`` uses the raw keys σ q_i·k_j; soft/kernel use the exact mixture
log Σ_s e^{σ q_i·c_s} Δ_js. In the cache (and in non-causal mode, which is all cache) hard keys get no gradient,
as in Transformer-VQ: their contribution is a count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._checks import (
    check_4d,
    check_choice,
    check_positive_int,
    check_qkv,
    check_same_device_dtype,
    compute_dtype,
)

ASSIGNMENTS = ("hard", "soft", "kernel")

# Measured in benchmarks/attention_speed.py (README): the fastest block length on CPU for S=512, D=64.
DEFAULT_BLOCK_LEN = 128


@dataclass
class VQState:
    """Recurrent state of causal :func:`vq_attention` after ``length`` tokens.

    Positions before ``window_start = max(0, (length // block_len − 1) · block_len)`` are compressed into
    ``counts`` (B, H, S) and value ``sums`` (B, H, S, Dv); positions from ``window_start`` on are kept raw in
    ``keys`` (B, H, W, D) and ``values`` (B, H, W, Dv), W < 2·block_len. Its size is constant in the length.
    """

    counts: torch.Tensor
    sums: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    length: int
    block_len: int


def window_start(length: int, block_len: int) -> int:
    """First position still uncompressed for the next query at ``length`` (start of its previous block)."""
    return max(0, (length // block_len - 1) * block_len)


def _as_head_codebook(codebook: torch.Tensor, num_heads: int) -> torch.Tensor:
    return codebook.unsqueeze(0).expand(num_heads, -1, -1) if codebook.dim() == 2 else codebook


def _temperature_tensor(temperature, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    """Temperature as a (H, 1, 1) tensor broadcasting over (B, H, T, S); validates positivity."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() not in (1, num_heads):
            raise ValueError(
                f"temperature must be a number, a 1-element tensor or one value per head ({num_heads}), "
                f"got shape {tuple(temperature.shape)}"
            )
        # Checked on the device: reading the values on the host would synchronise a GPU on every step.
        torch._assert_async((temperature > 0).all(), "temperature must be > 0")
        return temperature.to(device=like.device, dtype=like.dtype).reshape(-1, 1, 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    return like.new_full((1, 1, 1), float(temperature))


class Assignment(NamedTuple):
    """Δ = weights · exp(log_scale). Hard: index (B, H, T) of the codes, weights None (the one-hot matrix is
    never built). Soft/kernel: weights (B, H, T, S) in [0, 1], index None. log_scale: a per-head constant,
    (H, 1, 1), or 0."""

    weights: torch.Tensor | None
    index: torch.Tensor | None
    log_scale: torch.Tensor | float


def vq_assign(k: torch.Tensor, codebook: torch.Tensor, *, assign: str, temperature=1.0) -> Assignment:
    """Assignment Δ of keys k (B, H, T, D) to the codes of codebook (H, S, D).

    Kernel weights exp(−‖k − c‖²/2τ + ‖c‖²/2τ) can overflow, so they are returned divided by the per-head
    constant exp(max_s ‖c_s‖²/2τ) ≥ them, with its log as ``log_scale``.
    """
    c = codebook  # (H, S, D)
    c_sq = (c * c).sum(-1)[:, None, :]  # (H, 1, S)
    if assign == "hard":
        # ‖k‖² is the same for every code, so it does not change the argmin: argmin_s ‖c_s‖² − 2 k·c_s.
        B, H, T, D = k.shape
        dist = torch.baddbmm(c_sq.repeat(B, 1, 1), k.reshape(B * H, T, D),
                             c.transpose(-1, -2).repeat(B, 1, 1), alpha=-2)
        return Assignment(None, dist.argmin(-1).view(B, H, T), 0.0)
    kc = k @ c.transpose(-1, -2)  # (B, H, T, S)
    tau = _temperature_tensor(temperature, c.shape[0], k)
    if assign == "soft":
        # −‖k − c‖²/2τ up to a per-key constant, which the softmax removes.
        return Assignment(torch.softmax((kc - c_sq / 2) / tau, dim=-1), None, 0.0)
    log_w = (kc - (k * k).sum(-1, keepdim=True) / 2) / tau  # −‖k − c‖²/2τ + ‖c‖²/2τ
    shift = (c_sq / (2 * tau)).amax(-1, keepdim=True).detach()  # (H, 1, 1) ≥ max_s log_w
    return Assignment(torch.exp(log_w - shift), None, shift)


def _log_counts(counts: torch.Tensor) -> torch.Tensor:
    """log n with log 0 = −inf and no NaN gradient for empty codes."""
    tiny = torch.finfo(counts.dtype).tiny
    return torch.where(counts > 0, counts.clamp_min(tiny).log(), float("-inf"))


def _code_means(counts: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    return sums / counts.clamp_min(torch.finfo(counts.dtype).tiny).unsqueeze(-1)


def _code_statistics(
    assignment: Assignment, v: torch.Tensor, num_codes: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group code counts Σ_j Δ_js and value sums Σ_j Δ_js v_j over consecutive groups of positions.

    v: (B, H, G·L, Dv) -> counts (B, H, G, S), sums (B, H, G, S, Dv) (without the assignment's log_scale).
    Hard assignments scatter-add (O(T·Dv)) instead of multiplying by the one-hot matrix (O(T·S·Dv)).
    """
    B, H, T, Dv = v.shape
    S, L = num_codes, T // num_groups
    if assignment.index is None:
        w = assignment.weights.view(B, H, num_groups, L, S)
        return w.sum(3), w.transpose(-1, -2) @ v.view(B, H, num_groups, L, Dv)
    group = torch.arange(T, device=v.device) // L  # (T,)
    slot = group * S + assignment.index  # (B, H, T): code slot within the flattened (G·S) axis
    counts = v.new_zeros(B, H, num_groups * S).scatter_add_(2, slot, v.new_ones(B, H, T))
    sums = torch.scatter_add(v.new_zeros(B, H, num_groups * S, Dv), 2, slot.unsqueeze(-1).expand(B, H, T, Dv), v)
    return counts.view(B, H, num_groups, S), sums.view(B, H, num_groups, S, Dv)


class _LaggedPrefixSum(torch.autograd.Function):
    """out[:, :, b] = initial + Σ_{b' ≤ b−2} x[:, :, b'] for x (B, H, nb, ...): the cache of every block.

    An in-place loop over blocks: ``torch.cumsum`` along a middle dim is ~10× slower on CPU, and this runs on
    the largest tensor of the algorithm, (B, H, nb, S, Dv).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # slices of a transposed layout make every add a strided gather
        out = torch.empty_like(x)
        out[:, :, :2] = initial.unsqueeze(2)
        for b in range(2, x.shape[2]):
            torch.add(out[:, :, b - 1], x[:, :, b - 2], out=out[:, :, b])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # d out[b] / d x[b'] = 1 for b ≥ b' + 2: lagged suffix sums of the incoming gradient.
        nb = grad_out.shape[2]
        grad_out = grad_out.contiguous()  # matmul backward hands over transposed gradients
        grad_x = torch.empty_like(grad_out)
        grad_x[:, :, max(nb - 2, 0) :] = 0  # the last two blocks are in nobody's cache
        if nb > 2:
            grad_x[:, :, nb - 3] = grad_out[:, :, nb - 1]
            for b in range(nb - 4, -1, -1):
                torch.add(grad_x[:, :, b + 1], grad_out[:, :, b + 2], out=grad_x[:, :, b])
        return grad_x, grad_out.sum(2)


def _blocks(x: torch.Tensor, L: int) -> torch.Tensor:
    """(B, H, nb·L, D) -> (B, H, nb, L, D)."""
    B, H, T, D = x.shape
    return x.view(B, H, T // L, L, D)


def _windows(x: torch.Tensor, L: int) -> torch.Tensor:
    """Previous block + current block: (B, H, nb·L, D) -> (B, H, nb, 2L, D); block 0's previous is zeros."""
    blocks = _blocks(x, L)
    previous = F.pad(blocks, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    return torch.cat([previous, blocks], dim=3)


def _window_bias(num_blocks: int, L: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(nb, L, 2L) additive mask: query i of block b sees window key jj iff jj ≤ i + L (causal); block 0 has no
    previous block."""
    i = torch.arange(L, device=device)[:, None]
    jj = torch.arange(2 * L, device=device)[None, :]
    bias = torch.zeros(num_blocks, L, 2 * L, device=device, dtype=dtype)
    bias.masked_fill_(jj > i + L, float("-inf"))
    bias[0, :, :L] = float("-inf")
    return bias


def _mixture_logits(code_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """log Σ_s exp(code_logits_is) Δ_js for every (query, key) pair, stabilised by the per-query max.

    code_logits: (..., Lq, S), weights: (..., Lk, S) -> (..., Lq, Lk).
    """
    m = code_logits.amax(-1, keepdim=True).detach()
    affinity = torch.exp(code_logits - m) @ weights.transpose(-1, -2)
    return affinity.clamp_min(torch.finfo(affinity.dtype).tiny).log() + m


def _per_head(log_scale: torch.Tensor | float) -> torch.Tensor | float:
    """(H, 1, 1) -> (H, 1, 1, 1), broadcasting over (B, H, nb, L, ·)."""
    return log_scale.unsqueeze(-1) if isinstance(log_scale, torch.Tensor) else log_scale


class _WindowCodeAttention(torch.autograd.Function):
    """Softmax attention of every block's queries over two key groups, with one shared max:

        window  logits  qb·wkᵀ + window_bias     (N, nb, L, 2L)   values  wv     (N, nb, 2L, Dv)
        codes   logits  q·cᵀ  + code_bias        (N, nb, L, S)    values  means  (N, nb, S, Dv)

    qb: (N, nb, L, D) queries (already scaled); wk: (N, nb, 2L, D), or None when the window logits are all in
    window_bias (soft/kernel mixtures); window_bias: broadcastable to (N, nb, L, 2L); codes: (N, S, D) shared by
    all blocks; code_bias: (N, nb, S). Returns (N, nb, L, Dv).

    Hand-written forward and backward (flash-attention style: dS = P ⊙ (dP − rowsum(dO ⊙ O))): the two groups
    are never concatenated, the code logits of all blocks come from one (T, D) × (D, S) product, and only the
    probabilities are kept for the backward pass.
    """

    @staticmethod
    def forward(ctx, qb, wk, window_bias, codes, code_bias, wv, means):
        N, nb, L, D = qb.shape
        S = codes.shape[1]
        p_window = window_bias.expand(N, nb, L, wv.shape[2]).clone() if wk is None else \
            torch.matmul(qb, wk.transpose(-1, -2)).add_(window_bias)  # (N, nb, L, 2L)
        p_codes = torch.bmm(qb.reshape(N, nb * L, D), codes.transpose(1, 2)).view(N, nb, L, S)
        p_codes.add_(code_bias.unsqueeze(2))
        m = torch.maximum(p_window.amax(-1, keepdim=True), p_codes.amax(-1, keepdim=True))  # finite: the diagonal
        p_window.sub_(m).exp_()
        p_codes.sub_(m).exp_()
        z = p_window.sum(-1, keepdim=True).add_(p_codes.sum(-1, keepdim=True))  # (N, nb, L, 1)
        # p_* stay unnormalised: dividing the (L, Dv) output is cheaper than the (L, 2L + S) probabilities.
        out = torch.matmul(p_window, wv).add_(torch.matmul(p_codes, means)).div_(z)
        ctx.save_for_backward(qb, wk, codes, wv, means, p_window, p_codes, out, z)
        ctx.window_bias_shape = window_bias.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qb, wk, codes, wv, means, p_window, p_codes, out, z = ctx.saved_tensors
        N, nb, L, D = qb.shape
        S = codes.shape[1]
        need = ctx.needs_input_grad
        grad_out = grad_out / z  # with P = p / z, every P-term below becomes a p-term of this scaled gradient
        delta = (grad_out * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
        ds_window = torch.matmul(grad_out, wv.transpose(-1, -2)).sub_(delta).mul_(p_window)  # dlogits, (N, nb, L, 2L)
        ds_codes = torch.matmul(grad_out, means.transpose(-1, -2)).sub_(delta).mul_(p_codes)  # (N, nb, L, S)
        flat_ds_codes = ds_codes.view(N, nb * L, S)
        grad_qb = grad_wk = grad_window_bias = grad_codes = grad_code_bias = grad_wv = grad_means = None
        if need[0]:
            grad_qb = torch.bmm(flat_ds_codes, codes).view(N, nb, L, D)
            if wk is not None:
                grad_qb.add_(torch.matmul(ds_window, wk))
        if need[1]:
            grad_wk = torch.matmul(ds_window.transpose(-1, -2), qb)
        if need[2]:
            grad_window_bias = _sum_to_shape(ds_window, ctx.window_bias_shape)
        if need[3]:
            grad_codes = torch.bmm(flat_ds_codes.transpose(1, 2), qb.reshape(N, nb * L, D))
        if need[4]:
            grad_code_bias = ds_codes.sum(2)
        if need[5]:
            grad_wv = torch.matmul(p_window.transpose(-1, -2), grad_out)
        if need[6]:
            grad_means = torch.matmul(p_codes.transpose(-1, -2), grad_out)
        return grad_qb, grad_wk, grad_window_bias, grad_codes, grad_code_bias, grad_wv, grad_means


def _sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = x.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return x.sum(dims, keepdim=True).view(shape) if dims else x


def _causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c: torch.Tensor,
    assignment: Assignment,
    *,
    L: int,
    scale: float,
    exact_window: bool,
    detach_cache: bool,
    initial_counts: torch.Tensor,
    initial_sums: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block algorithm on a block-aligned sequence. Returns out (B, H, T, Dv) and per-block counts/sums."""
    B, H, T, D = q.shape
    S = c.shape[1]
    nb = -(-T // L)
    pad = nb * L - T
    if pad:
        # Zero padding sits after every real query, so the causal mask hides it; its block statistics are never
        # read because block b's cache only holds blocks ≤ b−2.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        weights, index, log_scale = assignment
        assignment = Assignment(
            None if weights is None else F.pad(weights, (0, 0, 0, pad)),
            None if index is None else F.pad(index, (0, pad)),
            log_scale,
        )
    weights, index, log_scale = assignment

    counts, sums = _code_statistics(assignment, v, S, nb)  # (B, H, nb, S), (B, H, nb, S, Dv)
    if detach_cache:
        counts, sums = counts.detach(), sums.detach()
    cache_counts = _LaggedPrefixSum.apply(counts, initial_counts)  # (B, H, nb, S)
    cache_sums = _LaggedPrefixSum.apply(sums, initial_sums)  # (B, H, nb, S, Dv)

    N = B * H
    flat = lambda x: x.reshape(N, *x.shape[2:])  # noqa: E731  (B, H, ...) -> (B·H, ...)
    q_blocks = _blocks(q * scale, L)  # (B, H, nb, L, D); scaling q is cheaper than scaling the logits
    window_bias = _window_bias(nb, L, q.device, q.dtype)  # (nb, L, 2L): causal mask
    if exact_window:
        window_keys = flat(_windows(k, L))
    elif index is not None:
        # Straight-through: the value of c_z, the gradient of k.
        k_hat = torch.gather(c.unsqueeze(0).expand(B, H, -1, -1), 2, index.unsqueeze(-1).expand(-1, -1, -1, D))
        window_keys = flat(_windows(k_hat + (k - k.detach()), L))
    else:
        # The mixture logit log Σ_s e^{σ q·c_s} Δ_js is not a dot product: it is the whole window logit.
        code_logits = q_blocks @ c.unsqueeze(1).transpose(-1, -2)  # (B, H, nb, L, S)
        window_bias = flat(window_bias + _mixture_logits(code_logits, _windows(weights, L)) + _per_head(log_scale))
        window_keys = None
    code_bias = flat(_log_counts(cache_counts) + log_scale)  # (N, nb, S); log_scale is (H, 1, 1) or 0
    codes = flat(c.unsqueeze(0).expand(B, -1, -1, -1))  # (N, S, D)
    out = _WindowCodeAttention.apply(flat(q_blocks), window_keys, window_bias, codes, code_bias,
                                     flat(_windows(v, L)), flat(_code_means(cache_counts, cache_sums)))
    return out.reshape(B, H, nb * L, -1)[:, :, :T], counts, sums


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
):
    """Codebook attention (see the module docstring for the math).

    Args:
        q, k: (B, H, T, D); v: (B, H, T, Dv). Non-causal calls may give k and v another length than q.
        codebook: (H, S, D), one codebook per head, or (S, D) shared by all heads.
        causal: block-wise linear-time causal attention; else exp(QCᵀ)(ΔᵀV) over all keys.
        assign: "hard" (Transformer-VQ), "soft" (GMM posterior) or "kernel" (unnormalised Gaussian kernel).
        temperature: τ > 0 of soft/kernel assignments: a number, or a tensor with 1 or H elements (learnable).
        block_len: causal block length L (default 128, or T when T < 128). The window is the current and the
            previous block; older blocks are compressed.
        scale: multiplies q·k and q·c; defaults to D**-0.5 as in SDPA.
        exact_window: the window uses the raw keys (exact softmax nearby, codes only for the far past).
        detach_cache: stop gradients through the compressed cache (Transformer-VQ's truncation).
        state: a :class:`VQState` from an earlier call; the inputs then continue that sequence.
        return_state: also return the :class:`VQState` after this call (causal only).

    Returns:
        out (B, H, T, Dv) in the input dtype, or (out, state) when ``return_state``. Half-precision inputs are
        computed in float32.
    """
    _validate(q, k, v, codebook, causal=causal, assign=assign, block_len=block_len, exact_window=exact_window,
              state=state, return_state=return_state)
    B, H, T, D = q.shape
    in_dtype = q.dtype
    dtype = compute_dtype(in_dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    c = _as_head_codebook(codebook.to(dtype), H)  # (H, S, D)
    S, Dv = c.shape[1], v.shape[-1]
    scale = D**-0.5 if scale is None else scale

    if not causal:
        assignment = vq_assign(k, c, assign=assign, temperature=temperature)
        counts, sums = (x.squeeze(2) for x in _code_statistics(assignment, v, S, 1))  # (B, H, S), (B, H, S, Dv)
        logits = (q * scale) @ c.transpose(-1, -2) + _log_counts(counts).unsqueeze(2) + assignment.log_scale
        return (torch.softmax(logits, dim=-1) @ _code_means(counts, sums)).to(in_dtype)

    L = block_len or (state.block_len if state is not None else DEFAULT_BLOCK_LEN)
    if state is None:
        start, counts0 = 0, q.new_zeros(B, H, S)
        sums0 = q.new_zeros(B, H, S, Dv)
    else:
        # Re-run the state's raw window (block-aligned) in front of the new tokens; drop its outputs.
        start, counts0, sums0 = state.length - state.keys.shape[2], state.counts.to(dtype), state.sums.to(dtype)
        prefix = state.keys.shape[2]
        q = torch.cat([q.new_zeros(B, H, prefix, D), q], dim=2)
        k = torch.cat([state.keys.to(dtype), k], dim=2)
        v = torch.cat([state.values.to(dtype), v], dim=2)
    if detach_cache:
        counts0, sums0 = counts0.detach(), sums0.detach()
    # Short sequences fit in one block; a shorter block gives the same result with less padding.
    L_run = L if state is not None or return_state else min(L, k.shape[2])
    assignment = vq_assign(k, c, assign=assign, temperature=temperature)
    out, counts, sums = _causal(q, k, v, c, assignment, L=L_run, scale=scale, exact_window=exact_window,
                                detach_cache=detach_cache, initial_counts=counts0, initial_sums=sums0)
    out = out[:, :, out.shape[2] - T :].to(in_dtype)
    if not return_state:
        return out

    length = start + k.shape[2]
    new_start = window_start(length, L)
    folded = (new_start - start) // L  # whole blocks leaving the window
    new_state = VQState(
        counts=counts0 + counts[:, :, :folded].sum(2),
        sums=sums0 + sums[:, :, :folded].sum(2),
        keys=k[:, :, new_start - start :],
        values=v[:, :, new_start - start :],
        length=length,
        block_len=L,
    )
    return out, new_state
