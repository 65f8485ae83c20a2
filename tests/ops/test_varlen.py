"""Packed sequences (``cu_seqlens``): a packed call equals N separate calls of the float64 definitions (the naive
forms), outputs and every input's gradient, in every form of every causal op, and in the segmented block form that
``Segments`` run; one sequence is today's call bit for bit; states are one per sequence; bad ``cu_seqlens`` get a
ValueError naming it."""

from __future__ import annotations

import pytest
import torch

from vqattn.ops import linear, ovq, softmax, vq, window
from vqattn.ops.varlen import Packing, Segments, cu_seqlens_from_starts, positions

from triton_helpers import compare, needs_triton

F64 = torch.float64
H, D, DV, S, L = 2, 16, 8, 6, 16  # L: the Triton kernels' smallest block


def _codebook(seed=7):
    return torch.randn(H, S, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _vq(assign, window_kind, **kw):
    """(op kwargs, extra per-token names) of a vq call: hard or soft, the codes' or the exact or RoPE's window."""
    kw = dict(causal=True, assign=assign, exact_window=window_kind != "codes", block_len=L, **kw)
    return kw, ("q_rot", "k_rot") if window_kind == "rotated" else ()


# name: (op, naive form, impls, kwargs, extra per-token inputs)
CASES = {
    "vq_hard_codes": (vq.vq_attention, vq.naive_vq_attention, ("chunk", "recurrent"), *_vq("hard", "codes")),
    "vq_hard_exact": (vq.vq_attention, vq.naive_vq_attention, ("chunk", "recurrent"), *_vq("hard", "exact")),
    "vq_soft_exact_cap": (vq.vq_attention, vq.naive_vq_attention, ("chunk", "recurrent"),
                          *_vq("soft", "exact", memory_cap=5, temperature=0.7)),
    "vq_soft_codes": (vq.vq_attention, vq.naive_vq_attention, ("chunk", "recurrent"), *_vq("soft", "codes")),
    "vq_hard_rotated": (vq.vq_attention, vq.naive_vq_attention, ("chunk", "recurrent"), *_vq("hard", "rotated")),
    "ovq": (ovq.ovq_attention, ovq.naive_ovq_attention, ("chunk", "recurrent"),
            dict(num_slots=3, block_len=L, memory_cap=5, memory_decay=0.9), ()),
    "ovq_separate_keys": (ovq.ovq_attention, ovq.naive_ovq_attention, ("chunk", "recurrent"),
                          dict(num_slots=3, block_len=L, threshold=0.5), ("q_mem", "k_mem")),
    "window": (window.window_attention, window.naive_window_attention, ("chunk", "recurrent"), dict(block_len=L),
               ()),
    "linear": (linear.linear_attention, linear.naive_linear_attention, ("chunk", "recurrent"),
               dict(causal=True, block_len=L), ("k_log_scale",)),
    "softmax": (softmax.softmax_attention, softmax.softmax_attention, ("sdpa",), dict(causal=True), ()),
    # the segmented forms' own options (they also run every case above)
    "vq_soft_exact": (vq.vq_attention, vq.naive_vq_attention, ("chunk",), *_vq("soft", "exact")),
    "ovq_drop_pairs": (ovq.ovq_attention, ovq.naive_ovq_attention, ("chunk",),
                       dict(num_slots=3, block_len=L, memory_cap=20, overflow="drop", memory_first_pair=2), ()),
    "linear_count": (linear.linear_attention, linear.naive_linear_attention, ("chunk",),
                     dict(causal=True, block_len=L, normalizer="count"), ()),
}


def _inputs(name, T, seed=0):
    """Leaf tensors (1, H, T, …) float64 with gradients: q, k, v and the case's extra per-token inputs."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (D,), "k": (D,), "v": (DV,), "q_rot": (D,), "k_rot": (D,), "q_mem": (D,), "k_mem": (D,),
              "k_log_scale": ()}
    names = ("q", "k", "v", *CASES[name][4])
    x = {n: torch.randn(1, H, T, *shapes[n], generator=g, dtype=F64) for n in names}
    if name.startswith("linear"):  # positive features
        x["q"], x["k"] = x["q"].exp(), x["k"].exp()
    return {n: t.requires_grad_() for n, t in x.items()}


def _call(name, fn, x, **kw):
    op, _, _, kwargs, _ = CASES[name]
    args = dict(kwargs, **kw)
    if op is linear.linear_attention:
        return fn(x["q"], x["k"], x["v"], k_log_scale=x.get("k_log_scale"), **args)
    extra = {n: t for n, t in x.items() if n not in ("q", "k", "v")}
    if op is vq.vq_attention:
        code = args.pop("codebook")
        if extra:  # RoPE's window: the assignment of the position-free keys is given, as the layers pass it
            extra["assignment"] = vq.vq_assign(x["k"], code, assign=args["assign"])
        return fn(x["q"], x["k"], x["v"], code, **args, **extra)
    return fn(x["q"], x["k"], x["v"], **args, **extra)


def _grads(out, leaves, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]  # unused: a zero gradient


def _separate(name, x, bounds, codebook):
    """The naive form on each sequence alone, concatenated."""
    naive = CASES[name][1]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        outs.append(_call(name, naive, {n: t[:, :, a:b] for n, t in x.items()}, **codebook))
    return torch.cat(outs, 2)


def _check(name, lengths, impl, *, seed=0, segments=False):
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = _inputs(name, bounds[-1], seed)
    code = {"codebook": _codebook().requires_grad_()} if CASES[name][0] is vq.vq_attention else {}
    leaves = [*x.values(), *code.values()]
    cu = Packing.from_bounds(bounds).segments([L]) if segments else torch.tensor(bounds, dtype=torch.int32)
    kw = {} if impl == "sdpa" else {"impl": impl}
    got = _call(name, CASES[name][0], x, cu_seqlens=cu, **kw, **code)
    want = _separate(name, x, bounds, code)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


# shorter than a block, length 1, crossing block boundaries, several blocks
LENGTHS = [[3, 1, 13, 40, 5], [1, 1, 1], [17, 2]]


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_packed_equals_separate_calls(name, lengths):
    for impl in CASES[name][2]:
        _check(name, lengths, impl)


@pytest.mark.parametrize("offset", range(1, L + 1))
@pytest.mark.parametrize("name", ["vq_hard_exact", "ovq", "window", "linear"])
def test_every_offset_of_a_block(name, offset):
    """The second sequence starts at every position of a block."""
    _check(name, [offset, 2 * L + 3], "chunk", seed=offset)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_segments_equal_separate_calls(name, lengths):
    """The segmented block form (cu_seqlens given as Segments, what a compiled model runs) equals the float64
    definitions called one sequence at a time, outputs and every gradient (ovq with ``memory_decay``: the length
    classes, which it falls back to)."""
    _check(name, lengths, CASES[name][2][0], segments=True)


@pytest.mark.parametrize("offset", [1, 7, L - 1, L, L + 1])
@pytest.mark.parametrize("name", ["vq_hard_codes", "vq_soft_codes", "ovq_drop_pairs", "window", "linear"])
def test_segments_at_offsets_of_a_block(name, offset):
    """The segmented form's block layout with the second sequence starting at several positions of a block."""
    _check(name, [offset, 2 * L + 3, 1], "chunk", seed=offset, segments=True)


def test_block_layout():
    """Each sequence starts at a block boundary and takes its blocks, padded after its tokens by less than a block;
    the layout's gather and scatter_back are inverse on the tokens; the sums restart at each sequence."""
    from vqattn.ops.common.segments import BlockLayout, segment_prefix, segment_sums

    bounds = [0, 3, 4, 24, 40]
    layout = BlockLayout.build(bounds, 8)
    assert layout.num_slots == 8 + 8 + 24 + 16
    assert layout.first_blocks().tolist() == [0, 1, 2, 2, 2, 5, 5]
    assert layout.block_in_sequence().tolist() == [0, 0, 0, 1, 2, 0, 1]
    real = ~layout.pads
    assert real.sum() == 40 and layout.slots[real].tolist() == list(range(40))
    assert layout.starts.tolist() == [0] * 8 + [8] * 8 + [16] * 24 + [40] * 16
    x = torch.randn(1, 2, 40, 3, dtype=F64)
    laid = layout.gather(x)
    assert (laid[:, :, layout.pads] == 0).all() and torch.equal(layout.scatter_back(laid), x)
    blocks_ = torch.arange(1.0, 8.0, dtype=F64).view(1, 1, 7)
    assert segment_sums(blocks_, layout.first_blocks(), 2).flatten().tolist() == [0, 0, 0, 0, 3, 0, 0]
    assert segment_sums(blocks_, layout.first_blocks(), 1).flatten().tolist() == [0, 0, 0, 3, 7, 0, 6]
    ones = torch.ones(1, 1, layout.num_slots, dtype=F64)
    assert segment_prefix(ones, layout.starts).flatten().tolist() == [
        *range(1, 9), *range(1, 9), *range(1, 25), *range(1, 17)]


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_segment_sums_both_ways_and_their_gradients(lag):
    """The CPU's walk over the blocks and the prefix differences (the other devices') give the sums over each
    sequence's blocks ≤ b − lag, as a loop over the definition, and their transposes the gradients (float64)."""
    from vqattn.ops.common import segments as seg

    first = torch.tensor([0, 0, 0, 0, 4, 5, 5, 5, 5, 5, 10])
    x = torch.randn(2, 3, 11, 4, 5, dtype=F64, requires_grad=True)
    want = torch.stack([x[:, :, first[b]:max(b - lag + 1, first[b])].sum(2) for b in range(11)], 2)
    grad = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    for sums, transposed, given in ((seg._walk_sums, seg._walk_sums_transposed, first.tolist()),
                                    (seg._prefix_sums, seg._prefix_sums_transposed, first)):
        torch.testing.assert_close(sums(x.detach(), given, lag), want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(transposed(grad, given, lag), want_grad, rtol=1e-12, atol=1e-12)
    got = seg.segment_sums(x, first, lag)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lag", [1, 2])
@pytest.mark.parametrize("hard", [True, False], ids=["index", "weights"])
def test_segment_cache_read_equals_the_sums_of_each_sequence(lag, hard):
    """The CPU's cache walk p_b · C_b equals the codes' statistics summed over each sequence's blocks ≤ b − lag
    (a loop over the definition) times p_b, outputs and the gradients of p, the values and the soft weights;
    hard keys of no code (−1) add nothing (float64)."""
    from vqattn.ops.common.segments import segment_cache_read

    torch.manual_seed(lag)
    N, n, L_, S, Dv = 3, 9, 4, 5, 6
    first = torch.tensor([0, 0, 0, 3, 4, 4, 4, 4, 8])
    p = torch.randn(N, n, L_, S, dtype=F64, requires_grad=True)
    values = torch.randn(N, n, L_, Dv, dtype=F64, requires_grad=True)
    if hard:
        index, weights = torch.randint(-1, S, (N, n, L_)), None
        delta = torch.nn.functional.one_hot(index.clamp_min(0), S).to(F64) * (index >= 0).unsqueeze(-1)
        leaves = [p, values]
    else:
        index, weights = None, torch.rand(N, n, L_, S, dtype=F64, requires_grad=True)
        delta, leaves = weights, [p, values, weights]
    stats = delta.transpose(-1, -2) @ values  # (N, n, S, Dv)
    caches = torch.stack([stats[:, first[b]:max(b - lag + 1, first[b])].sum(1) for b in range(n)], 1)
    want = p @ caches
    got = segment_cache_read(p, values, index, weights, first, lag)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["vq_hard_codes", "vq_soft_codes"])
def test_segments_with_every_blocks_cache_at_once(name, monkeypatch):
    """The segmented vq form as it runs off a CPU (every block's cache formed at once, not the walk) equals the
    float64 definitions called one sequence at a time."""
    from vqattn.ops.common import segments as seg

    monkeypatch.setattr(seg, "cache_walk_runs", lambda first: False)
    _check(name, LENGTHS[0], "chunk", segments=True)


def test_segment_sums_of_a_short_sequence_after_a_long_one_are_its_own():
    """A short sequence after a long one of large values gets the float32 sums of a call of its own: the CPU's walk
    restarts its running sum, and the prefix differences cancel the long one's prefix in float64."""
    from vqattn.ops.common import segments as seg

    first = torch.tensor([0] * 100 + [100, 100, 100])
    x = torch.full((1, 1, 103), 1e6)
    x[..., 100:] = torch.tensor([1.0, 2.0, 3.0])
    assert seg.segment_sums(x, first, 1)[..., 100:].flatten().tolist() == [0.0, 1.0, 3.0]
    assert seg._prefix_sums(x, first, 1)[..., 100:].flatten().tolist() == [0.0, 1.0, 3.0]


@pytest.mark.parametrize("name", ["vq_hard_exact", "vq_soft_codes", "window"])
def test_segments_nonfinite_key_reaches_its_own_sequence_only(name):
    """A NaN key makes NaN exactly the outputs that see it in its own sequence (its window's, for window
    attention); the other sequences equal their separate calls."""
    bounds = [0, 9, 50, 61]
    x = {n: t.detach() for n, t in _inputs(name, 61).items()}
    x["k"][:, :, 20] = float("nan")
    code = {"codebook": _codebook()} if CASES[name][0] is vq.vq_attention else {}
    got = _call(name, CASES[name][0], x, cu_seqlens=Packing.from_bounds(bounds).segments([L]), impl="chunk", **code)
    want = _call(name, CASES[name][0], x, cu_seqlens=torch.tensor(bounds, dtype=torch.int32), impl="chunk", **code)
    assert torch.equal(got.isnan(), want.isnan()) and want[:, :, 20].isnan().all() and not want[:, :, :20].isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-10, atol=1e-12)


