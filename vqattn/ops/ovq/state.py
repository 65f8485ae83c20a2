"""The decoding state of :func:`~vqattn.ops.ovq.ovq_attention`, and the argument checks and casts that its three
impls share."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from ..blocks import Schedule, as_schedule, check_block_len, resolve_block_len
from ..common.memory_cap import check_memory_cap
from ..common.memory_decay import block_factor, check_memory_decay
from ..common.pairs import check_first_pair, pair_dims
from ..triton.window_codes import unsupported
from ..utils import (
    check_4d,
    check_choice,
    check_positive_int,
    check_qkv,
    check_same_device_dtype,
    compute_dtype,
    require_triton,
    resolve_scale,
)


@dataclass
class OVQState:
    """State of causal :func:`~vqattn.ops.ovq.ovq_attention` after ``length`` tokens.

    Positions before ``window_start(length, block_len)`` are absorbed into the memory: per-slot ``counts`` (B, H, S),
    memory-key sums ``key_sums`` (B, H, S, Dm) and value sums ``value_sums`` (B, H, S, Dv). Positions from there on
    (W < 2·block_len) are kept raw: ``keys`` (B, H, W, D) and ``values`` (B, H, W, Dv) for the window, their memory
    keys ``memory_keys`` (B, H, W, Dm) when the caller passes separate ones (else None: the memory keys are ``keys``),
    and, for a given assignment, their ``slots`` (B, H, W) or ``slot_weights`` (B, H, W, S). Constant size in the
    length. In online mode the occupied slots are 0..``occupied``−1.
    """

    counts: torch.Tensor
    key_sums: torch.Tensor
    value_sums: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    memory_keys: torch.Tensor | None
    slots: torch.Tensor | None
    slot_weights: torch.Tensor | None
    length: int
    block_len: int

    @property
    def occupied(self) -> torch.Tensor:
        """(B, H) number of slots holding at least one key."""
        return (self.counts > 0).sum(-1)

    @staticmethod
    def empty(q: torch.Tensor, v: torch.Tensor, num_slots: int, block_len: int, *, memory_keys: bool,
              slots: bool, slot_weights: bool, memory_dim: int | None = None) -> "OVQState":
        """The state before position 0, for q (B, H, ·, D), v (B, H, ·, Dv) and memory keys of ``memory_dim``
        features (default D)."""
        (B, H, _, D), Dv, S = q.shape, v.shape[-1], num_slots
        Dm = D if memory_dim is None else memory_dim
        return OVQState(q.new_zeros(B, H, S), q.new_zeros(B, H, S, Dm), q.new_zeros(B, H, S, Dv),
                        q.new_zeros(B, H, 0, D), q.new_zeros(B, H, 0, Dv),
                        q.new_zeros(B, H, 0, Dm) if memory_keys else None,
                        q.new_zeros(B, H, 0, dtype=torch.long) if slots else None,
                        q.new_zeros(B, H, 0, S) if slot_weights else None, 0, block_len)

    def to(self, dtype: torch.dtype, raw: torch.dtype | None = None) -> "OVQState":
        """The state in ``dtype``; its raw window (keys, values, memory keys) in ``raw`` when given (the Triton impl
        keeps half-precision inputs as they are, the memory in float32)."""
        def cast(name, x):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return x
            return x.to(raw if raw is not None and name in ("keys", "values", "memory_keys") else dtype)

        return OVQState(**{f.name: cast(f.name, getattr(self, f.name)) for f in fields(self)})


class Inputs(NamedTuple):
    """Validated inputs. q, k: (B, H, T, D) window query/keys; q_mem, k_mem: (B, H, T, Dm) memory query/keys;
    v: (B, H, T, Dv), in the compute ``dtype`` (for the Triton impl: as given, half precision included, which its
    kernels accumulate in float32); slots (B, H, T) long or slot_weights (B, H, T, S) (in ``dtype``) for a given
    assignment, both None for the online one; S slots, block length L, scale σ, novelty threshold, and whether a
    novel key that finds no free slot is dropped (``overflow="drop"``) rather than joining its nearest slot."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_mem: torch.Tensor
    k_mem: torch.Tensor
    slots: torch.Tensor | None
    slot_weights: torch.Tensor | None
    num_slots: int
    block_len: int
    scale: float
    threshold: float
    separate_keys: bool  # whether k_mem was given (then the state keeps it)
    schedule: Schedule  # how the chunk impl reads the slots' value sums (never what it computes)
    dtype: torch.dtype  # of the memory's statistics and the state: float32 for half precision, else the inputs'
    memory_cap: int | None = None  # the memory weighs as if it held at most this many keys (vqattn.ops.common)
    memory_decay: float | None = None  # γ: each key's weight in the memory shrinks by γ per later key
    drop: bool = False  # overflow="drop"
    memory_first_pair: int = 0  # the memory keeps the feature pairs m ≥ this of q (q_mem) and k (k_mem)

    def memory_part(self, keys: torch.Tensor) -> torch.Tensor:
        """The memory's keys of window keys (B, H, W, D): their pairs from ``memory_first_pair`` on."""
        return pair_dims(keys, self.memory_first_pair)

    @property
    def memory_dim(self) -> int:
        """Dm, the memory keys' features."""
        return self.k_mem.shape[-1]

    @property
    def decay(self) -> float | None:
        """g = γ^L, the factor on the memory per block that joins it (None: no forgetting)."""
        return block_factor(self.memory_decay, self.block_len)


