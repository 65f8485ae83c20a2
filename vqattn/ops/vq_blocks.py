"""The block kernel shared by :func:`~vqattn.ops.vq.vq_attention` and :func:`~vqattn.ops.window.window_attention`.

Queries run in blocks of L. Block b attends, with one softmax, to its window (blocks b−1 and b, causally masked)
and, for codebook attention, to S compressed "keys" (the codes, carrying per-block counts and value means of
blocks ≤ b−2). Window attention is the same kernel without the codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Measured in benchmarks/attention_speed.py (README): the fastest block length on CPU for S=512, D=64.
DEFAULT_BLOCK_LEN = 128


def no_autocast(device: torch.device):
    """The ops compute in float32 (or float64) whatever the ambient autocast says: their softmaxes over
    thousands of keys and the per-code sums lose 2-3 digits in bf16."""
    return torch.autocast(device_type=device.type, enabled=False)


def blocks(x: torch.Tensor, L: int) -> torch.Tensor:
    """(B, H, nb·L, ...) -> (B, H, nb, L, ...)."""
    return x.view(*x.shape[:2], x.shape[2] // L, L, *x.shape[3:])


def windows(x: torch.Tensor, L: int) -> torch.Tensor:
    """Previous block + current block: (B, H, nb·L, D) -> (B, H, nb, 2L, D); block 0's previous is zeros."""
    xb = blocks(x, L)
    previous = F.pad(xb, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    return torch.cat([previous, xb], dim=3)


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
    """(nb, L, 2L) additive mask: query i of block b sees window key jj iff jj ≤ i + L (causal); block 0 has no
    previous block."""
    i = torch.arange(L, device=device)[:, None]
    jj = torch.arange(2 * L, device=device)[None, :]
    bias = torch.zeros(num_blocks, L, 2 * L, device=device, dtype=dtype)
    bias.masked_fill_(jj > i + L, float("-inf"))
    bias[0, :, :L] = float("-inf")
    return bias


def lagged_prefix_sum(x: torch.Tensor, initial: torch.Tensor, lag: int = 2) -> torch.Tensor:
    """out[:, :, b] = initial + Σ_{b' ≤ b−lag} x[:, :, b'] for x (B, H, nb, ...): the cache of every block.

    It runs on the largest tensor of the algorithm, (B, H, nb, S, Dv). On CPU in eager mode an in-place loop
    over blocks (:class:`LaggedPrefixSum`) is 2.5-4× faster than ``torch.cumsum`` along the block dim
    (measured at nb = 64 and 256, S = 512, Dv = 64); on GPUs and under ``torch.compile`` one cumsum is one
    kernel instead of nb launches, and traces without graph breaks.
    """
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return LaggedPrefixSum.apply(x, initial, lag)
    return lagged_cumsum(x, initial, lag)


def lagged_cumsum(x: torch.Tensor, initial: torch.Tensor, lag: int = 2) -> torch.Tensor:
    """:func:`lagged_prefix_sum` as one ``torch.cumsum`` (autograd gives the reversed cumsum backward)."""
    nb = x.shape[2]
    shifted = F.pad(torch.cumsum(x[:, :, : max(nb - lag, 0)], 2), (0, 0) * (x.dim() - 3) + (lag, 0))[:, :, :nb]
    return initial.unsqueeze(2) + shifted


class LaggedPrefixSum(torch.autograd.Function):
    """:func:`lagged_prefix_sum` as an in-place loop over blocks, with its hand-written backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, initial: torch.Tensor, lag: int) -> torch.Tensor:
        x = x.contiguous()  # slices of a transposed layout make every add a strided gather
        out = torch.empty_like(x)
        out[:, :, :lag] = initial.unsqueeze(2)
        for b in range(lag, x.shape[2]):
            torch.add(out[:, :, b - 1], x[:, :, b - lag], out=out[:, :, b])
        ctx.lag = lag
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # d out[b] / d x[b'] = 1 for b ≥ b' + lag: lagged suffix sums of the incoming gradient.
        nb, lag = grad_out.shape[2], ctx.lag
        grad_out = grad_out.contiguous()  # matmul backward hands over transposed gradients
        grad_x = torch.empty_like(grad_out)
        grad_x[:, :, max(nb - lag, 0) :] = 0  # the last blocks are in nobody's cache
        if nb > lag:
            grad_x[:, :, nb - lag - 1] = grad_out[:, :, nb - 1]
            for b in range(nb - lag - 2, -1, -1):
                torch.add(grad_x[:, :, b + 1], grad_out[:, :, b + lag], out=grad_x[:, :, b])
        return grad_x, grad_out.sum(2), None


class WindowCodeAttention(torch.autograd.Function):
    """Softmax attention of every block's queries over two key groups, with one shared max:

        window  logits  qb·wkᵀ + window_bias        (N, nb, L, 2L)   values  wv     (N, nb, 2L, Dv)
        codes   logits  code_logits + code_bias     (N, nb, L, S)    values  sums / counts  (N, nb, S, Dv)

    qb: (N, nb, L, D) queries (already scaled); wk: (N, nb, 2L, D), or None (then qb is None too) when the
    window logits are all in window_bias (soft/kernel mixtures); window_bias: broadcastable to (N, nb, L, 2L);
    code_logits: (N, nb, L, S), code_bias: (N, nb, S), sums: (N, nb, S, Dv), counts: (N, nb, S), all None for
    window-only attention. Returns (N, nb, L, Dv).

    Hand-written forward and backward (flash-attention style: dS = P ⊙ (dP − rowsum(dO ⊙ O))): the two groups
    are never concatenated and only the probabilities are kept for the backward pass. The code means are never
    formed: the code probabilities are divided by the counts instead ((L, S) work, not a (S, Dv) tensor per
    block and its gradient). Both run with autocast off, so a backward called inside autocast stays in the
    forward's dtype.
    """

    @staticmethod
    def forward(ctx, qb, wk, window_bias, code_logits, code_bias, wv, sums, counts):
        with no_autocast(wv.device):
            N, nb, W, _ = wv.shape
            L = window_bias.shape[-2]
            p_window = window_bias.expand(N, nb, L, W).clone() if wk is None else \
                torch.matmul(qb, wk.transpose(-1, -2)).add_(window_bias)  # (N, nb, L, 2L)
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
        ctx.save_for_backward(qb, wk, wv, sums, counts, p_window, p_codes, out, z)
        ctx.window_bias_shape = window_bias.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qb, wk, wv, sums, counts, p_window, p_codes, out, z = ctx.saved_tensors  # p_codes: divided by counts
        need = ctx.needs_input_grad
        grads = [None] * 8
        with no_autocast(grad_out.device):
            grad_out = grad_out / z  # with P = p / z, every P-term below becomes a p-term of this scaled gradient
            delta = (grad_out * out).sum(-1, keepdim=True)  # (N, nb, L, 1)
            ds_window = torch.matmul(grad_out, wv.transpose(-1, -2)).sub_(delta).mul_(p_window)  # (N, nb, L, 2L)
            if need[0]:
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
                grads[3] = ds_codes if need[3] else None
                grads[4] = ds_codes.sum(2) if need[4] else None
                if need[6] or need[7]:
                    grads[6] = torch.matmul(p_codes.transpose(-1, -2), grad_out)  # d/d sums
                if need[7]:  # mean = sums / n: d/dn = −(d/d mean · sums) / n² = −(d/d sums · sums) / n
                    tiny = torch.finfo(counts.dtype).tiny
                    grads[7] = (grads[6] * sums).sum(-1).div_(counts.clamp_min(tiny)).neg_()
        return tuple(grads)


def _sum_to_shape(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    lead = x.dim() - len(shape)
    dims = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return x.sum(dims, keepdim=True).view(shape) if dims else x


def window_code_attention(qb, wk, bias, wv, code_logits=None, code_bias=None, sums=None, counts=None):
    """:class:`WindowCodeAttention` on (B, H, nb, ...) tensors (flattened to B·H for the kernel).

    bias: (nb, L, 2L) or (B, H, nb, L, 2L); the codes' values are sums / counts. Returns (B, H, nb·L, Dv).
    """
    B, H, nb, W, Dv = wv.shape
    flat = lambda x: None if x is None else x.reshape(B * H, *x.shape[2:])  # noqa: E731
    if bias.dim() == 5:
        bias = flat(bias)
    out = WindowCodeAttention.apply(flat(qb), flat(wk), bias, flat(code_logits), flat(code_bias), flat(wv),
                                    flat(sums), flat(counts))
    return out.view(B, H, -1, Dv)
