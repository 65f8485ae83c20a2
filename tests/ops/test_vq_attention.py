import functools
import math

import pytest
import torch

from vqattn.functional import softmax_attention, vq_attention
from vqattn.ops.vq import DEFAULT_BLOCK_LEN

from memory_helpers import largest_tensor
from references import ref_softmax_attention, ref_vq_attention

F64 = torch.float64
ASSIGNS = ("hard", "soft")
ASSIGN_WINDOW = [(a, e) for a in ASSIGNS for e in (False, True)]


def make_inputs(B=2, H=3, T=50, D=8, S=16, Dv=None, dtype=F64, seed=0, shared_codebook=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, Dv or D, generator=g, dtype=dtype)
    c = torch.randn(*(() if shared_codebook else (H,)), S, D, generator=g, dtype=dtype)
    return q, k, v, c


def keys_on_codebook(c, B, H, T, seed=1):
    """Keys drawn from the codebook rows: hard VQ is then exact softmax attention."""
    g = torch.Generator().manual_seed(seed)
    cH = c if c.dim() == 3 else c.expand(H, -1, -1)
    z = torch.randint(cH.shape[1], (B, H, T), generator=g)
    return cH[torch.arange(H)[None, :, None], z]


def grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    g = torch.Generator().manual_seed(123)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 7, 100, 1000])
@pytest.mark.parametrize("block_len", [16, 64, None])
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, 1e-5)])
def test_hard_on_codebook_equals_softmax(causal, T, block_len, dtype, tol):
    q, _, v, c = make_inputs(B=1, H=2, T=T, D=16, S=32, dtype=dtype)
    k = keys_on_codebook(c, 1, 2, T)
    out = vq_attention(q, k, v, c, causal=causal, block_len=block_len)
    expected = softmax_attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=tol, rtol=0)


@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,block_len", [(1, 4), (5, 8), (37, 8), (64, 16), (100, 16), (300, None)])
def test_matches_quadratic_reference_outputs_and_grads(assign, causal, T, block_len, block_grouping):
    q, k, v, c = make_inputs(B=1, H=2, T=T, Dv=5)
    temperature = 0.7
    kw = dict(causal=causal, assign=assign, temperature=temperature)
    out, g = grads(lambda *x: vq_attention(*x, block_len=block_len, schedule=block_grouping, **kw), q, k, v, c)
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, block_len=block_len or DEFAULT_BLOCK_LEN, **kw), q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
def test_window_options_match_reference(assign, exact_window, block_grouping):
    q, k, v, c = make_inputs(T=45)
    kw = dict(causal=True, assign=assign, temperature=1.3, block_len=8, exact_window=exact_window)
    out, g = grads(lambda *x: vq_attention(*x, schedule=block_grouping, **kw), q, k, v, c)
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, **kw), q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("route", ["function", "impl"])
@pytest.mark.parametrize("assign", ASSIGNS)
@pytest.mark.parametrize("causal,exact_window", [(True, False), (True, True), (False, False)])
def test_library_definition_matches_the_independent_reference(assign, causal, exact_window, route):
    """naive_vq_attention, the library's own definition, called directly or as vq_attention(impl="naive"), against
    the tests' reference (outputs and gradients)."""
    from vqattn.functional import naive_vq_attention

    q, k, v, c = make_inputs(T=37, Dv=5)
    kw = dict(causal=causal, assign=assign, temperature=0.6, block_len=8, exact_window=exact_window)
    naive = naive_vq_attention if route == "function" else functools.partial(vq_attention, impl="naive")
    out, g = grads(lambda *x: naive(*x, **kw), q, k, v, c)
    ref, g_ref = grads(lambda *x: ref_vq_attention(*x, **kw), q, k, v, c)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip("qkvc", g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=f"grad of {name}")


def test_naive_impl_takes_no_state():
    q, k, v, c = make_inputs(T=9)
    with pytest.raises(ValueError, match="impl='naive' takes no state"):
        vq_attention(q, k, v, c, causal=True, impl="naive", return_state=True)


def test_exact_window_is_softmax_when_everything_is_in_the_window():
    q, k, v, c = make_inputs(T=30)
    out = vq_attention(q, k, v, c, causal=True, assign="soft", block_len=16, exact_window=True)
    torch.testing.assert_close(out, ref_softmax_attention(q, k, v, causal=True), atol=1e-12, rtol=0)