def test_segments_errors():
    """Segments take causal calls without states, of their own length and block lengths; the message names what."""
    q = torch.rand(1, H, 10, D, dtype=F64)
    segments = Packing.from_bounds([0, 4, 10]).segments([4])
    with pytest.raises(ValueError, match="Segments runs causal calls without states"):
        window.window_attention(q, q, q, block_len=4, cu_seqlens=segments, return_state=True)
    with pytest.raises(ValueError, match="Segments runs causal calls"):
        linear.linear_attention(q, q, q, causal=False, block_len=4, cu_seqlens=segments)
    with pytest.raises(ValueError, match="T = 10"):
        window.window_attention(q[:, :, :8], q[:, :, :8], q[:, :, :8], block_len=4, cu_seqlens=segments)
    with pytest.raises(ValueError, match=r"block layouts for block_len \[4\], not 8"):
        window.window_attention(q, q, q, block_len=8, cu_seqlens=segments)
    with pytest.raises(ValueError, match="B = 2"):
        window.window_attention(*[torch.rand(2, H, 10, D)] * 3, block_len=4, cu_seqlens=segments)
    assert isinstance(segments, Segments) and segments.length == 10


@pytest.mark.slow  # seconds a case
@pytest.mark.parametrize("name", ["vq_soft_exact_cap", "vq_hard_codes", "ovq_drop_pairs", "window", "linear",
                                  "softmax"])
