"""Sequential chains of small kernels replayed as one CUDA graph.

Some work is sequential by definition: ovq's online assignment reads the memory after block b − 1 to assign
block b. On a GPU each block is a few dozen kernels of microseconds each, so eager mode spends its time launching
them from Python (at T = 8192, 5069 launches and 163 ms of CPU time for 11 ms of GPU time per ovq step). A CUDA
graph captures the whole chain once per input signature and replays it with one launch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

MAX_GRAPHS = 8  # signatures kept (e.g. training, evaluation and prefill lengths); the oldest is dropped first


class _Captured:
    """A graph with its static inputs (copied into before each replay) and its static output."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], args: tuple):
        self.inputs = tuple(t.detach().clone() for t in inputs)
        # Warm up on a side stream, as graph capture requires: library handles and workspaces are made here.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*self.inputs, *args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs, *args)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for static, t in zip(self.inputs, inputs):
            static.copy_(t)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the static output


_GRAPHS: OrderedDict[tuple, _Captured] = OrderedDict()


def can_graph(*tensors: torch.Tensor) -> bool:
    """Whether :func:`replay_graphed` applies: CUDA tensors, and no graph being captured around us (the caller's
    capture, e.g. torch.compile's ``mode="reduce-overhead"``, then takes the chain in kernel by kernel)."""
    return all(t.is_cuda for t in tensors) and not torch.cuda.is_current_stream_capturing()


@torch.no_grad()
def replay_graphed(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], *args) -> torch.Tensor:
    """``fn(*inputs, *args)`` (no gradient) by replaying a CUDA graph of it, captured at the first call with these
    input shapes, dtypes and devices and these ``args`` (hashable), which the graph bakes in.

    ``fn`` must be a pure function of its inputs whose kernels read no host value (no ``.item()``, no
    data-dependent shapes): the graph replays the same kernels on new data. The first call per signature runs
    ``fn`` twice and synchronises the device (capture does); later ones copy the inputs in and launch once. Each
    kept signature holds device memory: a copy of its inputs, its output and the graph's pool of intermediates."""
    key = (fn, tuple((t.shape, t.dtype, t.device) for t in inputs), args)
    captured = _GRAPHS.get(key)
    if captured is None:
        with torch.cuda.device(inputs[0].device):
            captured = _Captured(fn, inputs, args)
        _GRAPHS[key] = captured
        while len(_GRAPHS) > MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    return captured(inputs)
