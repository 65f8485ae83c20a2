"""``memory_decay`` γ: each block of L keys keeps γ^L of its weight in ovq's memory for every block that joins
it later.

The definition (the naive impl) against a direct float64 sum over blocks written here; every other impl against the
definition, outputs and every input's gradient, with online slots, given slot weights, a memory cap, lengths that
are not multiples of the block, and a γ strong enough that the block impls run a long call in spans; chunked calls
continuing the state; the online assignment's kernel; bad values."""

import math

import pytest
import torch

from vqattn.ops.blocks import Schedule
from vqattn.ops.common.memory_decay import MAX_DECAY_E_FOLDS, span_blocks
from vqattn.ops.ovq import chunk_ovq_attention, ovq_attention
from vqattn.ops.ovq.memory import online_slots
from vqattn.ops.ovq.naive import naive_online_slots

from triton_helpers import DEVICE, as_impl_runs, needs_triton, triton_marked

F64 = torch.float64
B, H, D, S, L, CAP = 1, 2, 16, 6, 16, 40
SLOW = 0.98  # g = γ^L ≈ 0.72 per block
FAST = math.exp(-5 / L)  # g = e^−5: a pass of the block impls spans 6 blocks (4 new ones), so T = 100 runs in two
IMPLS = {
    "chunk-loop": dict(schedule=Schedule("loop", 3)),
    "chunk-cumsum": dict(schedule=Schedule("cumsum", 3)),
    "recurrent": dict(impl="recurrent"),
    "triton": dict(impl="triton"),  # float32, on the GPU, or under Triton's interpreter without one (conftest)
}


def inputs(T, *, given="online", dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(B, H, T, D, generator=g, dtype=F64).to(dtype) for n in ("q", "k", "v", "q_mem", "k_mem")}
    if given == "weights":
        tensors["slot_weights"] = torch.rand(B, H, T, S, generator=g, dtype=F64).to(dtype)
    return tensors, torch.randn(B, H, T, D, generator=g, dtype=F64)


def outputs_and_grads(fn, tensors, grad):
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
    out = fn(**leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach().double()] + [leaves[n].grad.double() for n in sorted(leaves)]