OVERFLOW = ("nearest", "drop")


def _check_threshold(threshold, online: bool) -> float:
    if threshold is None:
        return 0.0
    if not online:
        raise ValueError("threshold applies to online assignment only; drop it when passing slots or slot_weights")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold) \
            or threshold < 0:
        raise ValueError(f"threshold must be a number >= 0 (a squared distance relative to the key's; inf: never open "
                         f"a slot once one is occupied), got {threshold!r}")
    return float(threshold)


def _check_given(slots, slot_weights, shape, S: int, device) -> None:
    """A given assignment: slots (B, H, T) integers in [0, S) or slot_weights (B, H, T, S) >= 0."""
    if slots is not None and slot_weights is not None:
        raise ValueError("pass slots or slot_weights, not both")
    if slots is not None:
        if not isinstance(slots, torch.Tensor) or slots.shape != shape or slots.is_floating_point() \
                or slots.dtype == torch.bool:
            got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise ValueError(f"slots must be an integer tensor of shape (B, H, T) = {shape}, got {got}")
        if slots.device != device:
            raise ValueError(f"slots is on {slots.device} but q is on {device}")
        # Checked on the device: reading it on the host would synchronise a GPU every step.
        torch._assert_async(((slots >= -1) & (slots < S)).all(), "slots must lie in [0, num_slots) or be -1")
    if slot_weights is not None:
        if not isinstance(slot_weights, torch.Tensor) or slot_weights.shape != (*shape, S):
            got = tuple(slot_weights.shape) if isinstance(slot_weights, torch.Tensor) else type(slot_weights).__name__
            raise ValueError(f"slot_weights must be a tensor of shape (B, H, T, S) = {(*shape, S)}, got {got}")
        if not slot_weights.is_floating_point() or slot_weights.device != device:
            raise ValueError(f"slot_weights must be a floating-point tensor on {device}, got {slot_weights.dtype} on "
                             f"{slot_weights.device}")
        torch._assert_async((slot_weights >= 0).all(), "slot_weights must be >= 0")


def _check_state(state, inputs: dict, S: int, block_len, Dm: int) -> None:
    if not isinstance(state, OVQState):
        raise ValueError(f"state must be an OVQState returned by ovq_attention, got {type(state).__name__}")
    if block_len is not None and block_len != state.block_len:
        raise ValueError(f"block_len={block_len} differs from the state's block_len={state.block_len}")
    k, v = inputs["k"], inputs["v"]
    (B, H, _, D), Dv = k.shape, v.shape[-1]
    if state.counts.shape != (B, H, S) or state.key_sums.shape != (B, H, S, Dm) or \
            state.value_sums.shape != (B, H, S, Dv) or state.keys.shape[-1] != D:
        raise ValueError(f"state does not match the inputs: counts {tuple(state.counts.shape)}, key_sums "
                         f"{tuple(state.key_sums.shape)}, value_sums {tuple(state.value_sums.shape)} for B={B}, H={H}, "
                         f"num_slots={S}, D={D}, memory keys' Dm={Dm}, Dv={Dv}")
    for name, given in (("k_mem", "memory_keys"), ("slots", "slots"), ("slot_weights", "slot_weights")):
        if (inputs[name] is None) != (getattr(state, given) is None):
            raise ValueError(f"{name} must be passed in every call of a sequence or in none: the state was built "
                             f"{'with' if getattr(state, given) is not None else 'without'} it")


