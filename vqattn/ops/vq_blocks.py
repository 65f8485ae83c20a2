"""The block kernel shared by :func:`~vqattn.ops.vq.vq_attention` and :func:`~vqattn.ops.window.window_attention`.

Queries run in blocks of L. Block b attends, with one softmax, to its window (blocks b−1 and b, causally masked)
and, for codebook attention, to S compressed "keys" (the codes, carrying per-block counts and value means of
blocks ≤ b−2): :class:`WindowCodeAttention`. Window attention is the same kernel without the codes. Soft codebook
attention, whose window logits are mixtures over the codes, runs the same math in linear form:
:class:`MixtureAttention`. Both read the codes' value sums through :func:`read_cache`: one running cache per batch·head,
block after block, on CPU; every block's cache at once (one cumsum) on GPUs and under torch.compile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._checks import size_max, size_min

# Measured in benchmarks/attention_speed.py (README): at S=512, D=64, T=8192 on CPU, 64 is as fast as 128 for
# hard and clearly faster for soft (whose exact in-block mixture costs L·S per query); the layers use 64 too.
DEFAULT_BLOCK_LEN = 64


def no_autocast(device: torch.device):
    """The ops compute in float32 (or float64) whatever the ambient autocast says: their softmaxes over
    thousands of keys and the per-code sums lose 2-3 digits in bf16."""
    return torch.autocast(device_type=device.type, enabled=False)


def blocks(x: torch.Tensor, L: int) -> torch.Tensor:
    """(B, H, nb·L, ...) -> (B, H, nb, L, ...)."""
    return x.view(*x.shape[:2], x.shape[2] // L, L, *x.shape[3:])


def pad_to_blocks(x: torch.Tensor | None, L: int, value=0) -> torch.Tensor | None:
    """Pad the time dim (dim 2) of x up to a multiple of L."""
    if x is None:
        return None
    pad = -x.shape[2] % L
    return F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad), value=value) if pad else x


def block_bias(L: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(L, L) additive causal mask of a window that is the current block only."""
    return torch.full((L, L), float("-inf"), device=device, dtype=dtype).triu_(1)


