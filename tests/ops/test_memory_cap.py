"""``memory_cap``: the memory (codes, slots) weighs as if it held at most M keys. Every impl against the float64
reference (tests/references.py), outputs and gradients, at lengths that are not multiples of the block, and state
continuation; a cap no query's memory reaches changes nothing (what a model trained at T ≤ M computes)."""

import pytest
import torch

from vqattn.functional import vq_attention
from vqattn.ops.blocks import Schedule

from references import ref_vq_attention
from triton_helpers import DEVICE, as_impl_runs, triton_marked

F64 = torch.float64
L, CAP = 16, 40  # the bias starts at block 4 (n = 48 > 40 keys before the window)
IMPLS = {
    "naive": dict(impl="naive"),
    "chunk-loop": dict(impl="chunk", schedule=Schedule("loop", 3)),
    "chunk-cumsum": dict(impl="chunk", schedule=Schedule("cumsum", 3)),
    "recurrent": dict(impl="recurrent"),
    "triton": dict(impl="triton"),  # float32, on the GPU, or under Triton's interpreter without one (conftest)
}
CASES = [("hard", False), ("hard", True), ("soft", True)]  # assign, exact_window (with rotated q and k)


def inputs(T=110, *, B=1, H=2, D=8, S=6, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k, v, q_rot, k_rot, grad = (torch.randn(B, H, T, D, generator=g, dtype=F64).to(dtype) for _ in range(6))
    return dict(q=q, k=k, v=v, codebook=torch.randn(H, S, D, generator=g, dtype=F64).to(dtype),
                q_rot=q_rot, k_rot=k_rot), grad


def run(fn, tensors, grad, exact_window):
    names = ["q", "k", "v", "codebook"] + (["q_rot", "k_rot"] if exact_window else [])
    leaves = {n: tensors[n].detach().clone().requires_grad_() for n in names}
    out = fn(**leaves)
    out.backward(grad.to(out.dtype))
    # None: no gradient (a hard key scored only by the rotated window reaches the output through nothing else)
    return [out.detach().double()] + [None if leaves[n].grad is None else leaves[n].grad.double() for n in names]


def relative_errors(got, ref):
    assert [a is None for a in got] == [b is None for b in ref]
    return [((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(got, ref) if a is not None]


@pytest.mark.parametrize("impl", triton_marked(IMPLS))
@pytest.mark.parametrize("assign,exact_window", CASES)
def test_every_impl_matches_the_reference(impl, assign, exact_window):
    dtype = torch.float32 if impl == "triton" else F64
    tensors, grad = inputs(dtype=dtype)
    kw = dict(causal=True, assign=assign, block_len=L, exact_window=exact_window, memory_cap=CAP)
    if not exact_window:
        tensors = {**tensors, "q_rot": None, "k_rot": None}
    got = run(as_impl_runs(lambda **t: vq_attention(**t, **kw, **IMPLS[impl]), impl), tensors, grad, exact_window)
    ref = run(lambda **t: ref_vq_attention(**{n: x.double() for n, x in t.items()}, causal=True, assign=assign,
                                           block_len=L, exact_window=exact_window, memory_cap=CAP),
              tensors, grad, exact_window)
    uncapped = run(lambda **t: ref_vq_attention(**{n: x.double() for n, x in t.items()}, causal=True, assign=assign,
                                                block_len=L, exact_window=exact_window), tensors, grad, exact_window)
    assert (got[0] - uncapped[0]).abs().max() > 1e-3  # the cap is active at this length
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    assert max(relative_errors(got, ref)) < tolerance


@pytest.mark.parametrize("impl", triton_marked(["chunk", "recurrent", "triton"]))
@pytest.mark.parametrize("assign,exact_window", CASES)
def test_chunked_calls_continue_the_capped_state(impl, assign, exact_window):
    dtype = torch.float32 if impl == "triton" else F64
    tensors, _ = inputs(T=150, dtype=dtype)
    if impl == "triton":
        tensors = {n: x.to(DEVICE) for n, x in tensors.items()}
    if not exact_window:
        tensors = {**tensors, "q_rot": None, "k_rot": None}
    kw = dict(causal=True, assign=assign, block_len=L, exact_window=exact_window, memory_cap=CAP, impl=impl)
    whole = vq_attention(**tensors, **kw)
    state, parts = None, []
    for a, b in ((0, 45), (45, 96), (96, 150)):
        part = {n: None if x is None or n == "codebook" else x[:, :, a:b] for n, x in tensors.items()}
        out, state = vq_attention(**{**part, "codebook": tensors["codebook"]}, state=state, return_state=True, **kw)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=1e-4 if dtype != F64 else 1e-10,
                               atol=1e-5 if dtype != F64 else 1e-12)


@pytest.mark.parametrize("impl", ["naive", "chunk", "recurrent"])
def test_a_cap_no_memory_reaches_changes_nothing(impl):
    tensors, _ = inputs(T=110)
    kw = dict(causal=True, assign="soft", block_len=L, exact_window=True, impl=impl)
    # the last query's memory holds (110 // 16 − 1)·16 = 80 keys
    torch.testing.assert_close(vq_attention(**tensors, **kw, memory_cap=80), vq_attention(**tensors, **kw),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(memory_cap=0), "memory_cap must be a positive int"),
    (dict(memory_cap=True), "memory_cap must be a positive int"),
    (dict(memory_cap=2.5), "memory_cap must be a positive int"),
    (dict(memory_cap=16, assign="soft", exact_window=False), "memory_cap bounds the causal memory"),
    (dict(memory_cap=16, causal=False), "memory_cap bounds the causal memory"),
])
def test_bad_caps_are_one_line_errors(kwargs, message):
    tensors, _ = inputs(T=20)
    kw = {**dict(causal=True, assign="hard", block_len=L), **kwargs}
    with pytest.raises(ValueError, match=message):
        vq_attention(tensors["q"], tensors["k"], tensors["v"], tensors["codebook"], **kw)


