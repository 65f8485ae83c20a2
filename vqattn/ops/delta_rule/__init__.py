"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): linear attention whose state is edited, not
only added to.

Per batch and head: queries q_t and keys k_t (Dk), values v_t (Dv), writing strengths β_t, log decays g_t ≤ 0 and a
state S (Dv × Dk) that maps a query to its output:

    S_t = exp(g_t) · S_{t−1} · (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    out_t = S_t (σ q_t),   σ = Dk^−½ by default.

For a unit key the update moves what the decayed state recalls for k_t, S' k_t, a fraction β_t of the way to v_t
(S_t = S' + β_t (v_t − S' k_t) k_tᵀ with S' = exp(g_t) S_{t−1}): the online least-squares step of Widrow and Hoff's
delta rule, which overwrites an association where linear attention (S_t = S_{t−1} + v_t k_tᵀ) only piles them up.
Without ``log_decay`` (g = 0) it is DeltaNet (Schlag et al. 2021; Yang et al. 2024); with it, Gated DeltaNet (Yang,
Kautz and Hatamizadeh 2025; Qwen3-Next's linear layers). It is flash-linear-attention's
``naive_recurrent_gated_delta_rule`` up to the layout: fla's tensors are (B, T, H, ·) and its state (Dk × Dv) is the
transpose of S here.

**Forms** (flash-linear-attention's; all agree to rounding, tested against the float64 definition):

* :func:`naive_delta_rule_attention`: the definition, token by token with the (Dk × Dk) erase matrix formed.
* :func:`chunk_delta_rule_attention`: the WY / UT-transform chunks (:mod:`.chunk`), O(T·C·(Dk + Dv) + T·Dk·Dv) for
  chunks of C = ``block_len``; the default for training and prefill on a CPU.
* :func:`recurrent_delta_rule_attention`: token by token in the rank-one form, O(Dv·Dk) per token: decoding.
* ``impl="triton"``: flash-linear-attention's Triton kernels on CUDA (:mod:`.fused`; ``pip install 'vqattn[fla]'``).

:func:`delta_rule_attention` picks one (``impl``). States continue a sequence (:class:`DeltaRuleState`), packed
sequences (``cu_seqlens``) each start from zero, and half-precision inputs are computed in float32 with a float32
state.
"""

from .attention import (
    IMPLS,
    chunk_delta_rule_attention,
    delta_rule_attention,
    naive_delta_rule_attention,
    recurrent_delta_rule_attention,
)
from .state import DeltaRuleState

__all__ = ["delta_rule_attention", "chunk_delta_rule_attention", "recurrent_delta_rule_attention",
           "naive_delta_rule_attention", "DeltaRuleState", "IMPLS"]