def test_segments_compile_whole_without_recompiles(name):
    """A compiled op given Segments traces the packed call whole (fullgraph) and compiles once for new documents,
    also when the number of sequences and of blocks changes."""
    op = CASES[name][0]
    x = {n: t.detach() for n, t in _inputs(name, 70).items()}
    code = {"codebook": _codebook()} if op is vq.vq_attention else {}
    compiled = torch.compile(lambda x, cu, code: _call(name, op, x, cu_seqlens=cu, **code), backend="eager",
                             fullgraph=True)
    torch._dynamo.reset()
    for i, bounds in enumerate([[0, 70], [0, 20, 70], [0, 1, 2, 33, 70], [0, 17, 34, 51, 70]]):
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            got = compiled(x, Packing.from_bounds(bounds).segments([L]), code)
        want = _call(name, op, x, cu_seqlens=torch.tensor(bounds, dtype=torch.int32), **code)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_one_sequence_is_the_plain_call_bit_for_bit(name):
    x = _inputs(name, 29)
    code = {"codebook": _codebook()} if CASES[name][0] is vq.vq_attention else {}
    cu = torch.tensor([0, 29], dtype=torch.int32)
    got = _call(name, CASES[name][0], x, cu_seqlens=cu, **code)
    assert torch.equal(got, _call(name, CASES[name][0], x, **code))


