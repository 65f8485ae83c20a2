"""The hard vq step with superblock caches (vqattn/ops/triton/superblock.py) against the float64 definition: outputs
and every input's gradient (q, k, v, the codebook, the rotated window pair, a continued state's cache), by relative
RMS, at superblocks of K = 1, 2 and 3 blocks of 16 tokens, so that a sequence crosses several superblock
boundaries. Under Triton's interpreter on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

from vqattn.ops.blocks import Schedule
from vqattn.ops.common.statistics import map_time
from vqattn.ops.triton import superblock as superblock_module
from vqattn.ops.vq import VQState, naive_vq_attention, vq_assign, vq_attention

from triton_helpers import DEVICE, Allocations, compare, leaves, nan_empty, needs_triton, rel_rms  # noqa: F401 (a fixture)

pytestmark = [needs_triton, pytest.mark.usefixtures("nan_empty")]
B, H, D, DV, S, L = 2, 2, 16, 8, 24, 16
# The long sequence of each K: the fewest blocks that give 3 caches or more (a scan over more than one superblock),
# a gathered walk of every length 0 .. K − 1 and, for K > 1, a last cache read by fewer than K query blocks (a
# partial superblock), not a multiple of L: 5 blocks at K = 1 (4 caches), 6 at K = 2 and 8 at K = 3 (3 caches).
# The interpreter's time grows with the blocks.
LONG = {1: 70, 2: 90, 3: 120}


@pytest.fixture(params=[pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def K(request):
    """Blocks per superblock: 1 is the per-block caches, 2 and 3 gather one and two blocks' keys (the quick suite
    runs 2)."""
    return request.param


def design(K: int) -> Schedule:
    """The schedule whose kernels use superblocks of K blocks (0: the per-block walks)."""
    return Schedule(superblocks=K)


def inputs(window, T, scale=1.0, seed=0, batch=1, heads=H):
    """One sequence unless ``batch`` says more: the interpreter's time grows with the programs, one per (sequence,
    head) and block, and the definition's short tests run B sequences, which tell a sequence's stride from a
    head's. ``heads`` 1 for the properties of one head's numbers (scale, half types): H heads elsewhere tell a
    head's caches, codebook and bias from another's."""
    g = torch.Generator().manual_seed(seed)
    Dc = D // 2 if window == "rotated" else D
    n, h = batch, heads
    q, k, v, c = leaves((n, h, T, Dc), (n, h, T, D), (n, h, T, DV), (h, S, Dc), scale=scale, generator=g)
    rotated = leaves((n, h, T, D), (n, h, T, D), scale=scale, generator=g) if window == "rotated" else []
    return [q, k, v, c, *rotated]


def call(attention, window, impl=None, K=None, **kwargs):
    """attention(q, k, v, c[, q_rot, k_rot]): hard keys, the straight-through window ("codes"), the raw keys'
    ("exact"), or RoPE's rotated pair with the codes scored on fewer dims ("rotated"), as the layers call it; with
    superblocks of K blocks when K is given."""
    extra = ({} if impl is None else {"impl": impl}) | ({} if K is None else {"schedule": design(K)})

    def run(q, k, v, c, *rotated):
        kw = dict(causal=True, assign="hard", block_len=L, exact_window=window != "codes", **extra, **kwargs)
        if rotated:
            kw.update(q_rot=rotated[0], k_rot=rotated[1], assignment=vq_assign(k[..., :c.shape[-1]], c, assign="hard"))
        return attention(q, k, v, c, **kw)

    return run


class Float32Allocations(Allocations):
    """The shapes of the float32 tensors allocated while it is active: the kernels' (the float64 definition's are
    left out)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("empty", "zeros", "new_empty", "new_zeros")) and out.dtype == torch.float32:
            self.shapes.append(tuple(out.shape))
        return out


def slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


# A covering set, not the cross product: at T = 1 and 20 (one and two blocks: one cache, no gathered keys) K reads
# nothing, so each window runs once, in one sequence; at T = 47 (3 blocks, two sequences) K = 1 reads a second
# cache and K = 2, 3 gather block 0 alike, so the raw-key and the rotated window (whose code queries are a tensor
# of their own) run with K = 1 and with K = 2 or 3, the codes (the raw keys' kernels on straight-through keys) once;
# at the long T every K runs the raw-key and the rotated window (with test_memory_cap's cases, which take the other
# one of each K) and the codes once. K = 1 and the long T in the whole suite only, as before.
@pytest.mark.parametrize("K, window, T", [
    slow(1, "codes", 1), (2, "exact", 1), (3, "rotated", 1),
    (2, "codes", 20), (3, "exact", 20), slow(1, "rotated", 20),
    (3, "codes", 47), slow(1, "exact", 47), (2, "exact", 47), slow(1, "rotated", 47),
    (3, "rotated", 47),
    slow(1, "exact", "long"), slow(2, "rotated", "long"),
    slow(3, "exact", "long"), slow(3, "codes", "long")])