def direct_decayed(q, k, v, slots, gamma, cap):
    """The definition written out for given slots (B, H, T): query i in block b reads its window (blocks b − 1, b
    up to i) and the slots of blocks b' ≤ b − 2, each key there weighing g^(b−2−b'), g = γ^L: counts n, mean keys
    and values, logits σ q·k̄ + log n + log min(1, cap / Σ_s n_s)."""
    T, scale, g = q.shape[2], D**-0.5, gamma**L
    out = torch.empty_like(v)
    for i in range(T):
        b = i // L
        start = max(0, (b - 1) * L)
        window_logits = scale * (k[:, :, start : i + 1] @ q[:, :, i, :, None]).squeeze(-1)
        weights = torch.zeros(B, H, S, T, dtype=F64)  # weight of key j in slot s
        for j in range(max(0, (b - 1) * L)):
            weights[:, :, :, j] = torch.nn.functional.one_hot(slots[:, :, j], S).double() * g ** (b - 2 - j // L)
        n = weights.sum(-1)
        safe = torch.where(n > 0, n, torch.ones_like(n))
        key_means, value_means = weights @ k / safe[..., None], weights @ v / safe[..., None]
        bias = min(0.0, math.log(cap) - math.log(max(float(n[0, 0].sum()), 1.0)))
        slot_logits = torch.where(n > 0, scale * (key_means @ q[:, :, i, :, None]).squeeze(-1) + safe.log() + bias,
                                  float("-inf"))
        p = torch.softmax(torch.cat([window_logits, slot_logits], -1), -1)
        W = window_logits.shape[-1]
        out[:, :, i] = (p[..., :W, None] * v[:, :, start : i + 1]).sum(-2) + (p[..., W:, None] * value_means).sum(-2)
    return out


@pytest.mark.parametrize("gamma", [SLOW, FAST])
def test_the_definition_is_the_decayed_sum(gamma):
    tensors, _ = inputs(70)
    slots = torch.randint(0, S, (B, H, 70), generator=torch.Generator().manual_seed(2))
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    got = ovq_attention(q, k, v, num_slots=S, block_len=L, slots=slots, memory_cap=CAP, memory_decay=gamma,
                        impl="naive")
    torch.testing.assert_close(got, direct_decayed(q, k, v, slots, gamma, CAP), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", triton_marked(IMPLS))
@pytest.mark.parametrize("given", ["online", "weights"])
@pytest.mark.parametrize("gamma", [SLOW, FAST])
def test_every_impl_matches_the_definition(impl, given, gamma):
    """T = 100 (not a multiple of L; with FAST, the block impls run it in two spans)."""
    dtype = torch.float32 if impl == "triton" else F64
    tensors, grad = inputs(100, given=given, dtype=dtype)
    kw = dict(num_slots=S, block_len=L, memory_cap=CAP, memory_decay=gamma,
              threshold=None if given == "weights" else 1.1)
    op = chunk_ovq_attention if "schedule" in IMPLS[impl] else ovq_attention
    got = outputs_and_grads(as_impl_runs(lambda **t: op(**t, **kw, **IMPLS[impl]), impl), tensors, grad)
    ref = outputs_and_grads(lambda **t: ovq_attention(**{n: x.double() for n, x in t.items()}, **kw, impl="naive"),
                            tensors, grad)
    forgetless = ovq_attention(**{n: x.double() for n, x in tensors.items()}, **{**kw, "memory_decay": None},
                               impl="naive")
    assert (ref[0] - forgetless).abs().max() > 1e-3  # forgetting changes what the memory reads
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
    assert max(errors) < (1e-5 if dtype == torch.float32 else 1e-12), errors


def test_fast_forgetting_splits_long_calls():
    """The premise of the FAST cases: T = 100 exceeds one pass of the block impls (T = 150 two)."""
    assert (span_blocks(FAST**L) - 2) * L < 100 <= 2 * (span_blocks(FAST**L) - 2) * L
    assert span_blocks(SLOW**L) * L > 150


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
@pytest.mark.parametrize("gamma", [SLOW, FAST])
def test_chunked_calls_continue_the_decayed_state(impl, gamma):
    tensors, _ = inputs(150)
    kw = dict(num_slots=S, block_len=L, memory_cap=CAP, memory_decay=gamma, threshold=1.1)
    whole, whole_state = ovq_attention(**tensors, **kw, impl="chunk", return_state=True)
    state, parts = None, []
    for a, b in ((0, 45), (45, 46), (46, 96), (96, 150)):
        out, state = ovq_attention(**{n: x[:, :, a:b] for n, x in tensors.items()}, **kw, impl=impl, state=state,
                                   return_state=True)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=1e-10, atol=1e-12)
    for name in ("counts", "key_sums", "value_sums"):
        torch.testing.assert_close(getattr(state, name), getattr(whole_state, name), rtol=1e-10, atol=1e-12)


def test_gamma_one_forgets_nothing():
    tensors, _ = inputs(100)
    kw = dict(num_slots=S, block_len=L, threshold=1.1, impl="chunk")
    assert torch.equal(ovq_attention(**tensors, **kw, memory_decay=1.0), ovq_attention(**tensors, **kw))


@pytest.mark.parametrize("gamma", [SLOW, FAST])
def test_online_slots_forget(gamma):
    """The chunk impl's assignment and, on the kernel, the Triton one choose the definition's slots with
    forgetting (threshold 1.1: keys join slots, whose moving-average means differ from the plain ones)."""
    keys = torch.randn(B, H, 150, D, dtype=F64, generator=torch.Generator().manual_seed(3))
    counts, sums = torch.zeros(B, H, 48), torch.zeros(B, H, 48, D)
    want = naive_online_slots(keys, 48, L, 1.1, memory_decay=gamma)
    assert not torch.equal(want, naive_online_slots(keys, 48, L, 1.1))  # forgetting changes the choice
    assert torch.equal(online_slots(keys.float(), counts, sums, L, 1.1, gamma**L), want)


@needs_triton
@pytest.mark.parametrize("gamma", [SLOW, FAST])
def test_online_slots_kernel_forgets(gamma):
    from vqattn.ops.triton.online_slots import fused_online_slots

    keys = torch.randn(B, H, 150, D, dtype=F64, generator=torch.Generator().manual_seed(3))
    counts, sums = torch.zeros(B, H, 48), torch.zeros(B, H, 48, D)
    fused = fused_online_slots(keys.float().to(DEVICE), counts.to(DEVICE), sums.to(DEVICE), L, 1.1, gamma**L)
    assert torch.equal(fused.cpu(), naive_online_slots(keys, 48, L, 1.1, memory_decay=gamma))


@pytest.mark.parametrize("gamma,message", [
    (0.0, "memory_decay must be a number in \\(0, 1\\]"),
    (1.5, "memory_decay must be a number in \\(0, 1\\]"),
    (True, "memory_decay must be a number in \\(0, 1\\]"),
    ("0.9", "memory_decay must be a number in \\(0, 1\\]"),
    (math.exp(-(MAX_DECAY_E_FOLDS / 3 + 0.1) / L), "memory_decay=.* forgets too fast for block_len=16"),
])
def test_bad_decay_is_one_line_error(gamma, message):
    tensors, _ = inputs(20)
    with pytest.raises(ValueError, match=message):
        ovq_attention(**tensors, num_slots=S, block_len=L, memory_decay=gamma)


def _memory_with_a_closed_slot():
    """A memory whose slots 0..2 were opened and slot 1 forgotten to a zero count (float32 underflow after a long
    stream without a key for it), and a block whose first key is novel."""
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([3.0, 0.0, 2.0, 0.0, 0.0, 0.0]).expand(B, H, S).clone()
    key_sums = torch.randn(B, H, S, D, generator=g) * counts[..., None]
    keys = torch.randn(B, H, L, D, generator=g) * 10  # far from every mean: novel
    return keys, counts, key_sums


def test_a_forgotten_slot_stays_closed():
    """Slots open in order after the last opened one, never in a slot that forgetting closed (the definition, the
    chunk impl's assignment, and the kernel): the first novel key opens slot 3."""
    from vqattn.ops.ovq.memory import assign_block
    from vqattn.ops.ovq.naive import _assign_online

    keys, counts, key_sums = _memory_with_a_closed_slot()
    chunk = assign_block(keys, counts, key_sums, 0.1)
    assert chunk[0, 0, 0] == 3 and not (chunk == 1).any()
    naive = torch.tensor(_assign_online(keys[0, 0].double(), counts[0, 0].double(), key_sums[0, 0].double(), 0.1))
    assert torch.equal(naive, chunk[0, 0])


@needs_triton
def test_a_forgotten_slot_stays_closed_in_the_kernel():
    from vqattn.ops.ovq.memory import assign_block
    from vqattn.ops.triton.online_slots import fused_online_slots

    keys, counts, key_sums = _memory_with_a_closed_slot()
    fused = fused_online_slots(keys.to(DEVICE), counts.to(DEVICE), key_sums.to(DEVICE), L, 0.1).cpu()
    assert torch.equal(fused, assign_block(keys, counts, key_sums, 0.1))