def window_bias(num_blocks: int, L: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(nb, L, 2L) additive mask of the first nb blocks of a sequence: query i of block b sees window key jj iff
    jj ≤ i + L (causal); block 0 has no previous block. Later blocks share block 1's mask: ``bias[1:2]``."""
    i = torch.arange(L, device=device)[:, None]
    jj = torch.arange(2 * L, device=device)[None, :]
    bias = torch.zeros(num_blocks, L, 2 * L, device=device, dtype=dtype)
    bias.masked_fill_(jj > i + L, float("-inf"))
    bias[0, :, :L] = float("-inf")
    return bias


# Temporaries of at most this size per group of blocks (see :func:`block_groups`).
GROUP_BYTES = 8 * 2**20


def block_groups(num_blocks: int, bytes_per_block: int, device: torch.device) -> list[tuple[int, int]]:
    """Consecutive ranges [b0, b1) of blocks that the block algorithm runs one after another on CPU.

    glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MB as large blocks are
    freed) with fresh pages, which the kernel zero-fills on first touch: about 1.3 ms per MB on this project's CPU,
    more than the arithmetic of an (L, S) logit tile. Running the blocks in groups whose temporaries stay around
    :data:`GROUP_BYTES` keeps them under the threshold, so freed ones are reused, without a process-wide allocator
    setting (``vqattn.utils.tune_cpu_allocator``) that a user's script would not have; compiled CPU code allocates
    through the same malloc. On GPUs (a caching allocator) one group keeps the kernel count low.
    """
    if device.type != "cpu":
        return [(0, num_blocks)]
    size = size_max(1, size_min(num_blocks, GROUP_BYTES // size_max(bytes_per_block, 1)))
    return [(b0, size_min(b0 + size, num_blocks)) for b0 in range(0, num_blocks, size)]


def split_groups(x: torch.Tensor, groups: list[tuple[int, int]], L: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For every group [b0, b1) of blocks: (x's blocks b0..b1−1, (B, H, (b1−b0)·L, ...); the block before b0,
    (B, H, L, ...), zeros for b0 = 0). x: (B, H, nb·L, ...).

    One split of x, so the backward pass assembles x's gradient with one cat; slicing each group out of x instead
    would zero-fill a gradient of x's full size for every group.
    """
    pieces = x.split([(b1 - b0) * L for b0, b1 in groups], dim=2)
    before = [x.new_zeros(*x.shape[:2], L, *x.shape[3:])] + [piece[:, :, -L:] for piece in pieces[:-1]]
    return list(zip(pieces, before))


def previous_blocks(piece: torch.Tensor, before: torch.Tensor, L: int) -> torch.Tensor:
    """The block before each of a group's blocks, from :func:`split_groups`: (B, H, n, L, ...)."""
    return blocks(torch.cat([before, piece[:, :, :-L]], dim=2), L)


def group_windows(piece: torch.Tensor, before: torch.Tensor, L: int) -> torch.Tensor:
    """Windows (previous block + current block) of a group's blocks, from :func:`split_groups`: (B, H, n, 2L, ...)."""
    return torch.cat([previous_blocks(piece, before, L), blocks(piece, L)], dim=3)


class CacheUpdates(NamedTuple):
    """The statistics that enter the value-sum cache after each block of a group (see :func:`read_cache`):
    block b adds Σ_j Δ_js v_j over its L keys j, with values (N, n, L, Dv) and either the keys' codes ``index``
    (N, n, L) (hard: Δ one-hot) or their weights ``weights`` (N, n, L, S) (soft and kernel, in units of e^G)."""

    values: torch.Tensor
    index: torch.Tensor | None
    weights: torch.Tensor | None


def _scans(device: torch.device) -> bool:
    """Whether the cache runs as a loop over blocks (:func:`read_cache`): on CPU in eager mode. On GPUs and
    under ``torch.compile`` the per-block caches are formed by one cumsum instead: a loop would be several kernel
    launches per block, or a graph unrolled over every block."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def _flat_slots(index: torch.Tensor, S: int) -> torch.Tensor:
    """(N, n, L) codes -> (n, N·L) rows of the flattened (N·S, Dv) cache."""
    N = index.shape[0]
    return (index + torch.arange(N, device=index.device).view(N, 1, 1) * S).transpose(0, 1).reshape(index.shape[1], -1)


def _add_block(cache: torch.Tensor, updates: CacheUpdates, slots, b: int, alpha: float) -> None:
    """cache (N, S, Dv) += alpha · (block b's statistics), in place."""
    values = updates.values[:, b]  # (N, L, Dv)
    if slots is not None:
        N, S, Dv = cache.shape
        cache.view(N * S, Dv).index_add_(0, slots[b], values.reshape(-1, Dv), alpha=alpha)
    else:
        cache.baddbmm_(updates.weights[:, b].transpose(-1, -2), values, alpha=alpha)


def _block_slots(index: torch.Tensor, S: int) -> torch.Tensor:
    """(N, n, L) codes -> (N, n·L, 1) rows of the (N, n·S, Dv) per-block statistics."""
    n = index.shape[1]
    return (index + torch.arange(n, device=index.device).view(1, n, 1) * S).flatten(1).unsqueeze(-1)


def _block_caches(sums: torch.Tensor, updates: CacheUpdates) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's cache C_b (N, n, S, Dv) at once, and C_n."""
    N, S, Dv = sums.shape
    values = updates.values
    n = values.shape[1]
    if updates.index is not None:
        slots = _block_slots(updates.index, S).expand(-1, -1, Dv)
        stats = values.new_zeros(N, n * S, Dv).scatter_add(1, slots, values.flatten(1, 2)).view(N, n, S, Dv)
    else:
        stats = updates.weights.transpose(-1, -2) @ values
    ends = sums.unsqueeze(1) + torch.cumsum(stats, 1)  # C_{b+1}
    return torch.cat([sums.unsqueeze(1), ends[:, :-1]], 1), ends[:, -1]


def read_cache(logits: torch.Tensor, sums: torch.Tensor, updates: CacheUpdates, probabilities):
    """num_b = p_b · C_b for every block b of a group, where C_b is the value-sum cache that block b reads:
    C_0 = ``sums`` and C_{b+1} = C_b + (block b's ``updates``), and p_b = ``probabilities(b, logits_b, out)``
    block b's code weights from its code logits, written into ``out``. Returns p (N, n, L, S), num (N, n, L, Dv)
    and C_n (N, S, Dv). ``probabilities`` takes a block index b and logits_b (N, L, S), or b = ``slice(None)``
    and every block's logits (N, n, L, S).

    On CPU (:func:`_scans`) the blocks run one after another while their (L, S) tiles and one running (S, Dv)
    cache per batch·head stay in cache: every pass over the (T, S) weights is a pass over memory otherwise, and
    a cache per block is 8× a block's keys at S = 512, L = 64.
    """
    p = torch.empty_like(logits)
    if not _scans(logits.device):
        caches, last = _block_caches(sums, updates)
        probabilities(slice(None), logits, p)
        return p, p @ caches, last
    N, n, L, _ = logits.shape
    cache = sums.clone()
    slots = None if updates.index is None else _flat_slots(updates.index, sums.shape[1])
    num = logits.new_empty(n, N, L, sums.shape[-1])
    for b in range(n):
        torch.bmm(probabilities(b, logits[:, b], p[:, b]), cache, out=num[b])
        _add_block(cache, updates, slots, b, 1.0)
    return p, num.transpose(0, 1), cache


def read_cache_backward(p, grad_num, sums, last, grad_last, updates: CacheUpdates, need_updates: bool,
                        logit_factor, use_logit_grad, grad_values=None, grad_weights=None):
    """Backward of :func:`read_cache` with its first and last caches ``sums`` = C_0 and ``last`` = C_n and the
    last one's gradient ``grad_last`` (or None). With G_b = dC_b = G_{b+1} + p_bᵀ · dnum_b (G_n = grad_last),
    hands every block's logit gradients p_b ⊙ logit_factor(b, dp_b), dp_b = dnum_b · C_bᵀ, to
    ``use_logit_grad(b, ds_b)`` (:class:`LogitGradients`), and returns d sums = G_0 and, if ``need_updates``, the
    gradients of updates.values and updates.weights (None for an index): block b's statistics enter C_{b+1}, so
    their gradient is G_{b+1}. Given ``grad_values`` / ``grad_weights`` (N, n, L, ·), weights' gradients are added
    to them (when the updates are tensors that the caller also differentiates otherwise).

    Both callbacks take a block index b and (N, L, S) tiles, or b = ``slice(None)`` and every block's (N, n, L, S).
    On CPU the blocks are walked backwards, recovering C_b = C_{b+1} − (block b's statistics), and every product
    is formed while its operands are in cache.
    """
    N, n, L, S = p.shape
    Dv = last.shape[-1]
    grad_last = torch.zeros_like(last) if grad_last is None else grad_last
    weighted = need_updates and updates.index is None
    if weighted:
        grad_values = p.new_zeros(N, n, L, Dv) if grad_values is None else grad_values
        grad_weights = torch.zeros_like(updates.weights) if grad_weights is None else grad_weights
    if not _scans(p.device):
        caches, _ = _block_caches(sums, updates)
        use_logit_grad(slice(None), logit_factor(slice(None), grad_num @ caches.transpose(-1, -2)).mul_(p))
        grad_caches = p.transpose(-1, -2) @ grad_num  # (N, n, S, Dv)
        suffix = torch.flip(torch.cumsum(torch.flip(grad_caches, [1]), 1), [1])  # Σ_{b' ≥ b}
        grad_stats = grad_last.unsqueeze(1) + torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], 1)
        if weighted:
            grad_values = grad_values + updates.weights @ grad_stats
            grad_weights = grad_weights + updates.values @ grad_stats.transpose(-1, -2)
        elif need_updates:
            slots = _block_slots(updates.index, S).expand(-1, -1, Dv)
            grad_values = grad_stats.flatten(1, 2).gather(1, slots).view(N, n, L, Dv)
        return grad_last + suffix[:, 0], grad_values, grad_weights
    cache, grad_cache = last.clone(), grad_last.clone()
    slots = None if updates.index is None else _flat_slots(updates.index, S)
    if need_updates and not weighted:
        grad_values = p.new_empty(n, N, L, Dv)
    for b in range(n - 1, -1, -1):
        _add_block(cache, updates, slots, b, -1.0)
        if weighted:  # G_{b+1} is the gradient of what block b added
            grad_values[:, b].baddbmm_(updates.weights[:, b], grad_cache)
            grad_weights[:, b].baddbmm_(updates.values[:, b], grad_cache.transpose(-1, -2))
        elif need_updates:
            torch.index_select(grad_cache.view(N * S, Dv), 0, slots[b], out=grad_values[b].view(N * L, Dv))
        grad_cache.baddbmm_(p[:, b].transpose(-1, -2), grad_num[:, b])
        use_logit_grad(b, logit_factor(b, torch.bmm(grad_num[:, b], cache.transpose(-1, -2))).mul_(p[:, b]))
    if need_updates and not weighted:
        grad_values = grad_values.transpose(0, 1)
    return grad_cache, grad_values, grad_weights


def code_logits_of(q: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """q·cᵀ for q (N, n, L, D) and c (N, S, D): (N, n, L, S), one bmm (a broadcast matmul would copy c per block)."""
    N, n, L, D = q.shape
    return torch.bmm(q.reshape(N, n * L, D), codebook.transpose(-1, -2)).view(N, n, L, -1)


class LogitGradients:
    """Takes a group's code-logit gradients ds (:func:`read_cache_backward`) block by block: adds the window's
    gathered-logit gradients (hard VQ), sums them over the queries (the code bias's gradient, ``bias``), and either
    keeps them (``logits``, when the kernel got the code logits) or turns them into the gradients of the scaled
    queries q (N, n, L, D) and the codebook c (N, S, D) of the logits q·cᵀ (``q``, ``codebook``), so no (T, S)
    gradient is written."""

    def __init__(self, like, *, q=None, codebook=None, need_q=False, need_codebook=False, need_bias=False,
                 window_codes=None, ds_window=None):
        N, n, L, S = like.shape
        self.q, self.codebook, self.window_codes, self.ds_window = q, codebook, window_codes, ds_window
        self.logits = torch.empty_like(like) if codebook is None else None
        self.dq = like.new_empty(*q.shape) if codebook is not None and need_q else None
        self.dc = torch.zeros_like(codebook) if codebook is not None and need_codebook else None
        self.bias = like.new_empty(N, n, S) if need_bias else None

    def __call__(self, b, ds):
        N, S = ds.shape[0], ds.shape[-1]
        if self.bias is not None:
            self.bias[:, b] = ds.sum(-2)
        if self.window_codes is not None:
            ds.scatter_add_(-1, self.window_codes[:, b], self.ds_window[:, b])
        if self.logits is not None:
            self.logits[:, b] = ds
            return
        flat = ds.reshape(N, -1, S)
        if self.dq is not None:
            self.dq[:, b] = torch.bmm(flat, self.codebook).view(self.dq[:, b].shape)
        if self.dc is not None:
            self.dc.baddbmm_(flat.transpose(-1, -2), self.q[:, b].reshape(N, -1, self.q.shape[-1]))


# Floor of the exp arguments (all ≤ 0 after the max shift). On x86 CPUs (measured with AVX-512) exp is about 100×
# slower for arguments below −87.3, where float32 underflows, and 13× for −inf (empty codes, masked keys), and any
# arithmetic on subnormal results (below 1.2e−38) is 30× slower: the weights' products with gradients must stay
# normal. Terms below e^{−50} weigh < S·e^{−50} ≈ 1e−19 of the normaliser at S = 512, below float64 rounding.
EXP_FLOOR = -50.0


def floored_exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x ≤ 0, in place, with every term below 2·e^{−50} set to exactly 0 (−inf included) and never the
    slow underflow path of exp; masked keys and empty codes weigh exactly 0 (see :data:`EXP_FLOOR`)."""
    return F.threshold_(x.clamp_min_(EXP_FLOOR).exp_(), 2 * math.exp(EXP_FLOOR), 0.0)


class WindowCodeAttention(torch.autograd.Function):
    """Softmax attention of every block's queries over two key groups, with one shared max:

        window  logits  qb·wkᵀ + window_bias        (N, nb, L, 2L)   values  wv            (N, nb, 2L, Dv)
        codes   logits  code_logits + code_bias     (N, nb, L, S)    values  C_b / counts  (N, S, Dv) per block

    qb: (N, nb, L, D) queries (already scaled); wk: (N, nb, 2L, D), or None (then qb is None too) when the
    window logits are all in window_bias (kernel mixtures); window_bias: broadcastable to (N, nb, L, 2L);
    code_logits: (N, nb, L, S), code_bias: (N, nb, S), counts: (N, nb, S) every block's cache counts; the value
    sums C_b of block b's cache run through :func:`read_cache` from ``sums`` (N, S, Dv), block 0's, and the
    statistics ``add_values``, ``add_index`` / ``add_weights`` (:class:`CacheUpdates`) that each block adds for the
    next. All code arguments are None for window-only attention. Returns out (N, nb, L, Dv) and the cache after
    the last block (N, S, Dv) (None without codes).

    window_codes (N, nb, 2L), the code z_j of every window key (hard VQ): the window logits are then the code
    logits of those codes, code_logits[i, z_j] = σ q_i·c_{z_j}, gathered instead of multiplied, with the
    straight-through gradient: wk holds the raw keys, which get qbᵀ-weighted gradients as if they were the
    logits' keys, while q (through code_logits) gets the gradient of the codes.

    Hand-written forward and backward (flash-attention style: dS = P ⊙ (dP − rowsum(dO ⊙ O))): the two groups
    are never concatenated and only the probabilities are kept for the backward pass. The code means are never
    formed: the code probabilities are divided by the counts instead. Both run with autocast off, so a backward
    called inside autocast stays in the forward's dtype.
    """

    @staticmethod
    def forward(ctx, qb, wk, window_bias, code_logits, code_bias, wv, counts, sums, add_values, add_index,
                add_weights, window_codes=None, codebook=None):
        with no_autocast(wv.device):
            N, nb, W, _ = wv.shape
            L = window_bias.shape[-2]
            if codebook is not None:
                code_logits = code_logits_of(qb, codebook)
            if window_codes is not None:
                window_codes = window_codes.unsqueeze(2).expand(N, nb, L, W)
                p_window = code_logits.gather(-1, window_codes).add_(window_bias)  # (N, nb, L, 2L)
            elif wk is None:
                p_window = window_bias.expand(N, nb, L, W).clone()
            else:
                p_window = torch.matmul(qb, wk.transpose(-1, -2)).add_(window_bias)
            m = p_window.amax(-1, keepdim=True)  # finite: the diagonal is always visible
            p_codes = last = None
            if code_logits is not None:
                z_codes = torch.empty_like(m)
                tiny = torch.finfo(counts.dtype).tiny

                def probabilities(b, logits, out):  # exp(logit + log n − m) / n, and its row sums
                    torch.add(logits, code_bias[:, b].unsqueeze(-2), out=out)
                    m[:, b] = torch.maximum(m[:, b], out.amax(-1, keepdim=True))
                    floored_exp_(out.sub_(m[:, b]))
                    z_codes[:, b] = out.sum(-1, keepdim=True)
                    return out.div_(counts[:, b].clamp_min(tiny).unsqueeze(-2))  # empty codes: 0 / tiny

                p_codes, num, last = read_cache(code_logits, sums, CacheUpdates(add_values, add_index, add_weights),
                                                probabilities)
            floored_exp_(p_window.sub_(m))
            z = p_window.sum(-1, keepdim=True)  # (N, nb, L, 1)
            # p_* stay unnormalised: dividing the (L, Dv) output is cheaper than the (L, 2L + S) probabilities.
            out = torch.matmul(p_window, wv)
            if p_codes is not None:
                z.add_(z_codes)
                out.add_(num)
            out.div_(z)
        # With window codes the keys' values are not needed: their gradient ds_windowᵀ·qb does not read them.
        ctx.save_for_backward(qb, wk if window_codes is None else None, wv, counts, p_window, p_codes, out, z,
                              window_codes, codebook, sums, last, add_values, add_index, add_weights)
        ctx.window_bias_shape = window_bias.shape
        return out, last

    @staticmethod
    def backward(ctx, grad_out, grad_last):
        qb, wk, wv, counts, p_window, p_codes, out, z, window_codes, codebook, sums, last, *updates = \
            ctx.saved_tensors
        need = ctx.needs_input_grad  # p_codes: divided by the counts
        grads = [None] * 13
        with no_autocast(grad_out.device):
            grad_out = grad_out / z  # with P = p / z, every P-term below becomes a p-term of this scaled gradient
            delta = (grad_out * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
            ds_window = torch.matmul(grad_out, wv.transpose(-1, -2)).sub_(delta).mul_(p_window)  # (N, nb, L, 2L)
            if need[1]:
                grads[1] = torch.matmul(ds_window.transpose(-1, -2), qb)
            if need[2]:
                grads[2] = _sum_to_shape(ds_window, ctx.window_bias_shape)
            if need[5]:
                grads[5] = torch.matmul(p_window.transpose(-1, -2), grad_out)
            logit_grads = None
            if p_codes is not None:
                # (dO·mean_s − δ) p_s = (dO·C_s − δ n_s) p_s / n_s
                if need[6]:
                    p_delta = torch.matmul(p_codes.transpose(-1, -2), delta).squeeze(-1)  # (N, nb, S)
                # With window codes, q's window gradient goes through the code logits (scattered at z_j).
                logit_grads = LogitGradients(p_codes, q=qb, codebook=codebook, need_q=need[0], need_codebook=need[12],
                                             need_bias=need[4] or need[6], window_codes=window_codes,
                                             ds_window=ds_window)
                grads[7], grads[8], grads[10] = read_cache_backward(
                    p_codes, grad_out, sums, last, grad_last, CacheUpdates(*updates), need[8] or need[10],
                    lambda b, dp: dp.addcmul_(delta[:, b], counts[:, b].unsqueeze(-2), value=-1), logit_grads)
                grads[3], grads[4], grads[12] = logit_grads.logits, logit_grads.bias, logit_grads.dc
                if need[6]:
                    # The counts enter as log n (code_bias) and as mean = C / n, and the output only depends on
                    # e^{logit} C_s and e^{logit} n_s: d/dn through the mean is −(d/d bias + n pᵀδ) / n.
                    tiny = torch.finfo(counts.dtype).tiny
                    grads[6] = p_delta.mul_(counts).add_(logit_grads.bias).div_(counts.clamp_min(tiny)).neg_()
            if need[0]:
                if window_codes is None:
                    grads[0] = torch.matmul(ds_window, wk)
                if logit_grads is not None and logit_grads.dq is not None:
                    grads[0] = logit_grads.dq if grads[0] is None else grads[0].add_(logit_grads.dq)
        return tuple(grads)


# Soft window terms floor the query-side code weights e^{σ q·c_s − max} at e^{−60}: a soft key's weights sum to 1,
# so the diagonal term alone keeps the normaliser ≥ e^{−60} (no 0/0, and gradients ≤ e^{60}·|dO| stay finite), while
# a code 60 nats below a query's best one changes its output by < e^{−60}·S·T relative, far below float32 rounding.
MIXTURE_FLOOR = -60.0


class MixtureAttention(torch.autograd.Function):
    """Soft codebook attention of every block's queries in linear form (no log/exp round trip):

        P_is  = exp(max(code_logits_is − m_i, −60)),  m_i = max_s code_logits_is          (N, nb, L, S)
        A_ij  = (P Wᵀ)_ij · window_mask_ij          window mixture Σ_s e^{σ q_i·c_s} Δ_js   (N, nb, L, W)
        Y     = A wv + P C_b                         numerator and normaliser              (N, nb, L, Dv + 1)
        out_i = Y_i[:Dv] / Y_i[Dv]                                                         (N, nb, L, Dv)

    The values carry a last column of ones (linear attention's normaliser as one more value column), so the
    cache C_b (S, Dv + 1) holds the value sums Σ_j Δ_js v_j and, in its last column, the counts n_s = Σ_j Δ_js:
    the counts need no prefix sum of their own, and their gradient reaches the weights with the values'.

    code_logits = q·cᵀ from the (scaled) queries q (N, nb, L, D) and the codebook c (N, S, D); weights W:
    (N, nb, W, S) the window keys' assignment (rows sum to 1); window_mask: 0/1, broadcastable to (N, nb, L, W);
    wv: (N, nb, W, Dv + 1) the window's values with the ones column; C_b runs through :func:`read_cache` from
    ``sums`` (N, S, Dv + 1) with the statistics ``add_values`` (N, nb, L, Dv + 1) and ``add_weights``
    (N, nb, L, S) each block adds for the next (None: the window's own wv and weights, when the window is the
    current block only and leaves it right after). This is :class:`WindowCodeAttention` with the mixture logits
    log(P Wᵀ) + m and the cache logits code_logits + log n, divided through by e^m: one exp of the code logits
    serves both. Returns out and the last cache (N, S, Dv + 1).
    """

    @staticmethod
    def forward(ctx, q, codebook, weights, window_mask, wv, sums, add_values, add_weights):
        with no_autocast(wv.device):
            def probabilities(b, logits, out):
                torch.sub(logits, logits.amax(-1, keepdim=True), out=out)
                return out.clamp_min_(MIXTURE_FLOOR).exp_()

            code_logits = code_logits_of(q, codebook)
            updates = CacheUpdates(wv, None, weights) if add_values is None else CacheUpdates(add_values, None,
                                                                                              add_weights)
            p, num, last = read_cache(code_logits, sums, updates, probabilities)
            a = torch.matmul(p, weights.transpose(-1, -2)).mul_(window_mask)  # (N, nb, L, W)
            total = torch.matmul(a, wv).add_(num)  # (N, nb, L, Dv + 1)
            den = total[..., -1:]
            out = total[..., :-1] / den
        ctx.save_for_backward(q, codebook, weights, window_mask, wv, p, a, out, den, sums, last, add_values,
                              add_weights)
        return out, last

    @staticmethod
    def backward(ctx, grad_out, grad_last):
        q, codebook, weights, window_mask, wv, p, a, out, den, sums, last, add_values, add_weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = [None] * 8
        with no_autocast(grad_out.device):
            # dY = [dout / den, −δ] with δ = Σ_d (dout / den)_d out_d: the normaliser's gradient
            grad_num = grad_out / den
            grad_total = torch.cat([grad_num, (grad_num * out).sum(-1, keepdim=True).neg_()], -1)
            grad_a = torch.matmul(grad_total, wv.transpose(-1, -2)).mul_(window_mask)  # (N, nb, L, W)
            if need[2]:
                grads[2] = torch.matmul(grad_a.transpose(-1, -2), p)
            if need[4]:
                grads[4] = torch.matmul(a.transpose(-1, -2), grad_total)
            # through exp (the max shift m cancels in out): p ⊙ (dY·C_bᵀ + dA·W)
            logit_grads = LogitGradients(p, q=q, codebook=codebook, need_q=need[0], need_codebook=need[1])
            own = add_values is None  # the updates are wv and weights: their gradients add up in grads[4], grads[2]
            updates = CacheUpdates(wv, None, weights) if own else CacheUpdates(add_values, None, add_weights)
            grads[5], grad_values, grad_weights = read_cache_backward(
                p, grad_total, sums, last, grad_last, updates, (need[4] or need[2]) if own else (need[6] or need[7]),
                lambda b, dp: dp.add_(grad_a[:, b] @ weights[:, b]), logit_grads,
                *((grads[4], grads[2]) if own else ()))
            if own:
                grads[4], grads[2] = grad_values, grad_weights
            else:
                grads[6], grads[7] = grad_values, grad_weights
            grads[0], grads[1] = logit_grads.dq, logit_grads.dc
        return tuple(grads)


def mixture_attention(q, codebook, weights, window_mask, wv, counts, sums, updates: CacheUpdates | None):
    """:class:`MixtureAttention` on (B, H, nb, ...) tensors (flattened to B·H), codebook (H, S, D); wv and the
    updates' values with their ones column (Dv + 1); the cache before the first block as ``counts`` (B, H, S) and
    ``sums`` (B, H, S, Dv); updates None for the window's own. Returns out (B, H, nb·L, Dv) and the counts
    (B, H, S) and sums (B, H, S, Dv) after the last block."""
    updates = updates or CacheUpdates(None, None, None)
    B, H = wv.shape[:2]
    flat = lambda x: x.reshape(B * H, *x.shape[2:])  # noqa: E731
    flat_or_none = lambda x: None if x is None else flat(x)  # noqa: E731
    cache = torch.cat([sums, counts.unsqueeze(-1)], -1)  # (B, H, S, Dv + 1)
    out, last = MixtureAttention.apply(flat(q), flat(codebook.expand(B, *codebook.shape)), flat(weights),
                                       window_mask, flat(wv), flat(cache), flat_or_none(updates.values),
                                       flat_or_none(updates.weights))
    last = last.view(B, H, *last.shape[1:])
    return out.view(B, H, -1, out.shape[-1]), last[..., -1], last[..., :-1]


def _sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = x.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return x.sum(dims, keepdim=True).view(shape) if dims else x


def window_code_attention(qb, wk, bias, wv, code_logits=None, code_bias=None, counts=None, sums=None,
                          updates: CacheUpdates | None = None, window_codes=None, codebook=None):
    """:class:`WindowCodeAttention` on (B, H, nb, ...) tensors (flattened to B·H for the kernel).

    bias: (nb, L, 2L) or (B, H, nb, L, 2L); the code logits are ``code_logits`` or, given the codebook (H, S, D),
    qb·cᵀ formed in the kernel; the codes' values are the caches C_b / counts, C_b from ``sums`` (B, H, S, Dv) and
    ``updates`` (:func:`read_cache`); window_codes (B, H, nb, 2L) for hard VQ's gathered window logits. Returns out
    (B, H, nb·L, Dv) and the cache after the last block (B, H, S, Dv), or None without codes.
    """
    B, H, nb, W, Dv = wv.shape
    flat = lambda x: None if x is None else x.reshape(B * H, *x.shape[2:])  # noqa: E731
    if bias.dim() == 5:
        bias = flat(bias)
    if codebook is not None:
        codebook = codebook.expand(B, *codebook.shape)
    updates = updates or CacheUpdates(None, None, None)
    out, last = WindowCodeAttention.apply(flat(qb), flat(wk), bias, flat(code_logits), flat(code_bias), flat(wv),
                                          flat(counts), flat(sums), *(flat(x) for x in updates), flat(window_codes),
                                          flat(codebook))
    return out.view(B, H, -1, Dv), None if last is None else last.view(B, H, *last.shape[1:])
