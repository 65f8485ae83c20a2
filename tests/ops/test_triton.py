"""The Triton forms of vq_attention and window_attention against the float64 definitions: outputs and every
input's gradient, by relative RMS (flash-linear-attention's measure). On a machine without a GPU the kernels run
under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on one with a GPU on CUDA; the references
run in float64 on the CPU. Shapes stay small: the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vqattn.layers import build_attention
from vqattn.ops.blocks import Schedule
from vqattn.ops.common.statistics import map_time
from vqattn.ops.triton.block_caches import block_caches
from vqattn.ops.triton.finite import nonfinite_rows
from vqattn.ops.triton.nearest import code_residuals, nearest_codes
from vqattn.ops.triton.rotation import rotate
from vqattn.ops.triton.soft import soft_weights
from vqattn.ops.utils import memory_order, triton
from vqattn.ops.vq import VQState, naive_vq_attention, vq_assign, vq_attention
from vqattn.ops.window import window_attention

from references import ref_window_attention
from triton_helpers import DEVICE, Allocations, compare, leaves, nan_empty, needs_triton, rel_rms  # noqa: F401 (a fixture)

pytestmark = [needs_triton, pytest.mark.usefixtures("nan_empty")]
B, H, D, DV, S, L = 2, 2, 16, 8, 24, 32


@pytest.mark.parametrize("T", [1, 20, 64, 100])
def test_window_attention(T):
    q, k, v = leaves((B, H, T, D), (B, H, T, D), (B, H, T, DV))
    compare(lambda q, k, v: ref_window_attention(q, k, v, block_len=L),
            lambda q, k, v: window_attention(q, k, v, block_len=L, impl="triton"), [q, k, v])


# (assign, window): the straight-through hard window, the raw-key window, and the raw window of RoPE's own
# queries and keys with the codes scored on fewer dims (as the layers call it)
ASSIGN_WINDOWS = [("hard", "codes"), ("hard", "exact"), ("soft", "exact"), ("hard", "rotated"), ("soft", "rotated")]


def vq_inputs(assign, window, T, scale=1.0, generator=None, batch=B):
    """The inputs of ``vq_call``. The interpreter's time grows with the programs, one per (sequence, head) and block:
    the variants of one algorithm run a ``batch`` of 1 (the tests of the definition, of strides and of layouts keep
    2 sequences, which tell a sequence's stride from a head's)."""
    Dc = D // 2 if window == "rotated" else D
    n = batch
    q, k, v, c = leaves((n, H, T, Dc), (n, H, T, D), (n, H, T, DV), (H, S, Dc), scale=scale, generator=generator)
    rotated = leaves((n, H, T, D), (n, H, T, D), scale=scale, generator=generator) if window == "rotated" else []
    return [q, k, v, c, *rotated]


def vq_call(attention, assign, window, impl=None, **kwargs):
    """attention(q, k, v, c[, q_rot, k_rot]) with the window's arguments; the rotated form gets the keys'
    assignment from the first D/2 dims of k (the codes' dims), computed from the inputs, as the layers pass it."""
    extra = {} if impl is None else {"impl": impl}

    def call(q, k, v, c, *rotated):
        kw = dict(causal=True, assign=assign, block_len=L, exact_window=window != "codes", **extra, **kwargs)
        if rotated:
            a = vq_assign(k[..., :c.shape[-1]], c, assign=assign)
            kw.update(q_rot=rotated[0], k_rot=rotated[1], assignment=a)
        return attention(q, k, v, c, **kw)

    return call


# A covering set: at T = 100 (4 blocks: caches and gathered keys of two blocks) every (assign, window), in B = 2
# sequences; T = 1 (one block) once for each of the three designs (hard keys' superblocks, the soft keys the op
# assigns itself, formed soft weights through the walks) and T = 40 (two blocks: an empty cache) for the hard windows
# T = 1 leaves out, in one sequence (the long case tells the strides apart).
@pytest.mark.parametrize("assign,window,T", [*((a, w, 100) for a, w in ASSIGN_WINDOWS),
                                             ("hard", "exact", 1), ("soft", "exact", 1), ("soft", "rotated", 1),
                                             ("hard", "codes", 40), ("hard", "rotated", 40)])
def test_vq_attention(assign, window, T):
    compare(vq_call(naive_vq_attention, assign, window), vq_call(vq_attention, assign, window, "triton"),
            vq_inputs(assign, window, T, batch=B if T == 100 else 1))


# The per-block walks with hard and soft keys (hard ones take them with superblocks=0); the window's forms (which the
# walks never read) spread over them
@pytest.mark.parametrize("assign,window", [("hard", "rotated"), ("soft", "exact"),
                                           pytest.param("hard", "codes", marks=pytest.mark.slow)])
def test_vq_attention_through_the_walks(assign, window):
    """The per-block cache walks give the definition's outputs and gradients, with the memory bound's bias on the
    codes, and a state continued from one call to the next (its state gradient folded in mid-walk) equals that one
    call. 140 tokens: 5 blocks, the last partial."""
    walks = Schedule(superblocks=0)  # hard keys through the walks too
    one_call = []

    def fast(*x):
        one_call.append(vq_call(vq_attention, assign, window, "triton", memory_cap=40, schedule=walks)(*x))
        return one_call[-1]

    inputs = vq_inputs(assign, window, 140, batch=1)
    compare(vq_call(naive_vq_attention, assign, window, memory_cap=40), fast, inputs)
    q, k, v, c, *rotated = (x.detach().to(DEVICE, torch.float32) for x in inputs)
    first, state = vq_call(vq_attention, assign, window, "triton", return_state=True, schedule=walks, memory_cap=40)(
        *(x[:, :, :110] for x in (q, k, v)), c, *(x[:, :, :110] for x in rotated))
    rest = vq_call(vq_attention, assign, window, "triton", state=state, schedule=walks, memory_cap=40)(
        *(x[:, :, 110:] for x in (q, k, v)), c, *(x[:, :, 110:] for x in rotated))
    assert rel_rms(torch.cat([first, rest], 2), one_call[0]) < 1e-6


# Every (assign, window) but the hard keys' raw-key window: its kernels are the codes window's (on straight-through
# keys) and the rotated one's (which also reads the codes on fewer dims)
@pytest.mark.slow
@pytest.mark.parametrize("assign,window", [aw for aw in ASSIGN_WINDOWS if aw != ("hard", "exact")])
def test_vq_attention_large_logits_and_empty_codes(assign, window):
    """Inputs at 4× the scale (logits in the tens) and half the codes far from every key: those never hold a key
    (empty caches, log 0 = −inf) yet their logits are the largest."""
    inputs = vq_inputs(assign, window, 100, scale=2.0, batch=1)
    with torch.no_grad():
        inputs[3][:, S // 2:] *= 20
    compare(vq_call(naive_vq_attention, assign, window), vq_call(vq_attention, assign, window, "triton"), inputs,
            tol=1e-4)


@pytest.mark.parametrize("assign,window", [("hard", "rotated"), ("soft", "exact")])
def test_strided_inputs(assign, window):
    """q, k, v and the rotated pair as (B, T, H, ·) tensors seen as (B, H, T, ·), the layout of a fused qkv
    projection: the kernels read them by their strides and write their gradients in the same layout."""

    def strided(call):
        def run(*xs):
            views = [x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() == 4 else x for x in xs]
            assert not views[0].is_contiguous()
            return call(*views)
        return run

    compare(vq_call(naive_vq_attention, assign, window), strided(vq_call(vq_attention, assign, window, "triton")),
            vq_inputs(assign, window, 70))


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("op", ["window", "hard", "soft"])
def test_gradients_keep_their_inputs_memory_order(op):
    """q, k and v as views of one (B, T, 3, H, D) projection, as a layer's are: every kernel writes its share of their
    gradients in that token-major order (vqattn/ops/utils.py), so autograd's stack back into the projection
    is a plain copy; the values equal those of contiguous inputs."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 50, 3, H, D, generator=g).to(DEVICE).requires_grad_()  # one sequence: the order is a head's
    codebook = torch.randn(H, S, D, generator=g).to(DEVICE)

    def call(q, k, v):
        if op == "window":
            return window_attention(q, k, v, block_len=16, impl="triton")
        return vq_attention(q, k, v, codebook, causal=True, assign=op, block_len=16, exact_window=True,
                            impl="triton")

    views = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D), token-major
    orders = {}
    for name, x in zip("qkv", views):
        x.register_hook(lambda grad, name=name: orders.__setitem__(name, memory_order(grad)))
    call(*views).square().sum().backward()
    assert orders == dict.fromkeys("qkv", (0, 2, 1, 3))
    copies = [x.detach().contiguous().requires_grad_() for x in views]
    call(*copies).square().sum().backward()
    for view_grad, copy in zip(qkv.grad.permute(2, 0, 3, 1, 4).unbind(0), copies):
        torch.testing.assert_close(view_grad, copy.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("assign,window", [("hard", "rotated"), ("soft", "exact")])
def test_chunked_calls_equal_one_call(assign, window):
    """A sequence fed as 3 chunks, each continuing the state of the one before, equals one call; the state equals
    the chunk form's."""
    q, k, v, c, *rotated = (x.detach().to(DEVICE, torch.float32)
                            for x in vq_inputs(assign, window, 110, batch=1))  # a head's state from another's
    call = vq_call(vq_attention, assign, window, "triton")
    whole = call(q, k, v, c, *rotated)
    outs, state = [], None
    for t0, t1 in ((0, 37), (37, 75), (75, 110)):
        piece = lambda x: x[:, :, t0:t1]  # noqa: E731
        out, state = vq_call(vq_attention, assign, window, "triton", state=state, return_state=True)(
            piece(q), piece(k), piece(v), c, *map(piece, rotated))
        outs.append(out)
    assert rel_rms(torch.cat(outs, 2), whole) < 1e-6
    _, chunk_state = vq_call(vq_attention, assign, window, "chunk", return_state=True)(q, k, v, c, *rotated)
    assert rel_rms(state.sums, chunk_state.sums) < 1e-6 and rel_rms(state.counts, chunk_state.counts) < 1e-6
    assert state.length == chunk_state.length and torch.equal(state.keys, chunk_state.keys)


def test_gradient_of_a_continued_states_counts():
    """A hard state whose counts need a gradient (here a leaf): the kernels carry it through the walks, against the
    chunk form in float64. Without one, hard counts are not differentiable and the backward skips their
    gradient."""
    walks = Schedule(superblocks=0)  # hard keys: the walks
    q, k, v, c = (x.detach() for x in vq_inputs("hard", "exact", 100, generator=torch.Generator().manual_seed(4)))
    _, state = vq_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], c, causal=True, block_len=L,
                            exact_window=True, impl="chunk", return_state=True)
    counts, sums = (x.detach().requires_grad_() for x in (state.counts, state.sums))

    def call(impl, dtype, device):
        def run(q, k, v, counts, sums):
            start = VQState(counts, sums, *(x.to(device, dtype) for x in (state.keys, state.values)), state.length,
                            state.block_len, map_time(lambda x: x.to(device), state.assignment))
            out, after = vq_attention(q, k, v, c.to(device, dtype), causal=True, block_len=L, exact_window=True,
                                      impl=impl, state=start, return_state=True, schedule=walks)
            return out.sum(-1) + after.counts.sum(-1, keepdim=True) + after.sums.sum((-1, -2)).unsqueeze(-1)
        return run

    rest = [x[:, :, 70:].clone().requires_grad_() for x in (q, k, v)]
    compare(call("chunk", torch.float64, "cpu"), call("triton", torch.float32, DEVICE), [*rest, counts, sums])


