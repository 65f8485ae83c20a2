"""Small configurations shared by the layer, model and generation tests."""

from __future__ import annotations

import torch

from vqattn.layers import ATTENTIONS
from vqattn.model import GPT, GPTConfig

NAMES = sorted(ATTENTIONS)
VQ_NAMES = ("vq_hard", "vq_soft")

# Blocks and chunks of 4 so that test lengths exercise the compressed cache and partial blocks.
SMALL_KWARGS = {
    "softmax": {},
    "vq_hard": {"num_codes": 8, "block_len": 4},
    "vq_soft": {"num_codes": 8, "block_len": 4},
    "window": {"block_len": 4},
    "performer": {"block_len": 4, "features": {"num_features": 16}},
    "linear": {"block_len": 4},
    "taylor": {"block_len": 4},
    "kernel_rbf": {},
    "kernel_poly": {"degree": 3},
    "kernel_linear": {},
    "ovq": {"num_slots": 8, "block_len": 4},
    # q, k and v each as wide as the model (16), in the order of the others' fused projection
    "gated_deltanet": {"head_dim": 8, "expand_v": 1, "block_len": 4},
    "deltanet": {"head_dim": 8, "expand_v": 1, "block_len": 4},
    # x̂, B and C each as wide as the model (16): the q/k rows of the fused projection come first, as in the others
    "mamba2": {"expand": 1, "d_state": 16, "block_len": 4},
}


def layer_kwargs(name: str, rope: bool = False) -> dict:
    """Constructor kwargs of a small layer; vq layers need the raw-key window for RoPE."""
    kwargs = dict(SMALL_KWARGS[name])
    if rope and name in VQ_NAMES:
        kwargs["exact_window"] = True
    return kwargs


# Every (attention, position scheme) pair the model supports.
COMBINATIONS = [(name, pos) for name in NAMES for pos in ("none", "learned", "rope")]


def scramble_short_conv(module, seed: int = 0):
    """Random weights for every short convolution in ``module``: they start as the identity, which would make a
    test of the convolution's state or causality pass without it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(getattr(layer, "conv", None), torch.nn.Conv1d):
                w = layer.conv.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=w.dtype))
    return module


def tiny_model(name: str, pos_emb: str = "rope", **overrides) -> GPT:
    """A float64 model in eval mode (no dropout, no codebook updates) for exact comparisons."""
    config = GPTConfig(
        vocab_size=17, seq_len=32, n_layer=2, n_head=2, n_embd=16, attention=name,
        attention_kwargs=layer_kwargs(name, rope=pos_emb == "rope"), pos_emb=pos_emb, **overrides,
    )
    return GPT(config).double().eval()


def layer_in_chunks(layer, x, sizes):
    """A layer's output over x (B, T, C) fed in consecutive chunks of the given sizes, carrying its state, and
    the final state."""
    outs, state, start = [], None, 0
    for size in sizes:
        out, _, state = layer(x[:, start : start + size], state, return_state=True)
        outs.append(out)
        start += size
    assert start == x.shape[1]
    return torch.cat(outs, dim=1), state


def decode_in_chunks(model, idx, sizes):
    """Logits from forward_step over consecutive chunks of the given sizes, and the final state."""
    logits, state, start = [], None, 0
    for size in sizes:
        out, state = model.forward_step(idx[:, start : start + size], state)
        logits.append(out)
        start += size
    assert start == idx.shape[1]
    return torch.cat(logits, dim=1), state
