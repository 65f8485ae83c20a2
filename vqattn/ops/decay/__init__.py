"""Linear attention with a per-head scalar decay: Mamba-2's SSD, flash-linear-attention's ``simple_gla``.

Per batch and head, with queries q_t, keys k_t (Dk), values v_t (Dv), log decays g_t ≤ 0 and scale σ, the state S
(Dv × Dk) and the outputs are

    S_t = exp(g_t) · S_{t−1} + v_t k_tᵀ,        out_t = S_t (σ q_t),

that is out_t = Σ_{s ≤ t} exp(G_t − G_s) (σ q_t·k_s) v_s with G_t = Σ_{u ≤ t} g_u: causal linear attention (identity
features, no normaliser) whose past fades by exp(g) per token. With every g_t = 0 it is
:func:`~vqattn.ops.linear.linear_attention` on q and k with ``normalizer="none"``. Mamba-2 is this recurrence with
k = B, q = C, v = Δ·x, g = Δ·A and σ = 1 (:class:`~vqattn.layers.mamba.Mamba2Attention`).

**Forms** (flash-linear-attention's; all agree to rounding, tested against a float64 reference and fla's own):

* :func:`naive_decay_attention`: the recurrence token by token in float64, the reference.
* :func:`chunk_decay_attention`: chunks of C = ``block_len`` tokens (default 64): inside a chunk the masked C × C
  weights exp(G_t − G_s) σ q_t·k_s, across chunks the state S. O(T·C·(Dk + Dv) + T·Dk·Dv), no T × T tensor; the
  CPU default.
* :func:`recurrent_decay_attention`: token by token from a :class:`DecayState`, O(Dk·Dv) per token: decoding.
* ``impl="triton"``: flash-linear-attention's Triton kernels (``fla.ops.simple_gla.chunk_simple_gla``, the
  ``fla-core`` package) on CUDA tensors; the "auto" default there when fla imports.

:func:`decay_attention` picks one (``impl``). Every form continues a ``state``, takes packed sequences
(``cu_seqlens``, :mod:`vqattn.ops.varlen`: a sequence's first token drops the state before it) and computes in
float32 for half-precision inputs (float64 stays float64) with a float32 state, returning v's dtype.
"""

from .attention import (
    IMPLS,
    DecayState,
    chunk_decay_attention,
    decay_attention,
    naive_decay_attention,
    recurrent_decay_attention,
)

__all__ = ["decay_attention", "chunk_decay_attention", "recurrent_decay_attention", "naive_decay_attention",
           "DecayState", "IMPLS"]
