"""Attention layers (nn.Modules) built on the functional ops, and a registry to pick them by name.

Every layer maps x: (B, T, C) -> (B, T, C) and is causal. It owns

* a fused q/k/v projection and an output projection,
* optional per-head normalisation of q and k (``qk_norm``: RMS as in Transformer-VQ, or L2 with a learned scale),
* optional rotary position embedding (``rope``); learned absolute positions live in the model,
  so a layer with ``rope=False`` is position-free,
* ``usage_stats()``: codebook usage for vq layers, memory occupancy for ovq, ``{}`` otherwise,
* a recurrent decoding path: ``forward(x, state, return_state=True)`` consumes a chunk of tokens that
  follows the tokens summarised by ``state`` and returns the state after the chunk. Feeding a sequence in
  chunks gives the same outputs as one call on the whole sequence.

``forward`` returns an :class:`AttentionOutput` ``(output, aux_loss, state)``: the auxiliary loss (the commitment
loss for vq layers, a zero scalar otherwise) is returned, never stashed on the module, so activation checkpointing
and ``torch.compile`` see it as an ordinary output. Add it to your loss.

Build a layer with ``build_attention(name, dim=..., num_heads=..., **kwargs)``; ``ATTENTIONS`` maps each
name to its class.
"""


from __future__ import annotations

from ..modules.rope import rope_rotate
from .base import Attention, AttentionOutput, AttentionState, CachedAttention, KVCache
from .delta import DeltaNetAttention, GatedDeltaNetAttention
from .linear import EluLinearAttention, FeatureMapAttention, PerformerAttention, TaylorAttention
from .mamba import Mamba2Attention
from .ovq import OnlineVQAttention
from .quadratic import (
    KernelSmootherAttention,
    LinearSmootherAttention,
    PolySmootherAttention,
    RBFSmootherAttention,
    SoftmaxAttention,
    WindowAttention,
)
from .vq import VQAttention, VQHardAttention, VQSoftAttention

ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
    "vq_hard": VQHardAttention,
    "vq_soft": VQSoftAttention,
    "window": WindowAttention,
    "performer": PerformerAttention,
    "linear": EluLinearAttention,
    "taylor": TaylorAttention,
    "kernel_rbf": RBFSmootherAttention,
    "kernel_poly": PolySmootherAttention,
    "kernel_linear": LinearSmootherAttention,
    "ovq": OnlineVQAttention,
    "gated_deltanet": GatedDeltaNetAttention,
    "deltanet": DeltaNetAttention,
    "mamba2": Mamba2Attention,
}


def build_attention(name: str, **kwargs) -> Attention:
    """Instantiate the attention layer registered as ``name``; kwargs go to its constructor."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; valid names are: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name](**kwargs)


__all__ = [
    "ATTENTIONS", "Attention", "AttentionOutput", "AttentionState", "CachedAttention", "DeltaNetAttention",
    "EluLinearAttention", "GatedDeltaNetAttention",
    "FeatureMapAttention", "KVCache", "KernelSmootherAttention", "LinearSmootherAttention", "Mamba2Attention",
    "OnlineVQAttention",
    "PerformerAttention", "PolySmootherAttention", "RBFSmootherAttention", "SoftmaxAttention", "TaylorAttention", "VQAttention",
    "VQHardAttention", "VQSoftAttention", "WindowAttention", "build_attention", "rope_rotate",
]