def test_superblocks_equal_the_definition(K, window, T):
    """T = 1, shorter than two blocks, not a multiple of L or of K·L (in two sequences), and the long sequence
    (LONG: 3 or more superblocks, the last one partial). On the long sequence the forward and backward also
    allocate caches and cache gradients for ⌊(nb − 2)/K⌋ + 1 superblocks, and no per-block (nb, S, Dv) tensor."""
    if T != "long":
        compare(call(naive_vq_attention, window), call(vq_attention, window, "triton", K),
                inputs(window, T, batch=B if T == 47 else 1))
        return
    T = LONG[K]
    nb = -(-T // L)
    with Float32Allocations() as seen:
        compare(call(naive_vq_attention, window), call(vq_attention, window, "triton", K), inputs(window, T))
    assert (H, superblock_module.superblocks(nb, K), S, DV) in seen.shapes  # one sequence
    assert not {(H, nb, S, DV), (1, H, nb, S, DV)} & set(seen.shapes) or K == 1


# Every K once, with the window test_superblocks_equal_the_definition's long sequence does not run it with (the bias
# is on the code logits, the same for every window); two heads: one bias per block, for every head.
@pytest.mark.parametrize("K, window", [slow(1, "rotated"), (2, "exact"), slow(3, "rotated")])
def test_memory_cap_biases_gathered_keys_and_caches_alike(K, window):
    """The memory bound's bias log min(1, M / n_b) is on every code logit of query block b: its cache's and its
    gathered keys' (blocks 4 on: 48 keys or more before the window, M = 40)."""
    compare(call(naive_vq_attention, window, memory_cap=40), call(vq_attention, window, "triton", K, memory_cap=40),
            inputs(window, LONG[K], seed=1))


@pytest.mark.slow
def test_large_logits_and_empty_codes(K):
    """Inputs at 4× the scale and half the codes far from every key (empty in every cache, yet the largest
    logits); one head."""
    x = inputs("exact", LONG[K], scale=2.0, seed=2, heads=1)
    with torch.no_grad():
        x[3][:, S // 2:] *= 20
    compare(call(naive_vq_attention, "exact"), call(vq_attention, "exact", "triton", K), x, tol=1e-4)


# Every K once and each window: the window keys a state keeps and the superblock caches it continues are apart.
@pytest.mark.parametrize("K, window", [slow(1, "exact"), (2, "rotated"), slow(3, "exact")])
def test_chunked_calls_equal_one_call(K, window):
    """A sequence fed as 3 chunks (each state continued across a superblock boundary, its kept state folded from
    a cache and the blocks after it) equals one call, and the state equals the chunk impl's; one head (a state's
    heads: test_gradients_through_a_continued_state)."""
    q, k, v, c, *rotated = (x.detach().to(DEVICE, torch.float32) for x in inputs(window, 150, heads=1))
    whole = call(vq_attention, window, "triton", K)(q, k, v, c, *rotated)
    outs, state = [], None
    for t0, t1 in ((0, 61), (61, 110), (110, 150)):
        piece = lambda x: x[:, :, t0:t1]  # noqa: E731
        out, state = call(vq_attention, window, "triton", K, state=state, return_state=True)(
            piece(q), piece(k), piece(v), c, *map(piece, rotated))
        outs.append(out)
    assert rel_rms(torch.cat(outs, 2), whole) < 1e-6
    _, chunk_state = call(vq_attention, window, "chunk", return_state=True)(q, k, v, c, *rotated)
    assert rel_rms(state.sums, chunk_state.sums) < 1e-6 and rel_rms(state.counts, chunk_state.counts) < 1e-6


def test_gradients_through_a_continued_state(K):
    """A continued state whose counts and sums are leaves, and the kept state's counts and sums in the loss: their
    gradients (the initial cache's, through every cache and the kept state; the values', through the kept state)
    against the chunk impl in float64; the continued call as long as LONG[K]."""
    q, k, v, c = (x.detach() for x in inputs("exact", 70 + LONG[K], seed=4))
    _, state = vq_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], c, causal=True, block_len=L,
                            exact_window=True, impl="chunk", return_state=True)
    counts, sums = (x.detach().requires_grad_() for x in (state.counts, state.sums))

    def run_with(impl, dtype, device):
        def run(q, k, v, c, counts, sums):
            start = VQState(counts, sums, *(x.to(device, dtype) for x in (state.keys, state.values)), state.length,
                            state.block_len, map_time(lambda x: x.to(device), state.assignment))
            out, after = vq_attention(q, k, v, c, causal=True, block_len=L, exact_window=True, impl=impl, state=start,
                                      return_state=True, schedule=design(K))
            return out.sum(-1) + after.counts.sum(-1, keepdim=True) + after.sums.sum((-1, -2)).unsqueeze(-1)
        return run

    rest = [x[:, :, 70:].clone().requires_grad_() for x in (q, k, v)]
    compare(run_with("chunk", torch.float64, "cpu"), run_with("triton", torch.float32, DEVICE),
            [*rest, c.clone().requires_grad_(), counts, sums])


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), pytest.param(torch.float16, 2e-3, marks=pytest.mark.slow)])
def test_half_inputs(dtype, tol):
    """Half q, k, v (and codebook) accumulate in float32: within the half type's rounding of the definition, which
    reads the rounded inputs (so that no argmin flips between the two); one head."""
    rounded = [x.detach().to(dtype).double().requires_grad_() for x in inputs("rotated", LONG[2], seed=5, heads=1)]
    compare(call(naive_vq_attention, "rotated"), call(vq_attention, "rotated", "triton", 2), rounded, dtype=dtype,
            tol=tol)


def test_superblock_count():
    """Query block b reads cache ⌊max(b−1, 0)/K⌋: a sequence of nb blocks reads that many plus one."""
    for K in (1, 2, 3, 8):
        for nb in range(1, 40):
            assert superblock_module.superblocks(nb, K) == max(max(b - 1, 0) // K for b in range(nb)) + 1


def test_per_block_walks_stay_available():
    """superblocks = 0 runs hard keys through the per-block walks (block_caches.py), the design the GPU
    tables compare against."""
    compare(call(naive_vq_attention, "exact"), call(vq_attention, "exact", "triton", 0), inputs("exact", 60))