def fused_unsupported(q, v, block_len, state) -> str | None:
    """Why the Triton impl cannot compute this call, or None (:func:`~vqattn.ops.triton.window_codes.unsupported`)."""
    L = resolve_block_len(block_len, state)
    return unsupported(L, (q.shape[-1], v.shape[-1]), q.dtype)


def _check_triton(q, v, block_len, state) -> None:
    require_triton(q)
    reason = fused_unsupported(q, v, block_len, state)
    if reason is not None:
        raise ValueError(reason)


def _check_memory_keys(q, k, q_mem, k_mem) -> None:
    """q_mem, k_mem (B, H, T, Dm): q's and k's shapes up to their features, the same Dm (D where one is not given)."""
    for name, x, like in (("q_mem", q_mem, q), ("k_mem", k_mem, k)):
        if x is not None:
            check_4d(name, x)
            if x.shape[:3] != like.shape[:3]:
                raise ValueError(f"{name} must have the shape of {name[0]} {tuple(like.shape)} up to its last dim, "
                                 f"got {tuple(x.shape)}")
            check_same_device_dtype(q=q, **{name: x})
    dims = [x.shape[-1] for x in (q if q_mem is None else q_mem, k if k_mem is None else k_mem)]
    if dims[0] != dims[1]:
        raise ValueError(f"the memory's queries and keys need one feature dim: q_mem (or q) has {dims[0]}, k_mem (or "
                         f"k) {dims[1]}; pass both q_mem and k_mem for memory keys narrower than the window's")


def prepare(q, k, v, *, num_slots, block_len, scale, threshold, slots, slot_weights, q_mem, k_mem,
            state, schedule="auto", fused=False, memory_cap=None, memory_decay=None, overflow="nearest",
            memory_first_pair=0) -> Inputs:
    """Validate every argument (ValueError naming it) and cast the tensors to the compute dtype (float32 for half
    precision, float64 stays float64), or for the Triton impl (``fused``) keep q, k, v, q_mem, k_mem as they are.
    Call with autocast off."""
    check_qkv(q, k, v, causal=True)
    check_positive_int("num_slots", num_slots)
    check_memory_cap(memory_cap)
    check_block_len(block_len)
    _check_memory_keys(q, k, q_mem, k_mem)
    memory_first_pair = check_first_pair("memory_first_pair", memory_first_pair,
                                         (q if q_mem is None else q_mem).shape[-1])
    check_choice("overflow", overflow, OVERFLOW)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    _check_given(slots, slot_weights, tuple(k.shape[:3]), num_slots, q.device)
    threshold = _check_threshold(threshold, slots is None and slot_weights is None)
    if overflow == "drop" and (slots is not None or slot_weights is not None):
        raise ValueError("overflow='drop' applies to online assignment only; a given assignment drops a key by its "
                         "slot -1")
    given = dict(k=k, v=v, k_mem=k_mem, slots=slots, slot_weights=slot_weights)
    if state is not None:
        Dm = (k if k_mem is None else k_mem).shape[-1] - 2 * memory_first_pair
        _check_state(state, given, num_slots, block_len, Dm)
    if fused:
        _check_triton(q, v, block_len, state)
    L = resolve_block_len(block_len, state)
    check_memory_decay(memory_decay, L)
    dtype = compute_dtype(q.dtype)
    cast = (lambda x: None if x is None else x.to(dtype))  # noqa: E731
    keep = (lambda x: x) if fused else cast  # noqa: E731
    q, k, v = keep(q), keep(k), keep(v)
    q_mem, k_mem_given = (pair_dims(x, memory_first_pair) for x in (q if q_mem is None else keep(q_mem),
                                                                     k if k_mem is None else keep(k_mem)))
    return Inputs(q, k, v, q_mem, k_mem_given, slots, cast(slot_weights), num_slots, L,
                  float(resolve_scale(scale, q.shape[-1])), threshold, k_mem is not None, as_schedule(schedule), dtype,
                  memory_cap, None if memory_decay is None else float(memory_decay), overflow == "drop",
                  memory_first_pair)