@pytest.mark.parametrize("name", [n for n in CASES if n != "softmax"])
def test_states_are_one_per_sequence(name):
    """Two packed calls, the second continuing the first's states, equal the whole sequences called alone."""
    first, second = [5, 12, 1], [9, 1, 20]
    x = _inputs(name, sum(first) + sum(second))
    code = {"codebook": _codebook()} if CASES[name][0] is vq.vq_attention else {}
    op = CASES[name][0]
    b1 = [0, *torch.tensor(first).cumsum(0).tolist()]
    b2 = [0, *torch.tensor(second).cumsum(0).tolist()]
    head = {n: t[:, :, :b1[-1]] for n, t in x.items()}
    tail = {n: t[:, :, b1[-1]:] for n, t in x.items()}
    out1, states = _call(name, op, head, cu_seqlens=torch.tensor(b1, dtype=torch.int32), return_state=True, **code)
    assert isinstance(states, list) and len(states) == 3
    out2 = _call(name, op, tail, cu_seqlens=torch.tensor(b2, dtype=torch.int32), state=states, **code)
    for i in range(3):
        whole = {n: torch.cat([h[:, :, b1[i]:b1[i + 1]], t[:, :, b2[i]:b2[i + 1]]], 2)
                 for (n, h), t in zip(head.items(), tail.values())}
        want = _call(name, CASES[name][1], whole, **code)
        got = torch.cat([out1[:, :, b1[i]:b1[i + 1]], out2[:, :, b2[i]:b2[i + 1]]], 2)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["vq_hard_exact", "window", "ovq"])
