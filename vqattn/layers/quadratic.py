"""Attentions whose decoding state is a KV cache or a raw window: exact softmax, the kernel smoothers and the
window-only control."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from ..ops.blocks import DEFAULT_BLOCK_LEN
from ..ops.kernel import kernel_attention
from ..ops.softmax import softmax_attention
from ..ops.utils import check_choice, check_positive_int
from ..ops.varlen import Segments
from ..ops.window import IMPLS as WINDOW_IMPLS
from ..ops.window import window_attention
from .base import Attention, CachedAttention, op_result


class SoftmaxAttention(CachedAttention):
    """Exact causal softmax attention (SDPA)."""

    def _quadratic(self, q, k, v):
        past, t = k.shape[2] - q.shape[2], q.shape[2]
        if past == 0:
            return softmax_attention(q, k, v, causal=True)
        # Query i sits at position past + i and sees keys 0..past+i.
        rows = torch.arange(t, device=q.device)[:, None] + past
        mask = torch.arange(past + t, device=q.device)[None, :] <= rows  # (T, P+T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _packed_quadratic(self, q, k, v, cu_seqlens):
        return softmax_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)


class KernelSmootherAttention(CachedAttention):
    """Kernel-smoother attention (Tsai et al. 2019) with an explicit kernel: ``kernel_attention``.

    The analysis baseline of the kernel family, quadratic in T: ``kernel_rbf`` (exp(−s‖q − k‖²/2)),
    ``kernel_poly`` ((s q·k)^degree, default degree 2) and ``kernel_linear`` (s q·k, signed, count-normalised).
    """

    kernel: ClassVar[str]

    def __init__(self, dim: int, num_heads: int, *, degree: int = 2, **attention_kwargs):
        super().__init__(dim, num_heads, **attention_kwargs)
        check_positive_int("degree", degree)
        self.degree = degree

    def _quadratic(self, q, k, v):
        return kernel_attention(q, k, v, kernel=self.kernel, causal=True, degree=self.degree)

    def _packed_quadratic(self, q, k, v, cu_seqlens):
        if not isinstance(cu_seqlens, Segments):
            return super()._packed_quadratic(q, k, v, cu_seqlens)
        return kernel_attention(q, k, v, kernel=self.kernel, causal=True, degree=self.degree,
                                mask=cu_seqlens.document_mask())


class RBFSmootherAttention(KernelSmootherAttention):
    kernel = "rbf"


class PolySmootherAttention(KernelSmootherAttention):
    kernel = "poly"


class LinearSmootherAttention(KernelSmootherAttention):
    kernel = "linear"



class WindowAttention(Attention):
    """The control for codebook attention: causal softmax over exactly the raw window a vq layer keeps (the current
    and the previous block of ``block_len``), with the same RoPE, and no compressed cache (``window_attention``).

    Linear time; the decoding state holds under 2·block_len keys and values.
    """

    def __init__(self, dim: int, num_heads: int, *, block_len: int = DEFAULT_BLOCK_LEN, impl: str = "auto",
                 **attention_kwargs):
        """``impl``: the op's impl (``window_attention``'s: "auto" runs the Triton kernel on CUDA)."""
        super().__init__(dim, num_heads, **attention_kwargs)
        check_positive_int("block_len", block_len)
        check_choice("impl", impl, WINDOW_IMPLS)
        self.block_len, self.impl = block_len, impl

    def _attend(self, q, k, v, pos, state, return_state, cu_seqlens=None):
        q, k = self.rotate(q, pos), self.rotate(k, pos)  # the state keeps rotated keys, like a KV cache
        result = window_attention(q, k, v, block_len=self.block_len, state=state, return_state=return_state,
                                  impl=self.impl, cu_seqlens=cu_seqlens)
        out, op_state = op_result(result, return_state)
        return out, None, op_state

    def _op_state_floats(self, seq_len: int) -> int:
        return 2 * min(seq_len, 2 * self.block_len) * self.dim