def test_shared_codebook_broadcasts_over_heads():
    q, k, v, c = make_inputs(T=33, shared_codebook=True)
    out = vq_attention(q, k, v, c, causal=True, assign="soft", block_len=8)
    out_h = vq_attention(q, k, v, c.expand(3, -1, -1).contiguous(), causal=True, assign="soft", block_len=8)
    torch.testing.assert_close(out, out_h, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, ref_vq_attention(q, k, v, c, causal=True, assign="soft", block_len=8))


def test_soft_gradcheck_including_codebook_and_temperature():
    q, k, v, c = (t.requires_grad_(True) for t in make_inputs(B=1, H=2, T=11, D=3, S=4))
    temperature = torch.tensor([0.8, 1.5], dtype=F64, requires_grad=True)

    def fn(q, k, v, c, temperature):
        return vq_attention(q, k, v, c, causal=True, assign="soft", temperature=temperature, block_len=4)

    assert torch.autograd.gradcheck(fn, (q, k, v, c, temperature))
    assert torch.autograd.gradcheck(
        lambda q, k, v, c, t: vq_attention(q, k, v, c, causal=False, assign="soft", temperature=t),
        (q, k, v, c, temperature),
    )


@pytest.mark.parametrize("causal", [True, False])
def test_soft_approaches_hard_as_temperature_goes_to_zero(causal):
    q, k, v, c = make_inputs(T=40)
    hard = vq_attention(q, k, v, c, causal=causal, block_len=8)
    errors = [
        (vq_attention(q, k, v, c, causal=causal, assign="soft", temperature=t, block_len=8) - hard).abs().max()
        for t in (1.0, 1e-1, 1e-2, 1e-3, 1e-4)
    ]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-9


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
def test_causality_future_keys_and_values_do_not_leak(assign, exact_window, block_grouping):
    q, k, v, c = make_inputs(T=53)
    kw = dict(causal=True, assign=assign, block_len=8, exact_window=exact_window, schedule=block_grouping)
    out = vq_attention(q, k, v, c, **kw)
    for t0 in (0, 9, 16, 30, 52):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t0 + 1 :] = torch.randn_like(k2[:, :, t0 + 1 :]) * 5
        v2[:, :, t0 + 1 :] = torch.randn_like(v2[:, :, t0 + 1 :]) * 5
        out2 = vq_attention(q, k2, v2, c, **kw)
        torch.testing.assert_close(out2[:, :, : t0 + 1], out[:, :, : t0 + 1], atol=1e-13, rtol=0)
        if t0 + 1 < 53:
            assert not torch.allclose(out2[:, :, t0 + 1 :], out[:, :, t0 + 1 :])


@pytest.mark.parametrize("assign,exact_window", ASSIGN_WINDOW)
def test_recurrent_state_matches_one_call(assign, exact_window, block_grouping):
    q, k, v, c = make_inputs(T=61)
    kw = dict(causal=True, assign=assign, block_len=8, exact_window=exact_window, schedule=block_grouping)
    full = vq_attention(q, k, v, c, **kw)
    pieces, state = [], None
    for a, b in [(0, 13), (13, 14), (14, 16), (16, 17), (17, 40), (40, 61)]:
        out, state = vq_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c, state=state, return_state=True, **kw)
        pieces.append(out)
        assert state.length == b and state.keys.shape[2] < 2 * 8
    torch.testing.assert_close(torch.cat(pieces, 2), full, atol=1e-12, rtol=0)


def test_default_block_len_and_short_sequences():
    q, k, v, c = make_inputs(T=DEFAULT_BLOCK_LEN + 3)
    torch.testing.assert_close(
        vq_attention(q, k, v, c, causal=True), ref_vq_attention(q, k, v, c, causal=True, block_len=DEFAULT_BLOCK_LEN)
    )


