"""ovq_attention: chunk and recurrent against the naive token loop in float64 (outputs and gradients), carried
state, causality, the online growth rule's edge cases, empty slots, autocast, torch.compile and bad arguments."""

import functools
import math

import pytest
import torch

from vqattn.ops import graphs
from vqattn.ops.ovq import (
    OVQState,
    chunk_ovq_attention,
    memory,
    naive_ovq_attention,
    ovq_attention,
    recurrent_ovq_attention,
)
from vqattn.ops.ovq.memory import assign_block
from vqattn.ops.ovq.naive import _assign_online, naive_online_slots
from vqattn.ops.vq import RECURRENT_MAX_LEN

from references import ref_softmax_attention

F64 = torch.float64
B, H, D, Dv, L, S = 2, 2, 6, 5, 4, 6
# A key's squared distance to a slot's mean over its own squared norm averages 1 + 1/n here: at 1.4 the first block
# opens 4 slots, later blocks open the rest one by one, and all S are full by position 5L
# (test_slots_open_over_several_blocks_and_fill_up).
THRESHOLD = 1.4
# "-drop": overflow="drop"; "-narrow": memory keys of Dm = 4 < D features; "-pairs": the memory keeps q's and k's
# pairs m ≥ 1 (memory_first_pair); "slots-dropped": given slots, some −1
MODES = ["online", "online-greedy", "online-separate", "online-drop", "online-narrow-drop", "online-pairs-drop",
         "slots", "slots-dropped", "weights"]
Dm = 4


