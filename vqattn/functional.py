"""Public functional API: attention ops on (B, H, T, D) tensors, as in ``F.scaled_dot_product_attention``."""

from .ops.decay import DecayState, decay_attention
from .ops.delta_rule import DeltaRuleState, delta_rule_attention
from .ops.kernel import kernel_attention
from .ops.linear import LinearState, linear_attention
from .ops.ovq import OVQState, ovq_attention
from .ops.softmax import softmax_attention
from .ops.vq import Assignment, Schedule, SoftMixture, VQState, naive_vq_attention, vq_assign, vq_attention
from .ops.window import WindowState, naive_window_attention, window_attention

__all__ = [
    "softmax_attention",
    "vq_attention",
    "vq_assign",
    "naive_vq_attention",
    "Schedule",
    "Assignment",
    "SoftMixture",
    "VQState",
    "window_attention",
    "naive_window_attention",
    "WindowState",
    "linear_attention",
    "LinearState",
    "decay_attention",
    "DecayState",
    "kernel_attention",
    "ovq_attention",
    "OVQState",
    "delta_rule_attention",
    "DeltaRuleState",
]