def test_empty_codes_and_large_logits_fp32_are_finite_and_accurate():
    # Only two of 64 codes are used by the keys; the query prefers an unused code by ~200 logits.
    torch.manual_seed(0)
    B, H, T, D, S = 1, 2, 300, 16, 64
    c = torch.randn(H, S, D, dtype=F64)
    c = c / c.norm(dim=-1, keepdim=True)
    k = c[:, :2][:, torch.randint(2, (T,))].unsqueeze(0)  # (1, H, T, D) on codes 0 and 1
    q = 100 * D**0.5 * c[:, 5:6].expand(H, T, D).unsqueeze(0) + 0.1 * torch.randn(B, H, T, D, dtype=F64)
    v = torch.randn(B, H, T, D, dtype=F64)
    logits = D**-0.5 * (q @ c.transpose(-1, -2))
    assert logits.abs().max() > 90
    for assign in ("hard", "soft"):
        ref = ref_vq_attention(q, k, v, c, causal=True, assign=assign, temperature=0.05, block_len=32)
        inputs = [x.float().requires_grad_() for x in (q, k, v, c)]
        out = vq_attention(*inputs, causal=True, assign=assign, temperature=0.05, block_len=32)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=2e-4)
        out.square().sum().backward()  # an empty best code: no 0/0 in the gradients
        assert all(torch.isfinite(x.grad).all() for x in inputs if x.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("assign", ["hard", "soft"])
def test_half_precision_is_computed_in_fp32(dtype, assign):
    q, k, v, c = make_inputs(T=45, D=16, S=32)
    k = keys_on_codebook(c, 2, 3, 45) if assign == "hard" else k
    half = [t.to(dtype) for t in (q, k, v, c)]
    out = vq_attention(*half, causal=True, assign=assign, block_len=16)
    ref = ref_vq_attention(*[t.double() for t in half], causal=True, assign=assign, block_len=16)
    assert out.dtype == dtype
    # Only the final rounding to the half dtype: fp32 accumulation keeps the error at half's resolution.
    torch.testing.assert_close(out.double(), ref, atol=2 * torch.finfo(dtype).eps, rtol=2 * torch.finfo(dtype).eps)


def test_no_t_by_t_tensor_in_causal_path():
    """Every intermediate of the causal path is O(T·(L + S)), never T×T."""
    T, L, S = 512, 16, 8
    q, k, v, c = make_inputs(B=1, H=1, T=T, D=4, S=S)
    biggest = largest_tensor(lambda: vq_attention(q, k, v, c, causal=True, block_len=L, assign="soft"))
    assert biggest <= T * (2 * L + S)
    assert biggest < T * T // 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0, assign="soft"), "temperature"),
        (dict(temperature=-1.0, assign="soft"), "temperature"),
        (dict(block_len=0), "block_len"),
        (dict(block_len=2.5), "block_len"),
        (dict(assign="fuzzy"), "assign"),
        (dict(assign="kernel"), "codebook_kernel_features"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    q, k, v, c = make_inputs(T=10)
    with pytest.raises(ValueError, match=match):
        vq_attention(q, k, v, c, causal=True, **kwargs)


def test_bad_shapes_devices_dtypes_raise_value_error():
    q, k, v, c = make_inputs(T=10)
    with pytest.raises(ValueError, match="codebook D"):
        vq_attention(q, k, v, c[..., :4], causal=True)
    with pytest.raises(ValueError, match="heads"):
        vq_attention(q, k, v, c[:2], causal=True)
    with pytest.raises(ValueError, match="dtype"):
        vq_attention(q, k, v, c.float(), causal=True)
    with pytest.raises(ValueError, match="dtype"):
        vq_attention(q, k.float(), v, c, causal=True)
    with pytest.raises(ValueError, match="same length"):
        vq_attention(q[:, :, :5], k, v, c, causal=True)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        vq_attention(q[0], k, v, c, causal=True)
    with pytest.raises(ValueError, match="k and v"):
        vq_attention(q, k, v[:, :, :4], c, causal=False)
    with pytest.raises(ValueError, match="causal"):
        vq_attention(q, k, v, c, causal=False, exact_window=True)
    with pytest.raises(ValueError, match="device"):
        vq_attention(q, k, v, c.to("meta"), causal=True)


def test_non_causal_accepts_different_key_length():
    q, k, v, c = make_inputs(T=20)
    out = vq_attention(q[:, :, :7], k, v, c, causal=False, assign="soft")
    torch.testing.assert_close(out, ref_vq_attention(q[:, :, :7], k, v, c, causal=False, assign="soft"))
    assert math.isfinite(out.sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_floored_exp_is_exp_above_the_floor_and_exactly_zero_below(dtype):
    from vqattn.ops.common.window_code_blocks import EXP_FLOOR, floored_exp_

    x = torch.tensor([0.0, -1.0, -30.0, EXP_FLOOR + 1, EXP_FLOOR + 0.5, EXP_FLOOR, -87.5, -200.0, float("-inf")],
                     dtype=dtype)
    y = floored_exp_(x.clone())
    kept = x > EXP_FLOOR + math.log(2)
    torch.testing.assert_close(y[kept], x[kept].exp(), rtol=0, atol=0)
    assert (y[~kept] == 0).all()


@pytest.mark.parametrize("num_blocks,bytes_per_block", [(1, 10**9), (100, 1), (100, 3 * 2**20), (7, 2**20)])
def test_block_groups_cover_the_blocks_in_order_under_the_budget(num_blocks, bytes_per_block):
    from vqattn.ops.blocks import GROUP_BYTES, block_groups

    groups = block_groups(num_blocks, bytes_per_block, torch.device("cpu"))
    assert [b for g in groups for b in range(*g)] == list(range(num_blocks))
    assert all((b1 - b0) * bytes_per_block <= GROUP_BYTES or b1 - b0 == 1 for b0, b1 in groups)
    assert block_groups(num_blocks, bytes_per_block, torch.device("meta")) == [(0, num_blocks)]


def test_long_sequence_runs_in_several_groups_and_matches_one_group():
    """At T = 4096, S = 512 the real budget splits the blocks; the result equals the single-group run."""
    from vqattn.ops.blocks import Schedule, block_groups
    from vqattn.ops.vq.chunk import block_bytes

    q, k, v, c = make_inputs(B=1, H=2, T=4096, D=16, S=512, dtype=torch.float32)
    assert len(block_groups(4096 // 64, block_bytes(1, 2, 64, 512, 4), torch.device("cpu"))) > 1
    for assign in ("hard", "soft"):
        out, g = grads(lambda *x: vq_attention(*x, causal=True, assign=assign, block_len=64), q, k, v, c)
        one, g_one = grads(lambda *x: vq_attention(*x, causal=True, assign=assign, block_len=64,
                                                   schedule=Schedule("loop", group_blocks=64)), q, k, v, c)
        torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
        for a, b in zip(g, g_one):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("assign", ASSIGNS)
def test_no_host_read_of_a_tensor_with_a_precomputed_assignment(assign, monkeypatch):
    """A training step (forward + backward) given the Assignment never reads a tensor value in Python, which on a
    GPU would be a host synchronisation (run as on a GPU: on a CPU in eager mode one flag is read on purpose)."""
    from vqattn.functional import vq_assign, window_attention
    from vqattn.ops import utils as op_utils

    monkeypatch.setattr(op_utils, "host_read_is_free", lambda x: False)
    q, k, v, c = (t.requires_grad_(True) for t in make_inputs(T=45))
    tau = torch.tensor([0.7, 1.1, 1.6], dtype=F64, requires_grad=True)
    a = vq_assign(k, c, assign=assign, temperature=tau)

    def forbidden(*args, **kwargs):
        raise AssertionError("Python-side read of a tensor")

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = vq_attention(q, k, v, c, causal=True, assign=assign, block_len=8, assignment=a)
    out = out + window_attention(q, k, v, block_len=8)
    out.sum().backward()
    monkeypatch.undo()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("op", ["vq", "window"])
def test_a_multi_group_output_is_laid_out_time_major_so_merging_heads_is_a_view(op):
    """The groups' outputs are concatenated into (B, T, H, Dv) memory: a layer's merge of the heads is a view, and
    the values and gradients are those of one group (a plain concatenation)."""
    from vqattn.functional import window_attention
    from vqattn.ops.blocks import Schedule

    q, k, v, c = (t.requires_grad_(True) for t in make_inputs(B=2, H=3, T=45, D=8))
    run = {"vq": lambda schedule, *x: vq_attention(*x, c, causal=True, block_len=4, schedule=schedule),
           "window": lambda schedule, *x: window_attention(*x, block_len=4, schedule=schedule)}[op]
    out = run(Schedule("loop", group_blocks=3), q, k, v)  # 12 blocks in 4 groups
    merged = out.transpose(1, 2).reshape(2, 45, -1)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None  # a view, no copy
    grad = torch.randn_like(merged)
    got = torch.autograd.grad(merged, (q, k, v), grad)
    one = run(Schedule("loop", group_blocks=12), q, k, v)
    torch.testing.assert_close(out, one, rtol=1e-12, atol=1e-12)
    expected = torch.autograd.grad(one.transpose(1, 2).reshape(2, 45, -1), (q, k, v), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
