"""Linear-attention layers of the kernel family: Performer (FAVOR+), elu+1 and Taylor features."""

from __future__ import annotations

from ..feature_maps import EluFeatures, FeatureMap, PerformerFeatures, TaylorFeatures
from ..ops.blocks import check_block_len
from ..ops.linear import linear_attention
from .base import Attention, op_result


class FeatureMapAttention(Attention):
    """Linear attention φ(q)·φ(k) (``linear_attention``) with a feature map φ built by ``_make_features``.

    Decoding keeps ``LinearState``: Σ φ(k) vᵀ (M × Dv) and Σ φ(k) (M), constant memory per token.
    RoPE rotates q and k before φ. Every key's features are then fixed once computed, so the running sums
    stay valid; for Performer (E[φ(x)·φ(y)] = exp(s x·y), rotation-invariant ω) and Taylor (a polynomial in
    x·y) the kernel of rotated vectors depends on positions only through i − j, as in softmax RoPE.
    """

    def __init__(
        self, dim: int, num_heads: int, *, block_len: int | None = None, features: dict | None = None, **attention_kwargs
    ):
        """``features``: kwargs of the feature map; ``attention_kwargs`` go to :class:`Attention`."""
        super().__init__(dim, num_heads, **attention_kwargs)
        check_block_len(block_len)
        self.block_len = block_len
        self.features = self._make_features(self.head_dim, self.layer_idx, **(features or {}))

    def _make_features(self, head_dim: int, layer_idx: int, **kwargs) -> FeatureMap:
        raise NotImplementedError

    def _op_state_floats(self, seq_len: int) -> int:
        return self.num_heads * self.features.num_features(self.head_dim) * (self.head_dim + 1)  # Σφ(k)vᵀ, Σφ(k)

    def _attend(self, q, k, v, pos, state, return_state, cu_seqlens=None):
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        phi_q, phi_k, k_log_scale = self.features.map_qk(q, k)  # (B, H, T, M), (B, H, T) or None
        result = linear_attention(
            phi_q,
            phi_k,
            v,
            causal=True,
            k_log_scale=k_log_scale,
            block_len=self.block_len,
            state=state,
            return_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        out, op_state = op_result(result, return_state)
        return out, None, op_state


class PerformerAttention(FeatureMapAttention):
    """FAVOR+ (Performer): positive random features estimating exp(q·k / √D).

    ``num_features`` defaults to 4·head_dim. The draw of layer ``layer_idx`` uses ``seed + layer_idx`` so
    layers differ and every DDP rank derives the same ω (see :class:`~vqattn.feature_maps.PerformerFeatures`).
    """

    def _make_features(self, head_dim, layer_idx, *, num_features=None, seed=0, **kwargs):
        return PerformerFeatures(head_dim, num_features or 4 * head_dim, seed=seed + layer_idx, **kwargs)


class EluLinearAttention(FeatureMapAttention):
    """Linear transformer (Katharopoulos et al. 2020): φ(x) = elu(x) + 1."""

    def _make_features(self, head_dim, layer_idx, **kwargs):
        return EluFeatures(**kwargs)


class TaylorAttention(FeatureMapAttention):
    """Second-order Taylor kernel 1 + s q·k + (s q·k)²/2 with s = 1/√D (M = 1 + D + D(D+1)/2 features: each
    symmetric product once)."""

    def _make_features(self, head_dim, layer_idx, *, order=2, **kwargs):
        return TaylorFeatures(order, scale=head_dim**-0.5, **kwargs)