class MaskedCopies(TorchDispatchMode):
    """The shapes of the tensors a block of code masks (masked_fill) while it is active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("masked_fill"):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_window_attention_zeroes_a_nonfinite_key_in_the_kernels():
    """A NaN key in window attention: NaN exactly for the queries whose window holds it, the others the clean
    call's; its gradient 0; the kernels zero the row as they read it, without a masked copy of the keys."""
    T, J = 100, 40
    q, k, v = (x.detach().to(DEVICE, torch.float32) for x in leaves((B, H, T, D), (B, H, T, D), (B, H, T, DV)))
    clean = window_attention(q, k, v, block_len=L, impl="triton")
    k_bad = k.clone()
    k_bad[0, 1, J, 2] = float("nan")
    k_bad.requires_grad_()
    with MaskedCopies() as copies:
        out = window_attention(q, k_bad, v, block_len=L, impl="triton")
        seen = torch.zeros(out.shape[:3], dtype=torch.bool, device=out.device)
        seen[0, 1, J:(J // L + 2) * L] = True  # J's block and the next
        out[~seen].sum().backward()
    assert [shape for shape in copies.shapes if len(shape) == 4] == []
    assert torch.equal(out.isnan().any(-1), seen) and out.isnan().all(-1)[seen].all()
    torch.testing.assert_close(out[~seen], clean[~seen], rtol=0, atol=1e-6)
    assert torch.isfinite(k_bad.grad).all() and (k_bad.grad[0, 1, J] == 0).all() and k_bad.grad.abs().sum() > 0


# Every pair of (assign, given), (assign, where) and (given, where) (soft keys come assigned): the hard keys'
# assignment given with the NaN in k as well is the one case left out.
@pytest.mark.parametrize("assign,given,where", [
    ("hard", True, "k_rot"), ("hard", False, "k"), pytest.param("soft", True, "k_rot", marks=pytest.mark.slow),
    pytest.param("hard", False, "k_rot", marks=pytest.mark.slow), pytest.param("soft", True, "k", marks=pytest.mark.slow)])
def test_nonfinite_window_keys_are_zeroed_in_the_kernels(assign, given, where):
    """A NaN in a key (the window's k_rot, or k, which the assignment reads) of a call whose keys come assigned (as
    the layers call) or are assigned hard inside: the kernels read its window row as zeros, so exactly the queries
    that see it are NaN (the poison) and the others are the clean call's; its gradient is 0; no masked copy of the
    keys or of their gradient is made; a returned state keeps the row zeroed."""
    T, J = 80, 70  # J in the raw window a state keeps (positions 32..79), in the last block
    q, k, v, c, q_rot, k_rot = (x.detach().to(DEVICE, torch.float32) for x in vq_inputs(assign, "rotated", T, batch=1))
    # every key of the codes' width (an assignment inside reads k with the codebook)
    k, q_rot, k_rot = (x[..., :c.shape[-1]].contiguous() for x in (k, q_rot, k_rot))
    a = vq_assign(k, c, assign=assign) if given else None
    k_bad, k_rot_bad = k.clone(), k_rot.clone()
    (k_rot_bad if where == "k_rot" else k_bad)[0, 1, J, 3] = float("nan")
    kw = dict(causal=True, assign=assign, block_len=L, exact_window=True, impl="triton", q_rot=q_rot, assignment=a)
    clean = vq_attention(q, k, v, c, k_rot=k_rot, **kw)
    k_rot_bad.requires_grad_()
    with MaskedCopies() as copies:
        out = vq_attention(q, k_bad, v, c, k_rot=k_rot_bad, **kw)
        seen = torch.zeros(out.shape[:3], dtype=torch.bool, device=out.device)
        seen[0, 1, J:] = True
        out[~seen].sum().backward()
    assert [shape for shape in copies.shapes if len(shape) == 4] == []
    assert torch.equal(out.isnan().any(-1), seen) and out.isnan().all(-1)[seen].all()
    torch.testing.assert_close(out[~seen], clean[~seen], rtol=0, atol=1e-6)
    grad = k_rot_bad.grad
    assert torch.isfinite(grad).all() and (grad[0, 1, J] == 0).all() and grad.abs().sum() > 0
    _, state = vq_attention(q, k_bad, v, c, k_rot=k_rot_bad.detach(), return_state=True, **kw)
    kept = state.keys.shape[2]
    assert torch.isfinite(state.keys).all() and (state.keys[0, 1, J - (T - kept)] == 0).all()


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("assign,window", [("hard", "exact"), ("soft", "rotated")])
def test_bfloat16_inputs(assign, window):
    """bf16 q, k, v (and codebook) accumulate in float32: within bf16's rounding of the float64 definition. The
    definition reads the bf16-rounded inputs, so that a hard argmin cannot flip between the two."""
    inputs = vq_inputs(assign, window, 100, generator=torch.Generator().manual_seed(0), batch=1)
    rounded = [x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs]
    compare(vq_call(naive_vq_attention, assign, window), vq_call(vq_attention, assign, window, "triton"),
            rounded, dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.slow  # seconds a case
def test_float16_value_sums_beyond_the_half_range():
    """float16 values whose cache sums pass float16's largest value (65504): all 100 keys near code 0, values of
    about 1000, so the sums reach about 100000 while every output stays near 1000. The per-block sums are kept in
    float32 beside float16 values, and multiplied as float32 (TF32 on a GPU): nothing overflows to inf."""
    q, k, v, c = vq_inputs("hard", "exact", 100, generator=torch.Generator().manual_seed(3), batch=1)
    with torch.no_grad():
        k.copy_(c[:, :1].unsqueeze(0) + 0.5 * k)  # about 2 from code 0, 6 from the others
        v.mul_(200).add_(1000)
    rounded = [x.detach().to(torch.float16).double().requires_grad_() for x in (q, k, v, c)]
    assert (vq_assign(rounded[1], rounded[3], assign="hard").index == 0).all()
    compare(vq_call(naive_vq_attention, "hard", "exact"), vq_call(vq_attention, "hard", "exact", "triton"),
            rounded, dtype=torch.float16, tol=2e-3)


@pytest.mark.parametrize("name", ["vq_hard", "vq_soft", "ovq", "window"])
def test_layers_triton_equals_chunk(name):
    """The layers with their defaults (RoPE, exact window, slow-pair code scores, the codebook's assignment, the
    memory bounded at 2 × block_len keys, which the last block's 48 exceed): the Triton form gives the chunk form's
    output and parameter gradients."""
    results = []
    for impl in ("chunk", "triton"):
        torch.manual_seed(0)
        layer = build_attention(name, dim=32, num_heads=2, rope=True, block_len=16, impl=impl).to(DEVICE)
        x = torch.randn(1, 77, 32, device=DEVICE, requires_grad=True)
        out, aux, _ = layer(x)
        (out.square().sum() + aux).backward()
        results.append([out, x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
    for a, b in zip(*results):
        assert rel_rms(a, b) < 1e-5


def ref_block_caches(delta, v, counts0, sums0, block_len, fold):
    """Block b's cache n_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀ1, C_0 + Σ_{b' ≤ b−2} Δ_{b'}ᵀV_{b'} by a loop over blocks, and the
    state after ``fold`` blocks, flattened into one vector. delta (B, H, T, S) float64."""
    T = v.shape[2]
    blocks = [slice(t, min(t + block_len, T)) for t in range(0, T, block_len)]
    count = lambda bs: counts0 + sum((delta[:, :, b].sum(2) for b in bs), torch.zeros_like(counts0))  # noqa: E731
    total = lambda bs: sums0 + sum((delta[:, :, b].transpose(-1, -2) @ v[:, :, b] for b in bs),  # noqa: E731
                                   torch.zeros_like(sums0))
    parts = [x for i in range(len(blocks)) for x in (count(blocks[:max(i - 1, 0)]), total(blocks[:max(i - 1, 0)]))]
    parts += [count(blocks[:fold]), total(blocks[:fold])]
    return torch.cat([x.flatten() for x in parts])


# Each (T, fold, codes) case once, hard or soft in turn (the place of the state in the walk is the same code for
# both), but 150 codes (several tiles: a hard key's value gradient is stored by one of them, a soft key's added over
# all) run both
@pytest.mark.parametrize("assign,T,fold,num_codes", [
    ("hard", 1, 0, S), ("soft", 1, 1, S), ("hard", 40, 1, S), ("soft", 100, 2, S), ("hard", 100, 4, S),
    ("hard", 100, 0, S), ("hard", 100, 2, 150), ("soft", 100, 2, 150), ("hard", 230, 4, S), ("soft", 100, 4, 150)])
def test_block_caches(assign, T, fold, num_codes):
    """Every block's cache and the state after ``fold`` blocks, with the gradients of the values, the soft weights
    and the initial cache, against a loop over blocks in float64. 150 codes take three programs' tiles of 64 (the
    last one partly filled): a hard key's value gradient is written by the one tile that holds its code. The state
    sits at every place in the walk (its first step, between, the last step of all: 4 of 4 blocks)."""
    g = torch.Generator().manual_seed(T + fold)
    index = torch.randint(0, num_codes, (1, H, T), generator=g)  # one sequence: see vq_inputs
    v, counts0, sums0, weights = leaves((1, H, T, DV), (1, H, num_codes), (1, H, num_codes, DV), (1, H, T, num_codes),
                                        generator=g)
    hard = assign == "hard"

    def ref(v, counts0, sums0, weights):
        delta = torch.nn.functional.one_hot(index, num_codes).double() if hard else weights
        return ref_block_caches(delta, v, counts0, sums0, L, fold)

    def fast(v, counts0, sums0, weights):
        # the kernel's outputs in the reference's order: block by block, then the state
        n, c, n_fold, c_fold = block_caches(index.to(DEVICE) if hard else None, None if hard else weights, v,
                                            counts0, sums0, block_len=L, fold=fold)
        blocks = [x for i in range(n.shape[2]) for x in (n[:, :, i], c[:, :, i])]
        return torch.cat([x.flatten() for x in blocks + [n_fold, c_fold]])

    compare(ref, fast, [v, counts0, sums0, weights])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 100])
def test_nearest_codes(dtype, T):
    """Every key's nearest code against argmin ‖k − c‖ in float64 (of the keys as the kernel reads them), for keys
    seen through a (B, T, H, D) layout; a code repeated later in the codebook never wins (ties go to the first)."""
    g = torch.Generator().manual_seed(T)
    k = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    codebook = torch.randn(H, 80, D, generator=g)  # two tiles of codes, the second one partly filled
    codebook[:, 70] = codebook[:, 3]
    expected = torch.cdist(k.double(), codebook.double().unsqueeze(0)).argmin(-1)
    index = nearest_codes(k.to(DEVICE), codebook.to(DEVICE))
    assert index.dtype == torch.int64 and torch.equal(index.cpu(), expected)


if triton is not None:
    import triton.language as tl

    from vqattn.ops.triton.utils import split_tf32, tf32_parts

    @triton.jit
    def _tf32_parts_kernel(X, HI, LO):
        offsets = tl.arange(0, 1024)
        hi, lo = split_tf32(tl.load(X + offsets))
        tl.store(HI + offsets, hi)
        tl.store(LO + offsets, lo)


def test_tf32_parts_split_float32_into_two_tf32_values():
    """split_tf32, which lets half keys multiply float32 codes in two exact TF32 products: hi and lo have no bits
    below TF32's 10 mantissa bits (the tensor cores drop those), hi + lo is x to 2⁻²², and hi is x truncated."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.logspace(-6, 6, 1024)
    hi, lo = torch.empty_like(x).to(DEVICE), torch.empty_like(x).to(DEVICE)
    _tf32_parts_kernel[(1,)](x.to(DEVICE), hi, lo)
    hi, lo = hi.cpu(), lo.cpu()
    low_bits = (1 << 13) - 1
    assert not (hi.view(torch.int32) & low_bits).any() and not (lo.view(torch.int32) & low_bits).any()
    assert torch.equal(hi.view(torch.int32), x.view(torch.int32) & ~low_bits)
    error = (hi.double() + lo.double() - x.double()).abs() / x.double().abs()
    assert error.max() <= 2.0**-22 and (lo != 0).float().mean() > 0.9
    # the host's split (a codebook split once per call) is the kernels' bit for bit
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(tf32_parts(x), (hi, lo)))



@pytest.fixture
def float32_precision():
    """PyTorch's float32 matmul precision, restored after the test (which sets it)."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_float32_products_follow_pytorchs_matmul_precision(monkeypatch, float32_precision):
    """On a GPU float32 inputs multiply in IEEE float32 by default and in TF32 where PyTorch's own float32 matmuls
    may (``torch.set_float32_matmul_precision("high")`` or the legacy ``allow_tf32`` flag); half inputs keep their
    products either way, and the interpreter multiplies in IEEE float32 whatever the setting."""
    import triton.language as tl

    from vqattn.ops.triton import float32_tensor_cores, utils

    monkeypatch.setattr(utils, "INTERPRET", False)  # the products a GPU takes
    half = utils.float32_products(torch.bfloat16), utils.dot_dtype(torch.bfloat16)
    torch.set_float32_matmul_precision("highest")
    assert not float32_tensor_cores()
    assert utils.dot_dtype(torch.float32) == (tl.float32, "ieee")
    assert utils.float32_products(torch.float32) == dict(PREC="ieee", EXACT_PREC="ieee", HALF_ROWS=False)
    for allow in (lambda: torch.set_float32_matmul_precision("high"),
                  lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True)):
        torch.set_float32_matmul_precision("highest")
        allow()
        assert float32_tensor_cores()
        assert utils.dot_dtype(torch.float32) == (tl.float32, "tf32")
        assert utils.float32_products(torch.float32) == dict(PREC="tf32", EXACT_PREC="tf32", HALF_ROWS=False)
        assert (utils.float32_products(torch.bfloat16), utils.dot_dtype(torch.bfloat16)) == half
    assert half == (dict(PREC="tf32x3", EXACT_PREC="tf32", HALF_ROWS=True), (tl.bfloat16, "tf32"))
    monkeypatch.setattr(utils, "INTERPRET", True)
    assert utils.dot_dtype(torch.float32) == (tl.float32, "ieee")


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter multiplies float32 in IEEE whatever the precision")
@pytest.mark.parametrize("assign,window", [("hard", "exact"), ("soft", "rotated")])
def test_float32_inputs_multiply_in_tf32_where_pytorch_allows_it(assign, window, float32_precision):
    """Under ``torch.set_float32_matmul_precision("high")`` float32 inputs multiply in TF32 on a GPU: within TF32's
    rounding of the float64 definition. The inputs are rounded to bfloat16, so that a product of two of them is
    exact in TF32 and a hard argmin cannot flip between the two."""
    torch.set_float32_matmul_precision("high")
    inputs = vq_inputs(assign, window, 100, generator=torch.Generator().manual_seed(0))
    rounded = [x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs]
    compare(vq_call(naive_vq_attention, assign, window), vq_call(vq_attention, assign, window, "triton"),
            rounded, dtype=torch.float32, tol=5e-3)


def test_register_caps_only_for_the_gpu_whose_compiler_was_read(monkeypatch):
    """``maxnreg`` (three programs per SM) on sm_90 alone: ptxas' allocations were read there (tests/
    test_benchmarks.py compiles the capped kernel); for sm_80 the capped code backward spills."""
    from vqattn.ops.triton import utils

    assert utils.three_programs_per_sm(torch.device("cpu")) == {}  # the interpreter's
    cuda = torch.device("cuda")
    for capability, launch in (((9, 0), dict(maxnreg=168)), ((8, 0), {}), ((10, 0), {})):
        monkeypatch.setattr(utils, "capability", lambda device, c=capability: c)
        assert utils.three_programs_per_sm(cuda) == launch

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 100])
def test_code_residuals(dtype, T):
    """The commitment loss's keys' gradient a·(k − c_z) against float64, for keys seen through a (B, T, H, D) layout
    (written back in it, in their dtype) and a scale a held in a tensor."""
    g = torch.Generator().manual_seed(T)
    k = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    codebook, index = torch.randn(H, 80, D, generator=g), torch.randint(0, 80, (B, H, T), generator=g)
    factor = torch.tensor(-0.3)
    expected = factor.double() * (k.double() - codebook.double()[torch.arange(H)[:, None], index])
    out = code_residuals(k.to(DEVICE), codebook.to(DEVICE), index.to(DEVICE), factor.to(DEVICE))
    assert out.dtype == dtype and memory_order(out) == memory_order(k)
    assert rel_rms(out.cpu().double(), expected) < (1e-7 if dtype == torch.float32 else 4e-3)


