"""The ops' one precision rule: they compute in float32 (float64 stays float64) whatever the ambient autocast says.

Their softmaxes over thousands of keys, exp features and per-code sums lose 2-3 digits in bf16, so half-precision
inputs are computed in float32 (:func:`~vqattn.ops.checks.compute_dtype`) and autocast is switched off inside
(:func:`autocast_off`), forward and custom backward alike.
"""

from __future__ import annotations

import functools

import torch


def autocast_off(fn):
    """Run ``fn`` with autocast disabled on the device of its first tensor argument.

    Under ``torch.autocast`` the ops' matmuls would otherwise run in bf16/fp16 whatever the input dtype. The result
    keeps the dtype the op gives without autocast (the input's), which autocast's callers accept as is. Also used on
    the ``forward`` and ``backward`` of the ops' autograd Functions, so a backward called inside autocast stays in
    the forward's dtype.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:  # not a tensor: fn's own checks raise the ValueError
            return fn(*args, **kwargs)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