def make_inputs(T, mode, seed=0, dtype=F64):
    """q, k, v and the op's keyword tensors (all differentiable ones in ``tensors``) for one mode."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    tensors, fixed = {"q": q, "k": k, "v": v}, {"num_slots": S, "block_len": L}
    if mode == "online":
        fixed["threshold"] = THRESHOLD
    elif mode == "online-separate":
        fixed["threshold"] = THRESHOLD
        tensors["q_mem"], tensors["k_mem"] = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    elif mode == "online-drop":
        fixed["threshold"], fixed["overflow"] = THRESHOLD, "drop"
    elif mode == "online-pairs-drop":
        fixed["threshold"], fixed["overflow"], fixed["memory_first_pair"] = THRESHOLD, "drop", 1
    elif mode == "online-narrow-drop":
        fixed["threshold"], fixed["overflow"] = THRESHOLD, "drop"
        tensors["q_mem"], tensors["k_mem"] = (torch.randn(B, H, T, Dm, generator=g, dtype=dtype) for _ in range(2))
    elif mode.startswith("slots"):
        fixed["slots"] = torch.randint(-1 if mode == "slots-dropped" else 0, S, (B, H, T), generator=g)
    elif mode == "weights":
        tensors["slot_weights"] = torch.rand(B, H, T, S, generator=g, dtype=dtype)
    return tensors, fixed


def outputs_and_grads(fn, tensors, fixed):
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in tensors.items()}
    out = fn(**leaves, **fixed)
    seed = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=seed, dtype=out.dtype).to(out.device)
    # materialize_grads: the memory keys are unused while the memory is empty
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out, materialize_grads=True)
    return out.detach(), dict(zip(leaves, grads))


def assert_same(a, b, tol=1e-11):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, atol=tol, rtol=tol)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=tol, rtol=tol, msg=f"grad of {name}")


def in_chunks(sizes):
    """ovq_attention over consecutive chunks of the given sizes (the rest in one), carrying the state."""
    def run(**kw):
        T = kw["q"].shape[2]
        outs, state, a = [], None, 0
        for n in sizes + [T - sum(sizes)] * (T > sum(sizes)):
            piece = {name: x[:, :, a : a + n] if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
            out, state = ovq_attention(**piece, state=state, return_state=True)
            assert isinstance(state, OVQState) and state.length == a + n and state.keys.shape[2] < 2 * L
            outs.append(out)
            a += n
        return torch.cat(outs, 2)
    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, L - 1, L, 2 * L + 3, 5 * L + 1])
@pytest.mark.parametrize("schedule", ["loop", "cumsum"])
def test_chunk_and_recurrent_match_naive(T, mode, schedule):
    tensors, fixed = make_inputs(T, mode)
    naive = outputs_and_grads(naive_ovq_attention, tensors, fixed)
    assert_same(outputs_and_grads(functools.partial(chunk_ovq_attention, schedule=schedule), tensors, fixed), naive)
    assert_same(outputs_and_grads(recurrent_ovq_attention, tensors, fixed), naive)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [[1] * 21, [6, 1, 2, 1, 7], [9, 5], [3, 11]])
def test_chunked_calls_with_carried_state_match_naive(sizes, mode):
    tensors, fixed = make_inputs(5 * L + 1, mode)
    naive = outputs_and_grads(naive_ovq_attention, tensors, fixed)
    assert_same(outputs_and_grads(in_chunks(sizes), tensors, fixed), naive)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["online", "online-separate"])
@pytest.mark.parametrize("sizes", [[], [9, 5]], ids=["one_call", "carried_state"])
def test_cuda_graphed_online_assignment_matches_naive(sizes, mode):
    """On a GPU the online assignment's block loop replays a captured CUDA graph: float64 on CUDA against the
    naive loop on the CPU, three inputs through the same graphs (replays on new data), carried state included."""
    graphs._GRAPHS.clear()
    for seed in range(3):
        tensors, fixed = make_inputs(5 * L + 1, mode, seed=seed)
        naive = outputs_and_grads(naive_ovq_attention, tensors, fixed)
        fn = in_chunks(sizes) if sizes else chunk_ovq_attention
        out, grads = outputs_and_grads(fn, {name: t.cuda() for name, t in tensors.items()}, fixed)
        assert_same((out.cpu(), {name: g.cpu() for name, g in grads.items()}), naive)
    assert any(key[0] is memory._online_slots_loop for key in graphs._GRAPHS)  # the graph ran, not the eager loop


def test_slots_open_over_several_blocks_and_fill_up():
    """The parametrised cases exercise growth: slots open in several blocks and all S are full by the end."""
    tensors, fixed = make_inputs(5 * L + 1, "online")
    occupied = []
    state = None
    for t in range(5 * L + 1):
        _, state = recurrent_ovq_attention(**{n: x[:, :, t : t + 1] for n, x in tensors.items()}, **fixed,
                                           state=state, return_state=True)
        occupied.append(state.occupied)
    occupied = torch.stack(occupied, -1)  # (B, H, T)
    assert (occupied[..., -1] == S).all()
    assert ((occupied > L) & (occupied < S)).any(), "no slot opened after the first block"
    out = chunk_ovq_attention(**tensors, **fixed)
    window_only = ref_softmax_attention(tensors["q"][:, :, 2 * L :], tensors["k"], tensors["v"], causal=False)
    assert not torch.allclose(out[:, :, 2 * L :], window_only)


@pytest.mark.parametrize("mode", MODES)
def test_is_causal(mode):
    T, t0 = 5 * L + 1, 2 * L + 1
    tensors, fixed = make_inputs(T, mode)
    before = chunk_ovq_attention(**tensors, **fixed)
    future = {n: 10 * torch.randn_like(x[:, :, t0:]) for n, x in tensors.items()}
    future["slot_weights"] = future.get("slot_weights", torch.zeros(())).abs()  # weights stay >= 0
    changed = {n: torch.cat([x[:, :, :t0], future[n]], 2) for n, x in tensors.items()}
    if "slots" in fixed:
        fixed["slots"] = torch.cat([fixed["slots"][:, :, :t0], (fixed["slots"][:, :, t0:] + 1) % S], 2)
    after = chunk_ovq_attention(**changed, **fixed)
    torch.testing.assert_close(after[:, :, :t0], before[:, :, :t0], atol=0, rtol=0)
    assert not torch.allclose(after[:, :, t0:], before[:, :, t0:])


def test_keys_get_gradients_through_the_memory():
    """A key of block 0 reaches the queries of block 2 only through its slot's mean key and mean value."""
    tensors, fixed = make_inputs(3 * L, "online")
    k = tensors["k"].clone().requires_grad_(True)
    out = chunk_ovq_attention(tensors["q"], k, tensors["v"], **fixed)
    (grad,) = torch.autograd.grad(out[:, :, 2 * L :].sum(), k)
    assert grad[:, :, :L].abs().amin() > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, L + 1, 2 * L])
