"""torch.compile of the codebook and window ops: one graph (fullgraph=True, so no graph break such as a host read of
a tensor can creep in), matching eager in outputs and gradients; the Triton forms (under the interpreter) as graph
breaks around their kernels. The codebook ops are traced and differentiated as inductor sees them (dynamo and AOT
autograd: the aot_eager backend), without generating code: inductor's code for them is checked in
tests/model/test_compile.py, on compiled models whose step holds them; the window op goes through inductor here."""

import pytest
import torch

from vqattn.functional import vq_attention, window_attention

from triton_helpers import DEVICE, needs_triton

B, H, T, D, S, L = 2, 2, 37, 8, 16, 8  # T not a multiple of L


def _layer_like(op):
    """q, k, v as views of one projection and the output reshaped, as an attention layer does."""

    def f(x, *args):
        q, k, v = x.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        return op(q, k, v, *args).transpose(1, 2).reshape(B, T, H * D)

    return f


def _check(f, inputs, wrt, fullgraph=True, backend="aot_eager"):
    eager = f(*inputs)
    g_eager = torch.autograd.grad(eager.square().sum(), wrt)
    compiled = torch.compile(f, fullgraph=fullgraph, backend=backend)(*inputs)
    g_compiled = torch.autograd.grad(compiled.square().sum(), wrt)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("assign", ["hard", "soft"])
def test_vq_attention_compiles_and_matches_eager(assign):
    torch.manual_seed(0)
    x = torch.randn(B, T, 3 * H * D, requires_grad=True)
    c = torch.randn(H, S, D, requires_grad=assign == "soft")
    tau = torch.tensor([0.7, 1.2], requires_grad=True)  # a learned temperature: no host read under compile

    def op(q, k, v, c, tau):
        return vq_attention(q, k, v, c, causal=True, assign=assign, temperature=tau, block_len=L)

    _check(_layer_like(op), (x, c, tau), (x, c, tau) if assign == "soft" else (x,))


@pytest.mark.slow
def test_window_attention_compiles_and_matches_eager():
    torch.manual_seed(1)
    x = torch.randn(B, T, 3 * H * D, requires_grad=True)
    _check(_layer_like(lambda q, k, v: window_attention(q, k, v, block_len=L)), (x,), (x,), backend="inductor")


@pytest.mark.slow
@needs_triton
def test_triton_impls_compile_around_their_kernels():
    """impl="triton" under torch.compile: every kernel launch is a graph break (dynamo does not trace into the
    kernels' autograd functions), and the compiled call matches eager (soft: the cache walk's gradients reach the
    weights and the codebook too)."""
    torch.manual_seed(2)
    x = torch.randn(B, T, 3 * H * D, device=DEVICE, requires_grad=True)
    c = torch.randn(H, S, D, device=DEVICE, requires_grad=True)

    def op(q, k, v, c):
        return vq_attention(q, k, v, c, causal=True, assign="soft", block_len=16, exact_window=True,
                            q_rot=q.flip(-1), k_rot=k.flip(-1), impl="triton")

    _check(_layer_like(op), (x, c), (x, c), fullgraph=False)


def test_replaced_records_cross_a_graph_break():
    """An op's record copied inside a compiled function and alive across a graph break, as it is at every Triton
    kernel launch, comes out as its class with the fields changed and the rest kept (torch 2.11's dynamo could not
    rebuild ``_replace``'s copies there)."""
    from vqattn.ops.blocks import as_schedule
    from vqattn.ops.utils import replaced
    from vqattn.ops.vq.state import Inputs

    def f(q, x):
        y = replaced(x, q=q * 2, bad=None)
        torch._dynamo.graph_break()
        return y, y.q + 1

    q = torch.randn(1, 1, 3, 2)
    x = Inputs(q, q, q, q, None, None, None, q[..., 0] > 0, "hard", 1.0, 4, 0.5, False, as_schedule("auto"))
    y, q1 = torch.compile(f)(q, x)
    assert type(y) is Inputs and y.bad is None and y.assign == "hard" and y.block_len == 4
    torch.testing.assert_close(y.q, 2 * q)
    torch.testing.assert_close(q1, 2 * q + 1)
