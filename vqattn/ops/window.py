"""Sliding-window softmax attention over exactly the raw window that causal ``vq_attention`` keeps.

Query i in block b = i // L attends to the keys j ≤ i of blocks b−1 and b:

    out_i = Σ_{j ∈ W(i)} e^{σ q_i·k_j} v_j / Σ_{j ∈ W(i)} e^{σ q_i·k_j},   W(i) = {j : (b−1)·L ≤ j ≤ i}

so it sees between L and 2L−1 keys. It is ``vq_attention`` without the compressed cache, and runs the same
block kernel (:class:`~vqattn.ops.common.window_code_blocks.WindowCodeAttention` without codes) and the same recurrence:
O(T·L·D) time, no T×T tensor, and a decoding state of fewer than 2L raw keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import (
    DEFAULT_BLOCK_LEN,
    Schedule,
    as_schedule,
    attend_one,
    block_groups,
    blocks,
    cat_groups,
    check_block_len,
    group_window_bias,
    group_windows,
    pad_to_blocks,
    prepend_window,
    resolve_block_len,
    split_groups,
    time_range,
    window_start,
    window_tail,
)
from .common.segments import window_bad_keys, window_blocks, window_mask, window_softmax
from .common.window_code_blocks import WindowCodeInputs, window_code_attention
from .nonfinite import may_be_nonfinite, nonfinite_keys, window_poison, zero_rows
from .triton.decode import fused_decode_step
from .triton.window_codes import fused_window_code_attention, unsupported
from .utils import (
    IMPLS,
    autocast_off,
    check_choice,
    check_qkv,
    compute_dtype,
    decoding,
    needs_grad,
    pick_impl,
    require_triton,
    resolve_scale,
    size_min,
    with_impl,
)
from .varlen import Segments, varlen


@dataclass
class WindowState:
    """Raw keys (B, H, W, D) and values (B, H, W, Dv) from ``window_start(length, block_len)`` on, W < 2L."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    block_len: int


def _chunked(q, k, v, L: int, scale: float, schedule: Schedule) -> torch.Tensor:
    T = q.shape[2]
    q, k, v = (pad_to_blocks(x, L) for x in (q, k, v))  # padding comes after every real query: masked
    nb = q.shape[2] // L
    B, H = q.shape[:2]
    groups = block_groups(nb, B * H * L * 2 * L * q.element_size(), q.device, schedule.group_blocks)
    outs = []
    for (b0, b1), (q_g, _), k_g, v_g in zip(groups, *(split_groups(x, groups, L) for x in (q, k, v))):
        bias = group_window_bias(b0 == 0, b1 - b0, L, q.device, q.dtype)
        inputs = WindowCodeInputs(blocks(q_g, L), group_windows(*k_g, L, scale), bias, group_windows(*v_g, L))
        outs.append(window_code_attention(inputs, loop=False)[0])  # no codes: no cache to read
    return time_range(cat_groups(outs), 0, T)


def _fused(q, k, v, L: int, scale: float, schedule: Schedule, bad=None) -> torch.Tensor:
    """:func:`_chunked` as one Triton kernel (the schedule has no meaning there); ``bad`` (B, H, T): rows of k the
    kernels read as zeros, or None."""
    return fused_window_code_attention(q, k, v, scale=scale, block_len=L, bad=bad)


def _recurrent(q, k, v, state: WindowState, scale: float, fused: bool = False) -> tuple[torch.Tensor, WindowState]:
    """Token by token: each query scores the state's raw window plus itself (``fused``: in one Triton kernel)."""
    outs, keys, values, length, L = [], state.keys, state.values, state.length, state.block_len
    for t in range(q.shape[2]):
        keys, values = torch.cat([keys, k[:, :, t : t + 1]], 2), torch.cat([values, v[:, :, t : t + 1]], 2)
        query = q[:, :, t : t + 1]
        outs.append(fused_decode_step(query, keys, values, scale=scale) if fused
                    else attend_one((query * scale) @ keys.transpose(-1, -2), values))
        drop = window_start(length + 1, L) - window_start(length, L)
        keys, values, length = window_tail(keys, drop), window_tail(values, drop), length + 1
    return torch.cat(outs, 2), WindowState(keys, values, length, L)