def test_is_softmax_while_the_memory_is_empty(T, mode):
    tensors, fixed = make_inputs(T, mode)
    ref = ref_softmax_attention(tensors["q"], tensors["k"], tensors["v"], causal=True)
    for op in (chunk_ovq_attention, recurrent_ovq_attention, naive_ovq_attention):
        torch.testing.assert_close(op(**tensors, **fixed), ref, atol=1e-12, rtol=0)


def _random_memory(occupied, seed):
    """Counts (B, H, S) and key sums with slots 0..occupied−1 holding 1-3 random keys."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 4, (B, H, S), generator=g).to(F64) * (torch.arange(S) < occupied)
    return counts, torch.randn(B, H, S, D, generator=g, dtype=F64) * counts.unsqueeze(-1)


@pytest.mark.parametrize("occupied", [0, 2, S])
@pytest.mark.parametrize("threshold", [0.0, THRESHOLD, math.inf])
def test_assign_block_matches_the_per_key_definition(occupied, threshold):
    for seed in range(3):
        counts, key_sums = _random_memory(occupied, seed)
        keys = torch.randn(B, H, L + 3, D, generator=torch.Generator().manual_seed(seed + 10), dtype=F64)
        got = assign_block(keys, counts, key_sums, threshold)
        for b in range(B):
            for h in range(H):
                assert got[b, h].tolist() == _assign_online(keys[b, h], counts[b, h], key_sums[b, h], threshold)


def test_growth_edge_cases():
    keys = torch.randn(1, 1, S + 2, D, generator=torch.Generator().manual_seed(3), dtype=F64)
    empty = torch.zeros(1, 1, S, dtype=F64), torch.zeros(1, 1, S, D, dtype=F64)
    # Empty memory: every key is novel; the first S open slots 0..S−1, the last two join their nearest opener.
    got = assign_block(keys, *empty, math.inf)[0, 0].tolist()
    assert got[:S] == list(range(S))
    for j in (S, S + 1):
        assert got[j] == int(((keys[0, 0, j] - keys[0, 0, :S]) ** 2).sum(-1).argmin())
    # All S slots full: nothing opens, whatever the threshold; every key joins its nearest mean.
    full_counts = torch.ones(1, 1, S, dtype=F64)
    means = torch.randn(1, 1, S, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    nearest = ((keys[0, 0, :, None] - means[0, 0, None]) ** 2).sum(-1).argmin(-1).tolist()
    assert assign_block(keys, full_counts, means, 0.0)[0, 0].tolist() == nearest
    # A tie goes to the lowest slot: two slots with the same mean.
    twin = means.clone()
    twin[0, 0, 3] = twin[0, 0, 1]
    got = assign_block(twin[:, :, 1:2].clone(), full_counts, twin, 0.0)[0, 0].tolist()
    assert got == [1]
    # One free slot, threshold 0: the first key opens it, a duplicate of it joins it rather than an old slot.
    counts = torch.ones(1, 1, S, dtype=F64) * (torch.arange(S) < S - 1)
    far = means[:, :, :1] + 100.0
    got = assign_block(torch.cat([far, far], 2), counts, means * counts.unsqueeze(-1), 0.0)[0, 0].tolist()
    assert got == [S - 1, S - 1]


@pytest.mark.parametrize("op", [chunk_ovq_attention, recurrent_ovq_attention, naive_ovq_attention])
def test_empty_slots_give_no_nan(op):
    """Many more slots than keys (online and given): outputs and gradients are finite."""
    for mode in ("online", "slots", "weights"):
        tensors, fixed = make_inputs(3 * L + 2, mode)
        fixed["num_slots"] = 40
        if mode == "slots":
            fixed["slots"] = torch.zeros(B, H, 3 * L + 2, dtype=torch.long)
        if mode == "weights":
            w = torch.zeros(B, H, 3 * L + 2, 40, dtype=F64)
            w[..., 5] = 0.5
            tensors["slot_weights"] = w
        out, grads = outputs_and_grads(op, tensors, fixed)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values())


def test_bf16_autocast_and_half_inputs_match_fp32_loosely():
    tensors, fixed = make_inputs(5 * L + 1, "online", dtype=torch.float32)
    ref = chunk_ovq_attention(**tensors, **fixed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunk_ovq_attention(**tensors, **fixed)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)  # the op turns autocast off
    half = chunk_ovq_attention(**{n: x.bfloat16() for n, x in tensors.items()}, **fixed)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, atol=0.1, rtol=0.1)


@pytest.mark.slow
# "weights" runs the statistics of "slots" as a matmul instead of an index_add: its eager tests cover it
@pytest.mark.parametrize("mode", ["online", "slots"])
def test_torch_compile_matches_eager(mode):
    tensors, fixed = make_inputs(3 * L + 2, mode, dtype=torch.float32)
    leaves = {n: x.requires_grad_(True) for n, x in tensors.items()}

    def f(**kw):
        return chunk_ovq_attention(**kw, **fixed)

    eager = f(**leaves)
    g_eager = torch.autograd.grad(eager.square().sum(), list(leaves.values()))
    # traced and differentiated as inductor sees it; inductor's code for it: tests/model/test_compile.py's ovq model
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(**leaves)
    g_compiled = torch.autograd.grad(compiled.square().sum(), list(leaves.values()))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _compiled_graph(T: int, mode: str = "online") -> list:
    """The nodes of the graph torch.compile captures (fullgraph) for chunk_ovq_attention at length T."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(list(gm.graph.nodes))
        return gm.forward

    tensors, fixed = make_inputs(T, mode, dtype=torch.float32)
    torch._dynamo.reset()
    torch.compile(functools.partial(chunk_ovq_attention, **fixed), backend=backend, fullgraph=True)(**tensors)
    return graphs[0]