def test_quantisation_loss_takes_the_residual_kernel_on_a_gpu(monkeypatch):
    """The codebook's commitment loss, with the kernel path that CUDA keys take, gives bf16 keys (a strided view,
    as a layer's) the gradient of its PyTorch form, in their memory order, to within the rounding to bf16 (which
    Triton's interpreter truncates)."""
    import vqattn.codebook as codebook_module

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(B, 70, 3, H, D, generator=g).to(torch.bfloat16)[:, :, 1].transpose(1, 2)
    codes, index = torch.randn(H, 24, D, generator=g), torch.randint(0, 24, (B, H, 70), generator=g)

    def keys_grad(kernel: bool):
        monkeypatch.setattr(codebook_module, "runs_kernels", lambda k: kernel)
        x = keys.to(DEVICE).requires_grad_() if kernel else keys.clone().requires_grad_()
        loss = codebook_module.quantisation_loss(x, codes.to(x.device), index.to(x.device), key_weight=0.25)[0]
        grad, = torch.autograd.grad(loss * 3, x)
        return grad

    got, want = keys_grad(True), keys_grad(False)
    assert got.dtype == torch.bfloat16 and memory_order(got) == memory_order(keys)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 100])
def test_soft_weights(dtype, T):
    """The GMM posterior softmax_s(−‖k − c_s‖²/2τ_h) and the gradients of the keys, the codes and a per-head
    temperature, against the definition in float64 (of the keys as the kernel reads them, so bfloat16 keys keep
    float32's tolerance but for their gradient, rounded to bfloat16); 80 codes fill one tile and part of another."""
    g = torch.Generator().manual_seed(T)
    k = torch.randn(B, T, H, D, generator=g).to(dtype).double().transpose(1, 2).requires_grad_()
    codebook, tau = torch.randn(H, 80, D, dtype=torch.float64, generator=g), torch.tensor([0.7, 1.9]).double()
    codebook.requires_grad_(), tau.requires_grad_()
    distances = (k.unsqueeze(-2) - codebook[:, None]).square().sum(-1)  # (B, H, T, S)
    ref = torch.softmax(-distances / (2 * tau[:, None, None]), -1)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ref_grads = torch.autograd.grad(ref, (k, codebook, tau), grad)
    inputs = [k.detach().to(DEVICE, dtype).requires_grad_(), codebook.detach().float().to(DEVICE).requires_grad_(),
              tau.detach().float().to(DEVICE).requires_grad_()]
    weights = soft_weights(*inputs)
    grads = torch.autograd.grad(weights, inputs, grad.to(DEVICE, torch.float32))
    assert weights.dtype == torch.float32 and grads[0].dtype == dtype and rel_rms(weights, ref) < 1e-5
    tolerances = (1e-4 if dtype == torch.float32 else 1e-2, 1e-4, 1e-4)
    for name, fast, exact, tol in zip(("keys", "codes", "temperature"), grads, ref_grads, tolerances):
        assert rel_rms(fast, exact) < tol, name