def test_causal_across_sequences(name):
    """Changing one sequence changes no output of another."""
    x = _inputs(name, 30)
    code = {"codebook": _codebook()} if CASES[name][0] is vq.vq_attention else {}
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    out = _call(name, CASES[name][0], x, cu_seqlens=cu, **code)
    y = {n: t.detach().clone() for n, t in x.items()}
    for t in y.values():
        t[:, :, :11] = t[:, :, :11].flip(2) * 3 + 1
    other = _call(name, CASES[name][0], y, cu_seqlens=cu, **code)
    assert torch.equal(out[:, :, 11:], other[:, :, 11:])
    assert not torch.allclose(out[:, :, :11], other[:, :, :11])


BAD = [
    (torch.tensor([0, 4, 10]), "int32"),
    (torch.tensor([[0, 4, 10]], dtype=torch.int32), "1-D"),
    (torch.tensor([1, 4, 10], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 4, 9], dtype=torch.int32), "end at T = 10"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0, 4, 4, 10], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0], dtype=torch.int32), "at least one"),
    ([0, 4, 10], "int32"),
]


@pytest.mark.parametrize("cu, match", BAD, ids=[m for _, m in BAD])
@pytest.mark.parametrize("op", [vq.vq_attention, ovq.ovq_attention, window.window_attention,
                                linear.linear_attention, softmax.softmax_attention], ids=lambda f: f.__name__)
def test_bad_cu_seqlens(op, cu, match):
    q = torch.rand(1, H, 10, D, dtype=F64)
    args = {vq.vq_attention: ((q, q, q, _codebook()), dict(causal=True)), ovq.ovq_attention: ((q, q, q),
            dict(num_slots=2)), linear.linear_attention: ((q, q, q), dict(causal=True)),
            softmax.softmax_attention: ((q, q, q), dict(causal=True))}.get(op, ((q, q, q), {}))
    with pytest.raises(ValueError, match="cu_seqlens"):
        op(*args[0], cu_seqlens=cu, **args[1])
    with pytest.raises(ValueError, match=match):
        op(*args[0], cu_seqlens=cu, **args[1])


def test_batch_must_be_one_and_state_a_list():
    q = torch.rand(2, H, 10, D, dtype=F64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens.*B = 2"):
        window.window_attention(q, q, q, cu_seqlens=cu)
    _, state = window.window_attention(q[:1, :, :4], q[:1, :, :4], q[:1, :, :4], return_state=True)
    with pytest.raises(ValueError, match="state must be a list of 2"):
        window.window_attention(q[:1], q[:1], q[:1], cu_seqlens=cu, state=state)


def test_helpers():
    starts = torch.tensor([False, False, True, False, True, True, False])
    cu = cu_seqlens_from_starts(starts)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 4, 5, 7]
    assert positions(cu).tolist() == [0, 1, 0, 1, 0, 0, 1]
    assert positions(cu, [3, 0, 1, 2]).tolist() == [3, 4, 0, 1, 1, 2, 3]


