"""The block kernel shared by :func:`~vqattn.ops.vq.vq_attention` and :func:`~vqattn.ops.window.window_attention`.

Queries run in blocks of L. Block b attends, with one softmax, to its window (blocks b−1 and b, causally masked)
and, for codebook attention, to S compressed "keys" (the codes, carrying per-block counts and value means of
blocks ≤ b−2): :class:`WindowCodeAttention`. Window attention is the same kernel without the codes. Soft codebook
attention, whose window logits are mixtures over the codes, runs the same math in linear form:
:class:`MixtureAttention`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

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
    size = max(1, min(num_blocks, GROUP_BYTES // max(bytes_per_block, 1)))
    return [(b0, min(b0 + size, num_blocks)) for b0 in range(0, num_blocks, size)]


def split_groups(x: torch.Tensor, groups: list[tuple[int, int]], L: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For every group [b0, b1) of blocks: (x's blocks b0..b1−1, (B, H, (b1−b0)·L, ...); the block before b0,
    (B, H, L, ...), zeros for b0 = 0). x: (B, H, nb·L, ...).

    One split of x, so the backward pass assembles x's gradient with one cat; slicing each group out of x instead
    would zero-fill a gradient of x's full size for every group.
    """
    pieces = x.split([(b1 - b0) * L for b0, b1 in groups], dim=2)
    before = [x.new_zeros(*x.shape[:2], L, *x.shape[3:])] + [piece[:, :, -L:] for piece in pieces[:-1]]
    return list(zip(pieces, before))


def group_windows(piece: torch.Tensor, before: torch.Tensor, L: int) -> torch.Tensor:
    """Windows (previous block + current block) of a group's blocks, from :func:`split_groups`: (B, H, n, 2L, D)."""
    previous = torch.cat([before, piece[:, :, :-L]], dim=2)
    return torch.cat([blocks(previous, L), blocks(piece, L)], dim=3)