@pytest.mark.parametrize("dtype, tol, first_pair", [(torch.float32, 1e-6, None), (torch.float32, 1e-6, 0),
                                                    (torch.float32, 1e-6, 3), (torch.bfloat16, 1e-2, 3)])
def test_rotation(dtype, tol, first_pair):
    """RoPE's rotation of x seen through a (B, T, H, D) layout, and the inverse rotation of a gradient plus the
    unrotated pairs' gradient (pairs m ≥ first_pair of both halves), against the formula in float64; 70 positions
    cross a row block, 10 pairs fill part of the kernel's width."""
    T, Dh, start = 70, 20, 5
    g = torch.Generator().manual_seed(first_pair or 0)
    x = torch.randn(B, T, H, Dh, generator=g).to(dtype).transpose(1, 2)
    angle = torch.arange(start, start + T, dtype=torch.float64)[:, None] * 100.0 ** (-torch.arange(Dh // 2) / 10)
    cos, sin = angle.cos(), angle.sin()

    def exact(y, sign, raw=None):
        y1, y2 = y.double().chunk(2, -1)
        out = torch.cat([y1 * cos - sign * y2 * sin, y2 * cos + sign * y1 * sin], -1)
        if raw is not None:
            out.unflatten(-1, (2, Dh // 2))[..., first_pair:] += raw.double().unflatten(-1, (2, -1))
        return out

    cos32, sin32 = cos.float().to(DEVICE), sin.float().to(DEVICE)
    rotated = rotate(x.to(DEVICE), cos32, sin32, 1.0)
    assert rotated.dtype == dtype and rel_rms(rotated, exact(x, 1)) < tol
    raw = None if first_pair is None else torch.randn(B, H, T, Dh - 2 * first_pair, generator=g).to(dtype)
    back = rotate(x.to(DEVICE), cos32, sin32, -1.0, None if raw is None else raw.to(DEVICE), first_pair or 0)
    assert rel_rms(back, exact(x, -1, raw)) < tol
    # the backward pass writes in the forward input's memory order: x's, token-major
    back_in_order = rotate(x.to(DEVICE), cos32, sin32, -1.0, None if raw is None else raw.to(DEVICE),
                           first_pair or 0, memory_order(x))
    assert memory_order(back_in_order) == (0, 2, 1, 3) and torch.equal(back_in_order, back)


def test_rope_takes_the_rotation_kernel(monkeypatch):
    """rope_rotate_keeping through the kernel (forced where it would not run: a CPU under the interpreter), both
    outputs and the gradient of x, against the same call in float64 on PyTorch's form."""
    from vqattn.modules.rope import rope_rotate_keeping
    from vqattn.ops.triton import rotation

    calls = []

    def keep(kernel: bool):
        def rotated_and_raw(y):
            monkeypatch.setattr(rotation, "runs_rotation_kernel", lambda t: kernel and (calls.append(t.dtype) or True))
            rotated, raw = rope_rotate_keeping(y, 7, 100.0, 2)
            return torch.cat([rotated.flatten(), raw.flatten() * 3])
        return rotated_and_raw

    compare(keep(False), keep(True), leaves((B, H, 40, 20)), tol=1e-6)
    assert calls == [torch.float32] * 2  # the forward and the backward pass took it


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf − inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_rows(dtype):
    """The rows with a NaN, +inf or −inf entry, of a strided tensor, against torch.isfinite; large finite entries
    are not flagged."""
    x = torch.randn(B, 150, H, D).to(dtype).transpose(1, 2)
    x[0, 1, 3, 5], x[1, 0, 149, 0], x[1, 1, 64, D - 1] = float("nan"), float("inf"), float("-inf")
    x[0, 0, 7] = torch.finfo(dtype).max
    expected = ~torch.isfinite(x).all(-1)
    assert expected.sum() == 3 and torch.equal(nonfinite_rows(x.to(DEVICE)).cpu(), expected)


def test_unsupported_calls_say_why():
    q, k, v, c = (x.detach().to(DEVICE) for x in vq_inputs("hard", "exact", 10))
    with pytest.raises(ValueError, match="mixture window"):
        vq_attention(q, k, v, c, causal=True, assign="soft", impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        vq_attention(q, k, v, c, causal=True, block_len=48, impl="triton")
    with pytest.raises(ValueError, match="block_len"):
        window_attention(q, k, v, block_len=8, impl="triton")
    with pytest.raises(ValueError, match="causal=True"):
        vq_attention(q, k, v, c, causal=False, impl="triton")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
            window_attention(q.double(), k.double(), v.double(), impl="triton")


def test_auto_keeps_the_pytorch_impls_on_a_cpu():
    """impl="auto" runs the Triton kernel only on CUDA: on a CPU, under the interpreter too, it is the chunk form
    (same result to the bit)."""
    q, k, v, c = (x.detach() for x in vq_inputs("hard", "exact", 50))
    auto = vq_attention(q.float(), k.float(), v.float(), c.float(), causal=True, block_len=L, exact_window=True)
    chunk = vq_attention(q.float(), k.float(), v.float(), c.float(), causal=True, block_len=L, exact_window=True,
                         impl="chunk")
    assert torch.equal(auto, chunk)