def test_a_packed_row_runs_its_tokens_not_n_times_the_longest():
    """The length classes: sequences with the same number of blocks run together, each padded by less than one
    block; the largest tensor of a packed call of one long and many short sequences is about the largest of one
    call over the same tokens, not N × the longest (as a batch padded to the longest would make it)."""
    from memory_helpers import largest_tensor

    lengths = [200, *[3] * 20, 17, 30, 31, 1]
    packing = Packing.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()])
    classes = packing.classes(L)
    slots = sum(c.span[1] - c.span[0] if c.span else c.rows * c.width for c in classes)
    assert slots < packing.length + len(lengths) * L and len(classes) == 3  # 1 block, 2 blocks, 200 alone
    for c in classes:
        if c.span is None:
            rows = (~c.pads).view(c.rows, c.width).sum(1)  # each row's real length
            assert rows.max() == c.width and len(set((-(-rows // L)).tolist())) == 1
            assert sorted(c.tokens.tolist()) == c.tokens.tolist() and len(set(c.tokens.tolist())) == rows.sum()
    x = _inputs("vq_hard_exact", packing.length)
    code = _codebook()
    single = largest_tensor(lambda: _call("vq_hard_exact", vq.vq_attention, x, codebook=code, impl="chunk"))
    packed = largest_tensor(lambda: _call("vq_hard_exact", vq.vq_attention, x, codebook=code, impl="chunk",
                                          cu_seqlens=packing))
    assert packed <= 1.3 * single, (packed, single)


@pytest.mark.parametrize("call_tokens", [1, 16, 100, 10**6])
def test_merged_classes_minimise_slots_plus_calls(call_tokens):
    """Where a call costs ``call_tokens`` (a GPU's launches), neighbouring length classes merge into one padded batch
    when that saves more than the padding costs: the ranges chosen cost no more than any other way to cut the
    groups into ranges (all of them tried); with 0 (the CPU) every group of one block count is its own call."""
    import itertools

    from vqattn.ops.varlen import merged_groups

    g = torch.Generator().manual_seed(call_tokens)
    groups = [[int(x) for x in torch.randint(16 * b + 1, 16 * b + 17, (int(n),), generator=g)]
              for b, n in enumerate(torch.randint(1, 4, (6,), generator=g))]

    def cost(ranges):
        return sum((sum(groups[a]) if sum(map(len, groups[a:b])) == 1 else
                    sum(map(len, groups[a:b])) * max(groups[b - 1])) + call_tokens for a, b in ranges)

    every = []
    for cuts in itertools.product([False, True], repeat=len(groups) - 1):
        ends = [i + 1 for i, c in enumerate(cuts) if c] + [len(groups)]
        every.append(list(zip([0] + ends[:-1], ends)))
    chosen = merged_groups(groups, call_tokens)
    assert [a for a, _ in chosen] == [0] + [b for _, b in chosen[:-1]] and chosen[-1][1] == len(groups)
    assert cost(chosen) == min(cost(r) for r in every)
    assert merged_groups(groups, 0) == [(a, a + 1) for a in range(len(groups))]
    if call_tokens == 10**6:
        assert chosen == [(0, len(groups))]  # one batch, padded to the longest


def test_merged_classes_run_exactly():
    """A packed call whose classes are merged (as on a GPU) equals separate calls, outputs and gradients."""
    lengths = [3, 1, 13, 40, 5, 17]
    packing = Packing.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()])
    merged = packing.classes(L, call_tokens=40)
    assert len(merged) < len(packing.classes(L)) and any(c.span is None and c.width > L for c in merged)
    packing._classes[L, 0] = merged  # what the CPU's default (no merging) would run, replaced by the merged classes
    bounds = list(packing.bounds)
    x = _inputs("vq_soft_exact_cap", bounds[-1])
    code = {"codebook": _codebook().requires_grad_()}
    leaves = [*x.values(), *code.values()]
    got = _call("vq_soft_exact_cap", vq.vq_attention, x, cu_seqlens=packing, impl="chunk", **code)
    want = _separate("vq_soft_exact_cap", x, bounds, code)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_split_and_merge_write_each_gradient_once():
    """The classes' inputs and outputs are views or gathers of the row; merged back they are the row itself, and
    a class left out of the loss gets a zero gradient (its tokens' share of the row's)."""
    from vqattn.ops.varlen import _MergeClasses, _SplitClasses

    packing = Packing.from_bounds([0, 3, 20, 22, 40, 41, 90])  # 1 block x 3, 2 blocks x 2, 4 blocks alone
    classes = packing.classes(L)
    x = torch.randn(1, H, 90, DV, dtype=F64, requires_grad=True)
    parts = _SplitClasses.apply(x, classes)
    for c, part in zip(classes, parts):
        if c.span is None:
            assert (part.movedim(0, 1).flatten(1, 2)[:, c.pads] == 0).all()  # pads are zeros
    merged = _MergeClasses.apply(classes, 90, *parts)
    assert torch.equal(merged, x)
    w = torch.randn_like(x)
    (grad,) = torch.autograd.grad((merged * w).sum(), x)
    assert torch.equal(grad, w)
    (grad,) = torch.autograd.grad((parts[-1] * parts[-1]).sum(), x)  # the last class alone: 2x at its tokens
    a, b = classes[-1].span
    assert torch.equal(grad[:, :, a:b], 2 * x[:, :, a:b]) and not grad[:, :, :a].any() and not grad[:, :, b:].any()


def test_a_packing_is_read_once_and_checked_like_cu_seqlens():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    packing = Packing.of(cu, batch=1, length=10)
    assert packing.bounds == (0, 3, 10) and packing.lengths == [3, 7]
    assert Packing.of(packing, batch=1, length=10) is packing
    assert torch.equal(packing.positions(), positions(cu))
    starts = torch.tensor([True, False, False, True, False, False, False, False, False, False])
    assert Packing.from_starts(starts).bounds == packing.bounds
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 12"):
        Packing.of(packing, batch=1, length=12)
    with pytest.raises(ValueError, match="cu_seqlens.*B = 2"):
        Packing.of(packing, batch=2, length=10)
    with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing"):
        Packing.from_bounds([0, 4, 4, 10])
    q = torch.rand(1, H, 10, D, dtype=F64)
    torch.testing.assert_close(window.window_attention(q, q, q, block_len=4, cu_seqlens=packing),
                               window.window_attention(q, q, q, block_len=4, cu_seqlens=cu), rtol=0, atol=0)


@needs_triton
@pytest.mark.slow
def test_triton_classes_cross_superblocks():
    """Hard keys' superblock kernels (K = 8 blocks of 16: 128 tokens) on a class of two sequences of 10 blocks that
    cross a superblock, and a class of a one-token and a short sequence: as separate float64 calls."""
    name, lengths = "vq_hard_rotated", [150, 1, 147, 7]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packing = Packing.from_bounds(bounds)
    assert [c.rows for c in packing.classes(L)] == [2, 2]  # (1, 7) in one block, (150, 147) in ten
    x = _inputs(name, bounds[-1], seed=4)
    leaves_ = [*x.values(), _codebook().requires_grad_()]

    def separate(*tensors):
        return _separate(name, dict(zip(x, tensors)), bounds, {"codebook": tensors[-1]})

    def packed(*tensors):
        cu = torch.tensor(bounds, dtype=torch.int32, device=tensors[0].device)
        return _call(name, vq.vq_attention, dict(zip(x, tensors)), cu_seqlens=cu, impl="triton",
                     codebook=tensors[-1])

    compare(separate, packed, leaves_)


@needs_triton
@pytest.mark.parametrize("name", ["vq_hard_rotated", "vq_soft_exact_cap", "window", "ovq"])
def test_triton_impl(name):
    """The fused kernels run the length classes (a batch of two short sequences and two of one each), in float32
    against the float64 definitions called one sequence at a time (relative RMS, as the other Triton tests)."""
    lengths = [5, 21, 1, 34]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = _inputs(name, bounds[-1])
    vq_case = CASES[name][0] is vq.vq_attention
    leaves_ = [*x.values(), *([_codebook().requires_grad_()] if vq_case else [])]

    def named(tensors):
        return dict(zip(x, tensors)), {"codebook": tensors[-1]} if vq_case else {}

    def separate(*tensors):
        return _separate(name, *named(tensors)[:1], bounds, named(tensors)[1])

    def packed(*tensors):
        cu = torch.tensor(bounds, dtype=torch.int32, device=tensors[0].device)
        return _call(name, CASES[name][0], named(tensors)[0], cu_seqlens=cu, impl="triton", **named(tensors)[1])

    compare(separate, packed, leaves_)  # compare moves the inputs to the kernels' device
