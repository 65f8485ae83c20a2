"""How large the tensors an op creates get: the memory tests' check that no (T, T) tensor is formed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode


def largest_tensor(fn: Callable[[], object]) -> int:
    """The most elements of any tensor that a torch function returns while ``fn()`` runs."""
    biggest = 0

    class Track(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal biggest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    biggest = max(biggest, t.numel())
            return out

    with Track():
        fn()
    return biggest
