"""Building blocks that are not attention themselves, as flash-linear-attention's ``modules``: rotary position
embedding (:mod:`.rope`) and the short causal convolution (:mod:`.conv`)."""

from .conv import ShortConvolution
from .rope import pair_dims, rope_cos_sin, rope_frequencies, rope_rotate, rope_rotate_keeping

__all__ = ["ShortConvolution", "rope_rotate", "rope_rotate_keeping", "rope_cos_sin", "rope_frequencies", "pair_dims"]
