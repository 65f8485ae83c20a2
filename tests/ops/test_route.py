"""How far a newcomer must read: the modules of the package a fused vq call runs code in, from ``vq_attention`` to
its kernel launches, forward and backward (every module with a Python frame; the public re-exports, the package
``__init__`` files, left out). flash-linear-attention's chunked Gated DeltaNet reads about 13."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vqattn.functional import vq_attention

from triton_helpers import DEVICE, needs_triton

pytestmark = needs_triton
PACKAGE = Path(__import__("vqattn").__file__).parent
MOST = 12


def modules_run(fn) -> set[str]:
    """The package's modules (paths below vqattn/) in which ``fn()`` opens a Python frame."""
    seen = set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(PACKAGE)) and not path.endswith("__init__.py"):
            seen.add(str(Path(path).relative_to(PACKAGE)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("assign", ["hard", "soft"])
def test_a_fused_vq_call_runs_in_at_most_twelve_modules(assign):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    codebook = torch.randn(2, 24, 16, generator=g).to(DEVICE).requires_grad_()

    def call():
        out = vq_attention(q, k, v, codebook, causal=True, assign=assign, exact_window=assign == "soft",
                           block_len=16, impl="triton")
        out.sum().backward()

    modules = modules_run(call)
    assert any(m.startswith("ops/triton/") for m in modules)  # the trace sees the kernels' launches
    assert q.grad is not None and codebook.grad is not None
    assert len(modules) <= MOST, sorted(modules)
