"""Codebook attention: Transformer-VQ (hard) and its Gaussian-mixture generalisation (soft).

Notation (per batch and head): queries q_i, keys k_j, values v_j, codebook c_s (S codes), scale σ.
An assignment matrix Δ (T, S) spreads every key over the codes (:mod:`.assign`):

    hard    Δ_js = 1[s = argmin_s' ‖k_j − c_s'‖]                       (one-hot, straight-through)
    soft    Δ_js = softmax_s(−‖k_j − c_s‖² / 2τ)                        (GMM posterior p(s | k_j))

and attention reads the keys through the codes:

    out_i = Σ_s e^{σ q_i·c_s} Σ_j Δ_js v_j  /  Σ_s e^{σ q_i·c_s} Σ_j Δ_js          (j ≤ i when causal)

For hard Δ this is exactly softmax attention over the quantised keys k̂_j = c_{z_j}, and equals softmax
attention when the keys lie on the codebook. Causally, the keys of a query's window (its block and the one
before) are scored one by one, the older ones through the codes: :func:`.naive.naive_vq_attention` is the
definition, :mod:`.chunk` the block algorithm, :mod:`.recurrent` the decoding impl.

With the unnormalised Gaussian-kernel assignment the same formula is linear attention, and FAVOR+ (Performer)
for a random codebook: :func:`vqattn.analysis.codebook_kernel_features`.
"""

from ..blocks import DEFAULT_BLOCK_LEN, Schedule, window_start
from ..common.statistics import Assignment
from ..utils import RECURRENT_MAX_LEN
from .assign import ASSIGNMENTS, SoftMixture, vq_assign
from .attention import IMPLS, chunk_vq_attention, recurrent_vq_attention, vq_attention
from .naive import naive_vq_attention
from .state import VQState

__all__ = ["vq_attention", "chunk_vq_attention", "recurrent_vq_attention", "naive_vq_attention", "vq_assign",
           "Assignment", "SoftMixture", "VQState", "Schedule", "window_start", "ASSIGNMENTS", "IMPLS", "DEFAULT_BLOCK_LEN",
           "RECURRENT_MAX_LEN"]
