"""The Triton form of ovq_attention (online assignment kernel, attention through the fused window + codes kernel
with one codebook per block) against the float64 definition: outputs, every input's gradient, and the slots the
assignment chooses; and the fused decoding step of vq, window and ovq against their recurrent forms. On a machine
without a GPU the kernels run under Triton's interpreter, which runs every program in Python: the shapes stay tiny
(B=1, H=2, D=16, S=8, L=16, T ≤ 70)."""

from __future__ import annotations

import pytest
import torch

from vqattn.ops.common.statistics import one_hot_rows
from vqattn.ops.ovq import naive_ovq_attention, ovq_attention
from vqattn.ops.ovq.memory import online_slots
from vqattn.ops.ovq.naive import naive_online_slots
from vqattn.ops.triton.decode import fused_decode_step
from vqattn.ops.triton.online_slots import fused_online_slots
from vqattn.ops.utils import pick_impl
from vqattn.ops.vq import vq_attention
from vqattn.ops.window import window_attention

from triton_helpers import DEVICE, compare, leaves, nan_empty, needs_triton, rel_rms  # noqa: F401 (a fixture)

pytestmark = [needs_triton, pytest.mark.usefixtures("nan_empty")]
B, H, D, S, L = 1, 2, 16, 8, 16


def ovq_call(attention, given, **kwargs):
    """attention(q, k, v[, extra]) with the assignment ``given``: "online" (kwargs carry the threshold), "slots"
    (fixed random slots), "slots-dropped" (some of them −1), "weights" (slot_weights, an input), "memory" (online,
    with q_mem, k_mem inputs) or "memory-narrow" (q_mem, k_mem of D / 2 features)."""
    generator = torch.Generator().manual_seed(1)

    def call(q, k, v, *extra, **more):
        kw = dict(num_slots=S, block_len=L, **kwargs, **more)
        if given.startswith("slots"):
            low = -1 if given == "slots-dropped" else 0
            kw["slots"] = torch.randint(low, S, q.shape[:3], generator=generator).to(q.device)
        elif given == "weights":
            kw["slot_weights"] = extra[0]
        elif given.startswith("memory"):
            kw["q_mem"], kw["k_mem"] = extra
        return attention(q, k, v, **kw)

    return call


