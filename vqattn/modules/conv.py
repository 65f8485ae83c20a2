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

    def forward(self, h: torch.Tensor, past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, C) -> (out (B, T, C), the last K − 1 rows of [past, h] for the next chunk); ``past``
        (B, K − 1, C), the rows before h (zeros at the start of a sequence)."""
        k = self.kernel_size[0]
        if past is None:
            past = h.new_zeros(h.shape[0], k - 1, h.shape[-1])
        full = torch.cat((past.to(h.dtype), h), dim=1)  # (B, K − 1 + T, C)
        out = super().forward(full.transpose(1, 2)).transpose(1, 2)  # (B, T, C)
        return out, full[:, full.shape[1] - (k - 1):]
