"""Online codebook attention (OVQ attention): a window of raw keys plus a per-sequence memory of slot means.

Notation (per batch and head): queries q_i, keys k_j, values v_j, scale σ, blocks of L = ``block_len`` positions
(block of position i: b(i) = ⌊i/L⌋), S = ``num_slots``. q̃, k̃ are the memory's query and key vectors: q, k
themselves by default (with RoPE applied by the caller, keys are summed after rotation), or the caller's
``q_mem``, ``k_mem`` (e.g. unrotated); with ``memory_first_pair`` m0, only their feature pairs (x_m, x_{m+D/2})
with m ≥ m0 (RoPE's slow pairs, :mod:`~vqattn.ops.common.pairs`).

**Memory.** M_j, the memory after block j, holds per slot s a count n_s, a key sum K_s = Σ k̃_j and a value sum
V_s = Σ v_j over the keys of blocks ≤ j assigned to s (with given weights: n_s = Σ w_js, K_s = Σ w_js k̃_j,
V_s = Σ w_js v_j). M_{−1} (and M_{−2}) is empty.

**Attention.** Query i of block b attends, in one softmax, to

* its raw window, keys j of blocks b−1 and b with j ≤ i, logit σ q_i·k_j, value v_j, and
* the memory M_{b−2}: every slot with n_s > 0, logit σ q̃_i·k̄_s + log n_s, value v̄_s = V_s / n_s, where
  k̄_s = K_s / n_s is the slot's mean key in this sequence, so keys get gradients through the memory.
  Empty slots drop out (log 0 = −inf) with no NaN in the outputs or the gradients.

So, with W(i) the window,

    out_i = [Σ_{j ∈ W(i)} e^{σ q_i·k_j} v_j + Σ_s n_s e^{σ q̃_i·k̄_s} v̄_s]
            / [Σ_{j ∈ W(i)} e^{σ q_i·k_j} + Σ_s n_s e^{σ q̃_i·k̄_s}]:

a Gaussian-mixture regression over the slots next to exact softmax over the window.

**Assignment.** The keys of block j are assigned using M_{j−1}, then absorbed: M_j = M_{j−1} + block j (g·M_{j−1}
+ block j with ``memory_decay``, :mod:`~vqattn.ops.common.memory_decay`). Block j
first reaches the queries of block j + 2, so every block is assigned in parallel within itself and causally.

* Given (``slots`` (B, H, T) in [0, S), −1 for a key not stored, or ``slot_weights`` (B, H, T, S) ≥ 0): e.g. a
  learned global codebook's hard argmin. The memory is then a prefix sum over blocks.
* Online (neither given). With the slots 0..m−1 of M_{j−1} opened (those with a positive count occupied: all of
  them, unless ``memory_decay`` took one to a zero count, which closes it for good), a key of block j is *novel*
  when ‖k̃ − k̄_s‖² > ``threshold``·‖k̃‖² for every occupied s (every key is novel when m = 0): the
  threshold is relative, so it means the same at any key scale. Novel keys open slots
  m, m+1, ... in position order while slots remain (a new slot starts at its opening key). A novel key that finds
  no free slot is not stored with ``overflow="drop"`` (slot −1), and joins its nearest slot with "nearest". Every
  other key joins the nearest slot among the occupied slots of M_{j−1} (at their mean keys k̄_s) and the slots
  opened in block j (at their opening keys); on a tie, the lowest slot index. The assignment carries no gradient
  (it is discrete).

Sequences shorter than 2L have an empty memory (window attention); T need not be a multiple of L.

**Forms** (flash-linear-attention's trio; all agree to rounding, tested in float64):

* :func:`naive_ovq_attention`: the definition, a loop over tokens.
* :func:`chunk_ovq_attention`: all blocks at once, for training and prefill; O(T·(L + S)·D), no T×T tensor.
* :func:`recurrent_ovq_attention`: decoding, O((2L + S)·D) per token with an :class:`OVQState`.

:func:`ovq_attention` picks one (``impl``). All compute in float32 for half-precision inputs and under autocast
(float64 stays float64) and return the input dtype. Nothing reads a tensor on the host.
"""

from .attention import IMPLS, chunk_ovq_attention, ovq_attention, recurrent_ovq_attention
from .naive import naive_ovq_attention
from .state import OVERFLOW, OVQState

__all__ = ["ovq_attention", "chunk_ovq_attention", "recurrent_ovq_attention", "naive_ovq_attention", "OVQState",
           "IMPLS", "OVERFLOW"]