OVQ_IMPLS = {  # ovq_attention's impl; the chunk impl's schedules through chunk_ovq_attention
    "chunk-loop": dict(schedule=Schedule("loop", 3)),
    "chunk-cumsum": dict(schedule=Schedule("cumsum", 3)),
    "recurrent": dict(impl="recurrent"),
    "triton": dict(impl="triton"),
}


def ovq_inputs(T=110, *, dtype=F64, given: str = "online"):
    tensors, grad = inputs(T, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    extra = {}
    if given == "weights":  # a given soft assignment, with gradients
        extra["slot_weights"] = torch.rand(1, 2, T, 6, generator=g, dtype=F64).to(dtype)
    return dict(q=tensors["q"], k=tensors["k"], v=tensors["v"], q_mem=tensors["q_rot"], k_mem=tensors["k_rot"],
                **extra), grad


@pytest.mark.parametrize("impl", triton_marked(OVQ_IMPLS))
@pytest.mark.parametrize("given", ["online", "weights"])
def test_every_ovq_impl_matches_the_definition(impl, given):
    from vqattn.ops.ovq import chunk_ovq_attention, ovq_attention

    dtype = torch.float32 if impl == "triton" else F64
    tensors, grad = ovq_inputs(dtype=dtype, given=given)
    kw = dict(num_slots=6, block_len=L, memory_cap=CAP)

    def run_ovq(name, impl_kwargs):
        leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
        op = chunk_ovq_attention if "schedule" in impl_kwargs else ovq_attention
        out = as_impl_runs(lambda **t: op(**t, **kw, **impl_kwargs), name)(**leaves)
        out.backward(grad.to(out.dtype))
        return [out.detach().double()] + [leaves[n].grad.double() for n in sorted(leaves)]

    got, ref = run_ovq(impl, OVQ_IMPLS[impl]), run_ovq("naive", dict(impl="naive"))
    uncapped = ovq_attention(**tensors, num_slots=6, block_len=L, impl="naive")
    assert (ref[0] - uncapped.double()).abs().max() > 1e-3  # the cap is active at this length
    assert max(relative_errors(got, ref)) < (1e-4 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_chunked_ovq_calls_continue_the_capped_state(impl):
    from vqattn.ops.ovq import ovq_attention

    tensors, _ = ovq_inputs(T=150)
    kw = dict(num_slots=6, block_len=L, memory_cap=CAP, impl=impl)
    whole = ovq_attention(**tensors, **kw)
    state, parts = None, []
    for a, b in ((0, 45), (45, 96), (96, 150)):
        out, state = ovq_attention(**{n: x[:, :, a:b] for n, x in tensors.items()}, state=state, return_state=True,
                                   **kw)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=1e-10, atol=1e-12)


def test_ovq_bad_cap_is_one_line_error():
    from vqattn.ops.ovq import ovq_attention

    tensors, _ = ovq_inputs(T=20)
    with pytest.raises(ValueError, match="memory_cap must be a positive int"):
        ovq_attention(**tensors, num_slots=6, block_len=L, memory_cap=-3)