def test_compile_keeps_the_online_assignment_one_operator():
    """torch.compile sees the block loop of the online assignment as one operator, not unrolled per block: the
    captured graph has the same nodes at any number of blocks."""
    short, long = _compiled_graph(3 * L + 2), _compiled_graph(12 * L + 1)
    assert torch.ops.vqattn.ovq_online_slots.default in [node.target for node in short]
    assert len(long) == len(short)


@pytest.mark.parametrize("mode", ["online", "slots"])
def test_compiled_graph_is_linear_in_length(mode):
    """No intermediate of the compiled op grows faster than T (per-block statistics were once a (T, nb·S)
    one-hot matrix under compile): 4× the length, at most 4× the largest tensor."""
    def largest(T):
        values = [node.meta.get("example_value") for node in _compiled_graph(T, mode)]
        return max(v.numel() for v in values if isinstance(v, torch.Tensor))

    assert largest(64 * L) <= 4 * largest(16 * L)


def test_auto_picks_recurrent_for_short_continuations():
    tensors, fixed = make_inputs(2 * L + 1, "online")
    _, state = ovq_attention(**{n: x[:, :, :-1] for n, x in tensors.items()}, **fixed, return_state=True)
    last = {n: x[:, :, -1:] for n, x in tensors.items()}
    auto = ovq_attention(**last, **fixed, state=state)
    torch.testing.assert_close(auto, recurrent_ovq_attention(**last, **fixed, state=state), atol=0, rtol=0)
    assert RECURRENT_MAX_LEN >= 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=0), "num_slots"),
    (dict(num_slots=2.5), "num_slots"),
    (dict(block_len=0), "block_len"),
    (dict(threshold=-1.0), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold=1.0, slots=torch.zeros(B, H, 7, dtype=torch.long)), "threshold"),
    (dict(slots=torch.zeros(B, H, 6, dtype=torch.long)), "slots"),
    (dict(slots=torch.zeros(B, H, 7)), "slots"),
    (dict(slot_weights=torch.zeros(B, H, 7, S + 1, dtype=F64)), "slot_weights"),
    (dict(slots=torch.zeros(B, H, 7, dtype=torch.long), slot_weights=torch.zeros(B, H, 7, S, dtype=F64)), "slots"),
    (dict(q_mem=torch.zeros(B, H, 7, D + 1, dtype=F64)), "q_mem"),
    (dict(k_mem=torch.zeros(B, H, 7, D, dtype=torch.float32)), "k_mem"),
    (dict(scale=0.0), "scale"),
    (dict(impl="fast"), "impl"),
    (dict(impl="naive", return_state=True), "impl='naive'"),
    (dict(state="nope"), "state"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    tensors, fixed = make_inputs(7, "online")
    fixed.pop("threshold")
    with pytest.raises(ValueError, match=match):
        ovq_attention(**tensors, **{**fixed, **kwargs})


def test_bad_state_raises_value_error():
    tensors, fixed = make_inputs(7, "online")
    _, state = ovq_attention(**tensors, **fixed, return_state=True)
    with pytest.raises(ValueError, match="num_slots"):
        ovq_attention(**tensors, **{**fixed, "num_slots": S + 1}, state=state)
    with pytest.raises(ValueError, match="block_len"):
        ovq_attention(**tensors, **{**fixed, "block_len": L + 1}, state=state)
    with pytest.raises(ValueError, match="k_mem"):
        ovq_attention(**tensors, **fixed, k_mem=tensors["k"], state=state)
    with pytest.raises(ValueError, match="q must"):
        ovq_attention(tensors["q"][0], tensors["k"], tensors["v"], **fixed)


@pytest.mark.parametrize("means", [False, True], ids=["sums", "means"])
@pytest.mark.parametrize("nb", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("loop", [True, False], ids=["loop", "cumsum"])
def test_lagged_sum_matches_its_definition_with_gradients(nb, loop, means):
    from vqattn.ops.ovq.memory import lagged_sum

    g = torch.Generator().manual_seed(nb)
    occupied = torch.tensor([0.0, 1, 1, 1], dtype=torch.float64)  # slot 0 stays empty: no keys, count 0
    x = (torch.randn(2, 3, nb, 4, 5, dtype=torch.float64, generator=g) * occupied[:, None]).requires_grad_()
    x0 = (torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=g) * occupied[:, None]).requires_grad_()
    counts = (torch.rand(2, 3, nb, 4, generator=g, dtype=torch.float64) + 0.5) * occupied
    counts = counts.requires_grad_() if means else None
    got = lagged_sum(x, x0, 2, loop, counts=counts)
    # the memory block b reads: the state's plus every block at least two before it, over its counts
    sums = [x0 + x[:, :, : max(b - 1, 0)].sum(2) for b in range(nb)]
    if means:  # an empty slot's mean is 0, with no gradient and no NaN
        sums = [torch.where(counts[:, :, b, :, None] > 0, s / counts[:, :, b, :, None].clamp_min(1e-300), 0)
                for b, s in enumerate(sums)]
    expected = torch.stack(sums, 2) if nb else x[:, :, :0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if nb:
        inputs = (x, x0, *([counts] if means else []))
        # the kernel gives empty slots logit −inf, so their means get no gradient
        weights = torch.randn(got.shape, dtype=torch.float64, generator=g) * occupied[:, None]
        grads = torch.autograd.grad((got * weights).sum(), inputs)
        expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
        for a, b in zip(grads, expected_grads):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threshold", [0.0, THRESHOLD])
def test_dropped_keys_are_the_novel_ones_once_the_slots_are_full(threshold):
    """overflow="drop": the online assignment (block loop) gives the definition's slots, −1 for exactly the keys that
    "nearest" sends to a slot although they are novel; the stored keys keep the slots "nearest" gives them up to
    the first dropped key, and the memory never holds a dropped key."""
    tensors, _ = make_inputs(5 * L + 1, "online")
    keys = tensors["k"]
    empty = keys.new_zeros(B, H, S), keys.new_zeros(B, H, S, D)
    dropped = memory.online_slots(keys, *empty, L, threshold, drop=True)
    torch.testing.assert_close(dropped, naive_online_slots(keys, S, L, threshold, drop=True), rtol=0, atol=0)
    assert (dropped == -1).any() and (dropped >= 0).any()
    kept = memory.online_slots(keys, *empty, L, threshold)
    assert (kept >= 0).all()
    first = (dropped == -1).flatten(0, 1).float().argmax(-1).min()  # the earliest drop over every batch·head
    assert torch.equal(dropped[..., :first], kept[..., :first])
    out = chunk_ovq_attention(**tensors, num_slots=S, block_len=L, threshold=threshold, overflow="drop",
                              return_state=True)[1]
    assert torch.equal(out.counts, torch.nn.functional.one_hot(dropped[..., : out.length // L * L - L].clamp_min(0), S)
                       .mul((dropped[..., : out.length // L * L - L] >= 0).unsqueeze(-1)).sum(2).to(out.counts))
