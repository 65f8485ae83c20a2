"""Public functional API: attention ops on (B, H, T, D) tensors, as in ``F.scaled_dot_product_attention``."""

from .ops.softmax import softmax_attention
from .ops.vq import VQState, vq_assign, vq_attention

__all__ = ["softmax_attention", "vq_attention", "vq_assign", "VQState"]