def ovq_inputs(given, T, scale=1.0):
    extra = {"weights": [(B, H, T, S)], "memory": [(B, H, T, D)] * 2,
             "memory-narrow": [(B, H, T, D // 2)] * 2}.get(given, [])
    inputs = leaves((B, H, T, D), (B, H, T, D), (B, H, T, D), *extra, scale=scale)
    if given == "weights":
        inputs[3] = inputs[3].detach().abs().requires_grad_()
    return inputs


# Both overflows where keys go novel with the slots full (thresholds 0 and 1.3); at inf no key is novel once the
# first block has filled the slots, so the overflow is never read and one case runs
@pytest.mark.parametrize("threshold,overflow", [(0.0, "nearest"), (0.0, "drop"), (1.3, "nearest"), (1.3, "drop"),
                                                (float("inf"), "nearest")])
def test_online_assignment(threshold, overflow):
    """Online slots at thresholds where the slots run out (0: every key novel; inf: the first block fills them)
    and where keys join slots (1.3), T = 70: not a multiple of L; novel keys without a slot join the nearest or
    are dropped."""
    kw = dict(threshold=threshold, overflow=overflow)
    compare(ovq_call(naive_ovq_attention, "online", **kw), ovq_call(ovq_attention, "online", impl="triton", **kw),
            ovq_inputs("online", 70))


# Every assignment at T = 70 (a memory); below 2L no block reads the memory, so T = 1 and 20 share the assignments
# out between them (given slots and narrow memory keys at 1, dropped slots, weights and memory keys at 20)
@pytest.mark.parametrize("given,T", [*((g, 70) for g in ("slots", "slots-dropped", "weights", "memory", "memory-narrow")),
                                     ("slots", 1), ("memory-narrow", 1), ("slots-dropped", 20), ("weights", 20),
                                     ("memory", 20)])
def test_given_assignment_and_memory_queries(given, T):
    """Given slots (some −1: not stored) and slot weights (with their gradient) and separate memory queries and
    keys (memory_rope=False; narrower than the window's, with dropped keys), at T = 1, T < 2L (no memory) and
    T = 70."""
    kw = dict(threshold=1.3, overflow="drop") if given == "memory-narrow" else {}
    compare(ovq_call(naive_ovq_attention, given, **kw), ovq_call(ovq_attention, given, impl="triton", **kw),
            ovq_inputs(given, T))


@pytest.mark.parametrize("drop", [False, True], ids=["nearest", "drop"])
@pytest.mark.parametrize("threshold,num_slots", [(0.0, S), (1.1, 48), (float("inf"), S)])
def test_slots_equal_the_definitions(threshold, num_slots, drop):
    """The kernel's slots equal the definition's and the chunk form's, key for key (T = 70: a partial last
    block), from an empty memory and, for the chunk form, continuing a memory; with dropped keys (−1) too."""
    keys = torch.randn(B, H, 70, D, dtype=torch.float64)
    counts, sums = torch.zeros(B, H, num_slots), torch.zeros(B, H, num_slots, D)
    fused = fused_online_slots(keys.float().to(DEVICE), counts.to(DEVICE), sums.to(DEVICE), L, threshold,
                               drop=drop).cpu()
    assert torch.equal(fused, naive_online_slots(keys, num_slots, L, threshold, drop=drop))
    assert torch.equal(fused, online_slots(keys.float(), counts, sums, L, threshold, drop=drop))
    assert drop == bool((fused == -1).any()) or threshold == 1.1  # at 1.1 the 48 slots never run out
    # continuing the memory of the first 32 keys
    head = one_hot_rows(naive_online_slots(keys[:, :, :32], num_slots, L, threshold, drop=drop), num_slots,
                        torch.float32)
    counts, sums = head.sum(2), head.transpose(-1, -2) @ keys[:, :, :32].float()
    tail = fused_online_slots(keys[:, :, 32:].float().to(DEVICE), counts.to(DEVICE), sums.to(DEVICE), L, threshold,
                              drop=drop)
    assert torch.equal(tail.cpu(), online_slots(keys[:, :, 32:].float(), counts, sums, L, threshold, drop=drop))


@pytest.mark.parametrize("threshold,drop", [(0.0, False), (0.0, True), (1.1, False), (float("inf"), False)])
@pytest.mark.parametrize("tile", [16, 64])
def test_every_slot_tile_candidate_gives_the_definitions_slots(tile, threshold, drop, monkeypatch):
    """The online assignment's launch candidates (SLOTS_CONFIGS) differ in their slot tile, which changes how the
    slots are walked, never which they are: 48 slots in tiles of 16 through the scratch memory, and in one tile of
    64 held in registers, with slots that run out (thresholds 0 and 1.1; at 0 the novel keys left over join their
    nearest slot or are dropped) or never open past the first (inf)."""
    from vqattn.ops.triton import online_slots as module

    kernel = module._online_slots_kernel
    config = next(c for c in kernel.candidates if c.kwargs["BS"] == tile)
    monkeypatch.setattr(kernel, "configs", [config])
    monkeypatch.setattr(kernel, "cache", {})
    keys = torch.randn(B, H, 70, D, dtype=torch.float64, generator=torch.Generator().manual_seed(tile))
    counts, sums = torch.zeros(B, H, 48), torch.zeros(B, H, 48, D)
    fused = fused_online_slots(keys.float().to(DEVICE), counts.to(DEVICE), sums.to(DEVICE), L, threshold,
                               drop=drop).cpu()
    assert torch.equal(fused, naive_online_slots(keys, 48, L, threshold, drop=drop))


@pytest.mark.parametrize("T", [20, 70])
def test_slow_pairs_alone_and_dropped_keys(T):
    """The memory of q's and k's pairs m ≥ 3 (memory_first_pair: 10 of the 16 features), novel keys dropped once
    the slots are full, against the definition: T < 2L (no memory) and T = 70."""
    kw = dict(threshold=1.3, overflow="drop", memory_first_pair=3)
    compare(ovq_call(naive_ovq_attention, "online", **kw), ovq_call(ovq_attention, "online", impl="triton", **kw),
            ovq_inputs("online", T))


@pytest.mark.parametrize("given", ["online", "memory"])
def test_state_continuation(given):
    """A sequence fed as chunks, each continuing the state of the one before, equals one call of the chunk form;
    the final state equals the chunk form's (online: the slow pairs alone, dropped keys)."""
    inputs = [x.detach().to(DEVICE, torch.float32) for x in ovq_inputs(given, 70)]
    threshold = dict(threshold=1.3, overflow="drop", memory_first_pair=3) if given == "online" else {}
    whole, chunk_state = ovq_call(ovq_attention, given, impl="chunk", return_state=True, **threshold)(*inputs)
    outs, state = [], None
    for t0, t1 in ((0, 23), (23, 50), (50, 70)):
        out, state = ovq_call(ovq_attention, given, impl="triton", state=state, return_state=True, **threshold)(
            *(x[:, :, t0:t1] for x in inputs))
        outs.append(out)
    assert rel_rms(torch.cat(outs, 2), whole) < 1e-5
    for name in ("counts", "key_sums", "value_sums", "keys", "values"):
        assert rel_rms(getattr(state, name), getattr(chunk_state, name)) < 1e-5, name
    assert state.length == chunk_state.length


@pytest.mark.parametrize("given", ["online", "weights"])
def test_bfloat16_inputs(given):
    """bf16 q, k, v accumulate in float32: within bf16's rounding of the float64 definition. The online slots of
    the bf16 keys are the definition's of those keys (the reference gets them rounded to bf16)."""
    inputs = ovq_inputs(given, 70)
    inputs = [x.detach().to(torch.bfloat16).double().requires_grad_() for x in inputs]
    threshold = dict(threshold=1.3) if given == "online" else {}
    compare(ovq_call(naive_ovq_attention, given, **threshold), ovq_call(ovq_attention, given, impl="triton",
                                                                        **threshold),
            inputs, dtype=torch.bfloat16, tol=2e-2)


def test_unsupported_calls_say_why():
    q, k, v = (x.detach().to(DEVICE, torch.float32) for x in ovq_inputs("online", 10))
    with pytest.raises(ValueError, match="power of two"):
        ovq_attention(q, k, v, num_slots=S, block_len=24, impl="triton")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
            ovq_attention(q.double(), k.double(), v.double(), num_slots=S, block_len=L, impl="triton")


def test_auto_keeps_the_chunk_impl_on_a_cpu():
    """impl="auto" runs the Triton kernels only on CUDA: on a CPU, under the interpreter too, it is the chunk form
    (same result to the bit)."""
    q, k, v = (x.detach().float() for x in ovq_inputs("online", 40))
    auto = ovq_attention(q, k, v, num_slots=S, block_len=L)
    assert torch.equal(auto, ovq_attention(q, k, v, num_slots=S, block_len=L, impl="chunk"))


def decoder(name, T):
    """op(q, k, v, impl, state) -> (out, state) of one op as the layers decode with it, and its extra input
    shapes (vq's codebook, ovq's memory queries and keys)."""
    if name == "window":
        return (lambda q, k, v, impl, state: window_attention(q, k, v, block_len=L, impl=impl, state=state,
                                                              return_state=True)), []
    if name.startswith("vq"):
        assign, window = name.split("-")[1:]
        return (lambda q, k, v, c, impl, state: vq_attention(
            q, k, v, c, causal=True, assign=assign, block_len=L, exact_window=window == "exact", impl=impl,
            state=state, return_state=True)), [(H, S, D)]
    given = name.split("-")[1]
    kwargs = dict(threshold=1.3) if given == "online" else {}
    if name.endswith("-slow-drop"):  # the layer's defaults: the pairs m ≥ 3 alone (Dm = 10), novel keys dropped
        kwargs.update(memory_first_pair=3, overflow="drop")
    op = ovq_call(ovq_attention, given, **kwargs)
    extra = [(B, H, T, D)] * 2 if given == "memory" else []
    return (lambda q, k, v, *rest: op(q, k, v, *rest[:-2], impl=rest[-2], state=rest[-1], return_state=True)), extra


@pytest.mark.parametrize("name", ["window", "vq-hard-codes", "vq-hard-exact", "vq-soft-exact", "ovq-online",
                                  "ovq-online-slow-drop", "ovq-memory"])
@torch.no_grad()
def test_fused_decoding_step_equals_recurrent(name):
    """After a 40-token prefill, 24 tokens one at a time (crossing two block boundaries, where a block joins the
    memory): the fused step gives the recurrent form's outputs token for token, and its state."""
    T = 64
    op, extra = decoder(name, T)
    q, k, v, *rest = (torch.randn(*shape).to(DEVICE) for shape in [(B, H, T, D)] * 3 + extra)
    per_token = [x for x in rest if x.dim() == 4 and x.shape[2] == T]  # ovq's q_mem, k_mem
    fixed = [x for x in rest if not (x.dim() == 4 and x.shape[2] == T)]  # vq's codebook
    piece = lambda t0, t1: [x[:, :, t0:t1] for x in (q, k, v, *per_token)] + fixed  # noqa: E731
    _, prefill = op(*piece(0, 40), "chunk", None)
    states = {"recurrent": prefill, "triton": prefill}
    for t in range(40, T):
        outs = {}
        for impl in states:
            outs[impl], states[impl] = op(*piece(t, t + 1), impl, states[impl])
        assert rel_rms(outs["triton"], outs["recurrent"]) < 1e-5, t
    for field in ("counts", "sums", "key_sums", "value_sums", "keys", "values"):
        if hasattr(states["recurrent"], field):
            assert rel_rms(getattr(states["triton"], field), getattr(states["recurrent"], field)) < 1e-5, field


def test_fused_decoding_step_is_forward_only():
    """The fused step refuses a gradient; impl="triton" decoding inputs that need one runs the differentiable Triton
    chunk form instead, and "auto" on a CPU keeps the recurrent form."""
    q, k, v = (x.detach().to(DEVICE, torch.float32).requires_grad_() for x in ovq_inputs("online", 20))
    with pytest.raises(ValueError, match="forward only"):
        fused_decode_step(q[:, :, -1:], k, v, scale=0.25)
    _, state = ovq_attention(q[:, :, :19].detach(), k[:, :, :19].detach(), v[:, :, :19].detach(), num_slots=S,
                             block_len=L, return_state=True)
    out = ovq_attention(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], num_slots=S, block_len=L, state=state,
                        impl="triton")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads) and grads[2][:, :, 19:].abs().sum() > 0
    with torch.no_grad():
        assert pick_impl("auto", q[:, :, 19:].cpu(), state=state, fused_unsupported=lambda: None) == "recurrent"
