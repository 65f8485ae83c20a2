"""The short causal convolution over time of flash-linear-attention, H3, Based and Mamba."""

from __future__ import annotations

import torch
import torch.nn as nn


class ShortConvolution(nn.Conv1d):
    """A causal depthwise convolution over time, out_t = Σ_j w_j h_{t − K + 1 + j} per channel (K = kernel_size),
    initialised to the identity (w_{K−1} = 1), that continues a sequence from the K − 1 rows before it. A Conv1d
    itself, so its parameter is ``weight`` (channels, 1, K)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, 0, -1] = 1.0

    def forward(self, h: torch.Tensor, past: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, C) -> (out (B, T, C), the last K − 1 rows of [past, h] for the next chunk); ``past``
        (B, K − 1, C), the rows before h (zeros at the start of a sequence). ``positions`` (T,): each row's
        position in its own sequence, for packed sequences (:mod:`vqattn.ops.varlen`): a row then reads no row
        before its sequence's start (no ``past``)."""
        k = self.kernel_size[0]
        if positions is not None:
            return self._packed(h, positions), h[:, max(h.shape[1] - (k - 1), 0):]
        if past is None:
            past = h.new_zeros(h.shape[0], k - 1, h.shape[-1])
        full = torch.cat((past.to(h.dtype), h), dim=1)  # (B, K − 1 + T, C)
        if h.device.type == "cpu" and not torch.compiler.is_compiling():  # eager CPU (compiled graphs: inductor's)
            out = _CausalTaps.apply(full, self.weight[:, 0].t().to(h.dtype))  # (B, T, C), contiguous
        else:
            out = super().forward(full.transpose(1, 2)).transpose(1, 2)  # (B, T, C)
        return out, full[:, full.shape[1] - (k - 1):]

    def _packed(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """out_t = Σ_j w_{K−1−j} h_{t−j} over the lags j ≤ positions_t (the rows of t's own sequence)."""
        k, t = self.kernel_size[0], h.shape[1]
        w = self.weight[:, 0].to(h.dtype)  # (C, K)
        out = h * w[:, -1]
        for lag in range(1, min(k, t)):
            shifted = torch.nn.functional.pad(h, (0, 0, lag, 0))[:, :t]  # h_{t − lag}
            out = out + shifted * (positions >= lag).to(h.dtype)[:, None] * w[:, -1 - lag]
        return out


class _CausalTaps(torch.autograd.Function):
    """out_t = Σ_j w_j ⊙ full_{t+j} over the K taps, full (B, K − 1 + T, C), w (K, C) -> (B, T, C): the depthwise
    convolution on a CPU in eager mode, as K in-place multiply-adds in the (B, T, C) layout the projections have.
    Measured at T = 8192, 1024 channels, 4 taps, one thread, with the SiLU after it: forward and backward in about
    0.6× the time of Conv1d's (mkldnn's depthwise kernel, which needs channels-first copies of the input and its
    gradient, and whose transposed output made the SiLU run strided)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        K = w.shape[0]
        T = full.shape[1] - K + 1
        out = full[:, K - 1:] * w[K - 1]
        for j in range(K - 1):
            out.addcmul_(full[:, j:j + T], w[j])
        ctx.save_for_backward(full, w)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full, w = ctx.saved_tensors
        K, T = w.shape[0], grad.shape[1]
        grad = grad.contiguous()
        grad_full = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_full = torch.zeros_like(full)
            for j in range(K):
                grad_full[:, j:j + T].addcmul_(grad, w[j])
        if ctx.needs_input_grad[1]:
            product = torch.empty_like(grad)  # one buffer for the K products: no fresh pages per tap
            grad_w = torch.stack([torch.mul(full[:, j:j + T], grad, out=product).sum((0, 1)) for j in range(K)])
        return grad_full, grad_w