def prefix_sum(chunks: Sequence[torch.Tensor], initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out[:, :, b] = initial + Σ_{b' ≤ b} x[:, :, b'] for x, the concatenation of ``chunks`` (B, H, nb_i, ...)
    along the block dim: the caches of a group of blocks; returned with the last of them, out[:, :, −1], the next
    group's initial cache.

    The chunks are read in place: concatenating them would copy every statistic and cat its gradient again. On
    CPU in eager mode an in-place loop over blocks (:class:`PrefixSum`) is 2.5-4× faster than ``torch.cumsum``
    along the block dim (measured at nb = 64 and 256, S = 512, Dv = 64), and it hands out the last cache as its own
    output: selecting it from ``out`` would zero-fill a gradient of out's full size in the backward pass. On GPUs
    and under ``torch.compile`` one cumsum is one kernel instead of nb launches, and traces without graph breaks.
    """
    if initial.device.type == "cpu" and not torch.compiler.is_compiling():
        return PrefixSum.apply(initial, *chunks)
    out = initial.unsqueeze(2) + torch.cumsum(torch.cat(list(chunks), 2), 2)
    return out, out[:, :, -1]


class PrefixSum(torch.autograd.Function):
    """:func:`prefix_sum` as an in-place loop over blocks, with its hand-written backward."""

    @staticmethod
    def forward(ctx, initial: torch.Tensor, *chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.sizes = [chunk.shape[2] for chunk in chunks]
        out = initial.new_empty(*initial.shape[:2], sum(ctx.sizes), *initial.shape[2:])
        previous, b = initial, 0
        for chunk in chunks:
            chunk = chunk.contiguous()  # slices of a transposed layout make every add a strided gather
            for j in range(chunk.shape[2]):
                previous = torch.add(previous, chunk[:, :, j], out=out[:, :, b])
                b += 1
        return out, out[:, :, -1].clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_last: torch.Tensor):
        # d out[b] / d x[b'] = 1 for b ≥ b', and the last cache is out[nb − 1]: suffix sums of the gradients.
        # (Autograd hands over zeros for an output that was not used.)
        grad_out = grad_out.contiguous()  # matmul backward hands over transposed gradients
        grad_x = torch.empty_like(grad_out)
        nb = grad_out.shape[2]
        torch.add(grad_out[:, :, nb - 1], grad_last, out=grad_x[:, :, nb - 1])
        for b in range(nb - 2, -1, -1):
            torch.add(grad_x[:, :, b + 1], grad_out[:, :, b], out=grad_x[:, :, b])
        return grad_x[:, :, 0].clone(), *grad_x.split(ctx.sizes, 2)


class WindowCodeAttention(torch.autograd.Function):
    """Softmax attention of every block's queries over two key groups, with one shared max:

        window  logits  qb·wkᵀ + window_bias        (N, nb, L, 2L)   values  wv     (N, nb, 2L, Dv)
        codes   logits  code_logits + code_bias     (N, nb, L, S)    values  sums / counts  (N, nb, S, Dv)

    qb: (N, nb, L, D) queries (already scaled); wk: (N, nb, 2L, D), or None (then qb is None too) when the
    window logits are all in window_bias (soft/kernel mixtures); window_bias: broadcastable to (N, nb, L, 2L);
    code_logits: (N, nb, L, S), code_bias: (N, nb, S), sums: (N, nb, S, Dv), counts: (N, nb, S), all None for
    window-only attention. Returns (N, nb, L, Dv).

    window_codes (N, nb, 2L), the code z_j of every window key (hard VQ): the window logits are then the code
    logits of those codes, code_logits[i, z_j] = σ q_i·c_{z_j}, gathered instead of multiplied, with the
    straight-through gradient: wk holds the raw keys, which get qbᵀ-weighted gradients as if they were the
    logits' keys, while q (through code_logits) gets the gradient of the codes.

    Hand-written forward and backward (flash-attention style: dS = P ⊙ (dP − rowsum(dO ⊙ O))): the two groups
    are never concatenated and only the probabilities are kept for the backward pass. The code means are never
    formed: the code probabilities are divided by the counts instead ((L, S) work, not a (S, Dv) tensor per
    block and its gradient). Both run with autocast off, so a backward called inside autocast stays in the
    forward's dtype.
    """

    @staticmethod
    def forward(ctx, qb, wk, window_bias, code_logits, code_bias, wv, sums, counts, window_codes=None):
        with no_autocast(wv.device):
            N, nb, W, _ = wv.shape
            L = window_bias.shape[-2]
            if window_codes is not None:
                window_codes = window_codes.unsqueeze(2).expand(N, nb, L, W)
                p_window = code_logits.gather(-1, window_codes).add_(window_bias)  # (N, nb, L, 2L)
            elif wk is None:
                p_window = window_bias.expand(N, nb, L, W).clone()
            else:
                p_window = torch.matmul(qb, wk.transpose(-1, -2)).add_(window_bias)
            m = p_window.amax(-1, keepdim=True)  # finite: the diagonal is always visible
            p_codes = None
            if code_logits is not None:
                p_codes = code_logits + code_bias.unsqueeze(2)
                m = torch.maximum(m, p_codes.amax(-1, keepdim=True))
                p_codes.sub_(m).exp_()
            p_window.sub_(m).exp_()
            z = p_window.sum(-1, keepdim=True)  # (N, nb, L, 1)
            # p_* stay unnormalised: dividing the (L, Dv) output is cheaper than the (L, 2L + S) probabilities.
            out = torch.matmul(p_window, wv)
            if p_codes is not None:
                z.add_(p_codes.sum(-1, keepdim=True))
                p_codes.div_(counts.clamp_min(torch.finfo(counts.dtype).tiny).unsqueeze(2))  # empty codes: 0 / tiny
                out.add_(torch.matmul(p_codes, sums))
            out.div_(z)
        # With window codes the keys' values are not needed: their gradient ds_windowᵀ·qb does not read them.
        ctx.save_for_backward(qb, wk if window_codes is None else None, wv, sums, counts, p_window, p_codes, out, z,
                              window_codes)
        ctx.window_bias_shape = window_bias.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qb, wk, wv, sums, counts, p_window, p_codes, out, z, window_codes = ctx.saved_tensors  # p_codes: / counts
        need = ctx.needs_input_grad
        grads = [None] * 9
        with no_autocast(grad_out.device):
            grad_out = grad_out / z  # with P = p / z, every P-term below becomes a p-term of this scaled gradient
            delta = (grad_out * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
            ds_window = torch.matmul(grad_out, wv.transpose(-1, -2)).sub_(delta).mul_(p_window)  # (N, nb, L, 2L)
            if need[0] and window_codes is None:  # with window codes, q's window gradient goes through code_logits
                grads[0] = torch.matmul(ds_window, wk)
            if need[1]:
                grads[1] = torch.matmul(ds_window.transpose(-1, -2), qb)
            if need[2]:
                grads[2] = _sum_to_shape(ds_window, ctx.window_bias_shape)
            if need[5]:
                grads[5] = torch.matmul(p_window.transpose(-1, -2), grad_out)
            if p_codes is not None:
                # (dO·mean_s − δ) p_s = (dO·sums_s − δ n_s) p_s / n_s
                ds_codes = torch.matmul(grad_out, sums.transpose(-1, -2))
                ds_codes.addcmul_(delta, counts.unsqueeze(2), value=-1).mul_(p_codes)  # (N, nb, L, S)
                grads[4] = ds_codes.sum(2) if need[4] else None
                if need[3]:
                    grads[3] = ds_codes if window_codes is None else ds_codes.scatter_add_(-1, window_codes, ds_window)
                if need[6] or need[7]:
                    grads[6] = torch.matmul(p_codes.transpose(-1, -2), grad_out)  # d/d sums
                if need[7]:  # mean = sums / n: d/dn = −(d/d mean · sums) / n² = −(d/d sums · sums) / n
                    tiny = torch.finfo(counts.dtype).tiny
                    grads[7] = (grads[6] * sums).sum(-1).div_(counts.clamp_min(tiny)).neg_()
        return tuple(grads)


# Soft window terms floor the query-side code weights e^{σ q·c_s − max} at e^{−60}: a soft key's weights sum to 1,
# so the diagonal term alone keeps the normaliser ≥ e^{−60} (no 0/0, and gradients ≤ e^{60}·|dO| stay finite), while
# a code 60 nats below a query's best one changes its output by < e^{−60}·S·T relative, far below float32 rounding.
MIXTURE_FLOOR = -60.0


class MixtureAttention(torch.autograd.Function):
    """Soft codebook attention of every block's queries in linear form (no log/exp round trip):

        P_is  = exp(max(code_logits_is − m_i, −60)),  m_i = max_s code_logits_is          (N, nb, L, S)
        A_ij  = (P Wᵀ)_ij · window_mask_ij          window mixture Σ_s e^{σ q_i·c_s} Δ_js   (N, nb, L, W)
        out_i = (A wv + P sums)_i / (A 1 + P counts)_i                                        (N, nb, L, Dv)

    code_logits: (N, nb, L, S) σ q·cᵀ; weights W: (N, nb, W, S) the window keys' assignment (rows sum to 1);
    window_mask: 0/1, broadcastable to (N, nb, L, W); wv: (N, nb, W, Dv); sums: (N, nb, S, Dv), counts: (N, nb, S)
    the cache of every block. This is :class:`WindowCodeAttention` with the mixture logits log(P Wᵀ) + m and the
    cache logits code_logits + log n, divided through by e^m: one exp of the code logits serves both.
    """

    @staticmethod
    def forward(ctx, code_logits, weights, window_mask, wv, sums, counts):
        with no_autocast(wv.device):
            p = code_logits - code_logits.amax(-1, keepdim=True)
            p.clamp_min_(MIXTURE_FLOOR).exp_()  # (N, nb, L, S)
            a = torch.matmul(p, weights.transpose(-1, -2)).mul_(window_mask)  # (N, nb, L, W)
            den = torch.matmul(p, counts.unsqueeze(-1)).add_(a.sum(-1, keepdim=True))  # (N, nb, L, 1)
            out = torch.matmul(a, wv).add_(torch.matmul(p, sums)).div_(den)
        ctx.save_for_backward(weights, window_mask, wv, sums, counts, p, a, out, den)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, window_mask, wv, sums, counts, p, a, out, den = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = [None] * 6
        with no_autocast(grad_out.device):
            grad_num = grad_out / den  # d/d numerator; the denominator's gradient is −delta
            delta = (grad_num * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
            grad_a = torch.matmul(grad_num, wv.transpose(-1, -2)).sub_(delta).mul_(window_mask)  # (N, nb, L, W)
            if need[0]:
                grad_p = torch.matmul(grad_num, sums.transpose(-1, -2))
                grad_p.addcmul_(delta, counts.unsqueeze(-2), value=-1).add_(torch.matmul(grad_a, weights))
                grads[0] = grad_p.mul_(p)  # through exp; the max shift m cancels in out
            if need[1]:
                grads[1] = torch.matmul(grad_a.transpose(-1, -2), p)
            if need[3]:
                grads[3] = torch.matmul(a.transpose(-1, -2), grad_num)
            if need[4]:
                grads[4] = torch.matmul(p.transpose(-1, -2), grad_num)
            if need[5]:
                grads[5] = torch.matmul(p.transpose(-1, -2), delta).squeeze(-1).neg_()
        return tuple(grads)


def mixture_attention(code_logits, weights, window_mask, wv, sums, counts):
    """:class:`MixtureAttention` on (B, H, nb, ...) tensors (flattened to B·H). Returns (B, H, nb·L, Dv)."""
    B, H = wv.shape[:2]
    flat = lambda x: x.reshape(B * H, *x.shape[2:])  # noqa: E731
    out = MixtureAttention.apply(flat(code_logits), flat(weights), window_mask, flat(wv), flat(sums), flat(counts))
    return out.view(B, H, -1, wv.shape[-1])


def _sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = x.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return x.sum(dims, keepdim=True).view(shape) if dims else x


def window_code_attention(qb, wk, bias, wv, code_logits=None, code_bias=None, sums=None, counts=None,
                          window_codes=None):
    """:class:`WindowCodeAttention` on (B, H, nb, ...) tensors (flattened to B·H for the kernel).

    bias: (nb, L, 2L) or (B, H, nb, L, 2L); the codes' values are sums / counts; window_codes (B, H, nb, 2L) for
    hard VQ's gathered window logits. Returns (B, H, nb·L, Dv).
    """
    B, H, nb, W, Dv = wv.shape
    flat = lambda x: None if x is None else x.reshape(B * H, *x.shape[2:])  # noqa: E731
    if bias.dim() == 5:
        bias = flat(bias)
    out = WindowCodeAttention.apply(flat(qb), flat(wk), bias, flat(code_logits), flat(code_bias), flat(wv),
                                    flat(sums), flat(counts), flat(window_codes))
    return out.view(B, H, -1, Dv)