def naive_window_attention(q, k, v, *, block_len: int = DEFAULT_BLOCK_LEN, scale: float | None = None):
    """The definition: causal softmax over keys j ≤ i of block(j) ≥ block(i) − 1, one (T, T) band-masked softmax.
    q, k: (B, H, T, D), v: (B, H, T, Dv) -> (B, H, T, Dv)."""
    T = q.shape[2]
    scale = resolve_scale(scale, q.shape[-1])
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    visible = (j <= i) & (j // block_len >= i // block_len - 1)
    logits = (scale * q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, -1) @ v


def _validate(q, k, v, block_len, state, return_state, impl) -> None:
    check_qkv(q, k, v, causal=True)
    check_choice("impl", impl, IMPLS)
    check_block_len(block_len)
    if impl == "naive" and (state is not None or return_state):
        raise ValueError("impl='naive' takes no state and returns none; use impl='chunk' or 'recurrent'")
    if impl == "triton":
        require_triton(q)
        L = resolve_block_len(block_len, state)
        reason = unsupported(L, (q.shape[-1], v.shape[-1]), q.dtype)
        if reason is not None:
            raise ValueError(reason)
    if state is not None:
        if not isinstance(state, WindowState):
            raise ValueError(f"state must be a WindowState returned by window_attention, got {type(state).__name__}")
        if block_len is not None and block_len != state.block_len:
            raise ValueError(f"block_len={block_len} differs from the state's block_len={state.block_len}")
        if state.keys.shape[:2] != k.shape[:2] or state.keys.shape[-1] != k.shape[-1] or \
                state.values.shape[-1] != v.shape[-1]:
            raise ValueError(f"state does not match the inputs: keys {tuple(state.keys.shape)}, values "
                             f"{tuple(state.values.shape)} for k {tuple(k.shape)}, v {tuple(v.shape)}")


@autocast_off
def _segmented(a: dict, segments: Segments) -> torch.Tensor:
    """A packed call given :class:`~vqattn.ops.varlen.Segments`: every block's window in the block layout
    (:mod:`vqattn.ops.common.segments`), one traced computation for any documents."""
    q, k, v = a["q"], a["k"], a["v"]
    _validate(q, k, v, a["block_len"], None, False, a["impl"])
    layout = segments.layout(resolve_block_len(a["block_len"]))
    L, dtype = layout.block_len, compute_dtype(q.dtype)
    q, k, v = (layout.gather(x).to(dtype) for x in (q, k, v))
    first = layout.first_blocks()
    bad, _ = nonfinite_keys(k)
    if may_be_nonfinite(bad):
        k = zero_rows(k, bad)
    out = window_softmax(resolve_scale(a["scale"], q.shape[-1]) * blocks(q, L)
                         @ window_blocks(k, L, first).transpose(-1, -2),
                         window_mask(first, L), window_blocks(v, L, first)).flatten(2, 3)
    if may_be_nonfinite(bad):
        out = out + window_bad_keys(bad, L, first).to(dtype).unsqueeze(-1)
    return layout.scatter_back(out).to(a["q"].dtype)


@varlen(("q", "k", "v"), segmented=_segmented)
@autocast_off
def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_len: int | None = None,
    scale: float | None = None,
    state: WindowState | None = None,
    return_state: bool = False,
    schedule: str | Schedule = "auto",
    impl: str = "auto",
):
    """Causal softmax attention over the current and the previous block of ``block_len`` (see module doc).

    Args:
        q, k: (B, H, T, D); v: (B, H, T, Dv).
        block_len: L (default 64, as vq_attention); each query sees L to 2L−1 keys.
        scale: multiplies q·k; defaults to D**-0.5.
        state: a :class:`WindowState` from an earlier call; the inputs then continue that sequence. Up to
            ``RECURRENT_MAX_LEN`` new tokens run token by token, longer chunks the block kernel.
        return_state: also return the state after this call.
        schedule: the blocks' :class:`~vqattn.ops.blocks.Schedule` (its ``group_blocks``); never changes the result.
        impl: "chunk" (the block kernel in PyTorch), "recurrent" (token by token, continuing ``state``), "naive"
            (:func:`naive_window_attention`, the definition: for checking, no state), "triton"
            (one fused kernel forward and one backward: CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``; with
            a ``state`` and at most ``RECURRENT_MAX_LEN`` new tokens and no gradient needed, the fused decoding
            step, :mod:`vqattn.ops.triton.decode`), or "auto": for a ``state`` and at most ``RECURRENT_MAX_LEN``
            new tokens the fused step on CUDA with grad mode off, else recurrent; triton for other CUDA calls it
            supports (docs/ops.md), chunk otherwise (:func:`~vqattn.ops.utils.pick_impl`).

    Returns:
        out (B, H, T, Dv) in the input dtype (computed in float32 for half precision and under autocast), or
        (out, state) when ``return_state``. As in softmax attention, a key with a NaN or infinite entry makes NaN
        exactly the outputs of the queries whose window holds it.
    """
    _validate(q, k, v, block_len, state, return_state, impl)
    schedule = as_schedule(schedule)
    L = resolve_block_len(block_len, state)
    impl = pick_impl(impl, q, state=state, fused_unsupported=lambda: unsupported(L, (q.shape[-1], v.shape[-1]),
                                                                                  q.dtype))
    if impl == "recurrent" and state is None:
        state = WindowState(k[:, :, :0], v[:, :, :0], 0, L)
    # the Triton kernel reads half precision as it is and accumulates in float32
    in_dtype = q.dtype
    dtype = in_dtype if impl == "triton" else compute_dtype(in_dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = resolve_scale(scale, q.shape[-1])
    if impl == "naive":
        return naive_window_attention(q, k, v, block_len=L, scale=scale).to(in_dtype)
    if state is not None:
        state = WindowState(state.keys.to(dtype), state.values.to(dtype), state.length, state.block_len)
    fused_step = impl == "triton" and decoding(q, state) and not needs_grad(q, k, v)
    if impl == "recurrent" or fused_step:
        out, new_state = _recurrent(q, k, v, state, scale, fused=fused_step)
        return (out.to(in_dtype), new_state) if return_state else out.to(in_dtype)
    T, start = q.shape[2], 0
    if state is not None:  # re-run the state's raw window (block-aligned) in front; drop its outputs
        start = state.length - state.keys.shape[2]
        q, k, v = prepend_window(q, k, v, state.keys, state.values)
    L_run = L if state is not None or return_state else size_min(L, T)  # one block: same result, less padding
    # Inside the block kernel a non-finite key would also reach the earlier queries of its block (through their
    # masked entries): it is zeroed there and reaches exactly the queries that see it as NaN (vqattn.ops.nonfinite).
    # The state keeps the key itself. The recurrent impl has no masked entries.
    bad, _ = nonfinite_keys(k)
    blocks_of = _chunked
    if impl == "triton":
        blocks_of, L_run = _fused, L
    if may_be_nonfinite(bad) and impl == "triton":  # the kernels zero the bad rows as they read them
        out = _fused(q, k, v, L_run, scale, schedule, bad=bad) + window_poison(bad, L, dtype)
    elif may_be_nonfinite(bad):
        out = blocks_of(q, zero_rows(k, bad), v, L_run, scale, schedule) + window_poison(bad, L, dtype)
    else:
        out = blocks_of(q, k, v, L_run, scale, schedule)
    if out.shape[2] > T:  # a slice of all rows would still zero-fill a gradient the size of out, then copy into it
        out = out[:, :, -T:]
    out = out.to(in_dtype)
    if not return_state:
        return out
    length = start + k.shape[2]
    keep = window_start(length, L) - start
    return out, WindowState(window_tail(k, keep), window_tail(v, keep), length, L)


chunk_window_attention = with_impl(window_attention, "chunk")
recurrent_window_attention = with_impl(window_attention, "recurrent")
