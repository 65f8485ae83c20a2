"""The decoding state of :func:`~vqattn.ops.vq.vq_attention`, the argument checks, and the validated inputs
(:class:`Inputs`) that its impls share, as in :mod:`vqattn.ops.ovq.state`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from ..blocks import Schedule, check_block_len, prepend_window, resolve_block_len, window_start, window_tail
from ..common.memory_cap import check_memory_cap
from ..common.statistics import Assignment, cat_time, map_time
from ..nonfinite import may_be_nonfinite, nonfinite_keys, visible_poison, zero_assignment_rows, zero_rows
from ..triton.window_codes import unsupported
from ..utils import (
    IMPLS,
    check_4d,
    check_choice,
    check_qkv,
    check_same_device_dtype,
    compute_dtype,
    replaced,
    require_triton,
    resolve_scale,
)
from .assign import ASSIGNMENTS, SoftMixture, check_assignment, vq_assign


@dataclass
class VQState:
    """Recurrent state of causal :func:`~vqattn.ops.vq.vq_attention` after ``length`` tokens.

    Positions before ``window_start(length, block_len)`` are compressed into ``counts`` (B, H, S) and value
    ``sums`` (B, H, S, Dv); positions from there on are kept raw in ``keys`` (B, H, W, D), ``values``
    (B, H, W, Dv) and their ``assignment`` (W < 2·block_len positions). Its size is constant in the length.
    """

    counts: torch.Tensor
    sums: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    length: int
    block_len: int
    assignment: Assignment

    def to(self, dtype: torch.dtype) -> "VQState":
        cast = lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        values = {f.name: cast(getattr(self, f.name)) for f in fields(self) if f.name != "assignment"}
        return VQState(**values, assignment=map_time(cast, self.assignment))

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, num_codes: int, block_len: int, assign: str) -> "VQState":
        """The state before the first token, for keys (B, H, ·, D) and values (B, H, ·, Dv)."""
        B, H, _, D = k.shape
        index = k.new_zeros(B, H, 0, dtype=torch.long) if assign == "hard" else None
        weights = None if assign == "hard" else k.new_zeros(B, H, 0, num_codes)
        return cls(k.new_zeros(B, H, num_codes), v.new_zeros(B, H, num_codes, v.shape[-1]), k.new_zeros(B, H, 0, D),
                   v.new_zeros(B, H, 0, v.shape[-1]), 0, block_len, Assignment(weights, index))


class Inputs(NamedTuple):
    """A call's validated inputs in the compute dtype (half-precision q, k, v, q_rot, k_rot kept as they are for the
    Triton impl, which accumulates in float32). q (B, H, T, Dc), k (B, H, T, D) or None (keys that come assigned),
    v (B, H, T, Dv); codebook (H, S, Dc); the keys' ``assignment``, or None for the chunk impl to assign group by
    group (so that no (T, S) tensor exists at once); q_rot, k_rot the window's own queries and keys (RoPE) or None;
    ``bad`` (B, H, T) the rows of non-finite keys, zeroed in k and k_rot, or None; block length L, scale σ.
    ``window_bad``: those rows when k_rot (and k, then unread) keep them, for the fused kernels to zero as they read
    the window's keys (no masked copy of the keys and of their gradient), or None."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor
    codebook: torch.Tensor
    assignment: Assignment | None
    q_rot: torch.Tensor | None
    k_rot: torch.Tensor | None
    bad: torch.Tensor | None
    assign: str
    temperature: float | torch.Tensor
    block_len: int
    scale: float
    exact_window: bool
    schedule: Schedule
    memory_cap: int | None = None
    window_bad: torch.Tensor | None = None

    @property
    def window_k(self) -> torch.Tensor:
        """The keys the window scores: k_rot, or k."""
        return self.k if self.k_rot is None else self.k_rot

    def assign_keys(self, keys: torch.Tensor) -> Assignment:
        return vq_assign(keys, self.codebook, assign=self.assign, temperature=self.temperature)


def _check_codebook(codebook, q, k) -> None:
    if not isinstance(codebook, torch.Tensor) or codebook.dim() not in (2, 3):
        shape = tuple(codebook.shape) if isinstance(codebook, torch.Tensor) else type(codebook).__name__
        raise ValueError(f"codebook must be a tensor of shape (H, S, Dc) or (S, Dc), got {shape}")
    check_same_device_dtype(k=k, codebook=codebook)
    if codebook.shape[-1] != q.shape[-1]:
        raise ValueError(f"codebook D={codebook.shape[-1]} differs from the query D={q.shape[-1]} (q scores the codes)")
    if codebook.dim() == 3 and codebook.shape[0] != k.shape[1]:
        raise ValueError(f"codebook has {codebook.shape[0]} heads but k has H={k.shape[1]}")
    if codebook.shape[-2] == 0:
        raise ValueError("codebook must have at least one code (S >= 1)")


def _check_state(state, k, v, codebook, *, assign, block_len) -> None:
    B, H, _, D = k.shape
    S, Dv = codebook.shape[-2], v.shape[-1]
    if not isinstance(state, VQState):
        raise ValueError(f"state must be a VQState returned by vq_attention, got {type(state).__name__}")
    if block_len is not None and block_len != state.block_len:
        raise ValueError(f"block_len={block_len} differs from the state's block_len={state.block_len}")
    if state.counts.shape != (B, H, S) or state.sums.shape != (B, H, S, Dv) or state.keys.shape[-1] != D:
        raise ValueError(
            f"state does not match the inputs: counts {tuple(state.counts.shape)}, sums {tuple(state.sums.shape)} "
            f"for B={B}, H={H}, S={S}, D={D}, Dv={Dv}"
        )
    check_4d("state.keys", state.keys)
    check_assignment(state.assignment, assign=assign, shape=tuple(state.keys.shape[:3]), num_codes=S,
                     device=k.device)


def _check_rotated(q, k, q_rot, k_rot, *, causal, exact_window) -> None:
    if (q_rot is None) != (k_rot is None):
        raise ValueError("q_rot and k_rot go together: pass both (the window's queries and keys) or neither")
    if q_rot is None:
        return
    if not (causal and exact_window):
        raise ValueError("q_rot and k_rot score the raw-key window: they need causal=True and exact_window=True")
    for name, x, shape in (("q_rot", q_rot, (*q.shape[:3], k.shape[-1])), ("k_rot", k_rot, tuple(k.shape))):
        check_4d(name, x)
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of {name[0]} with k's D, {shape}, got {tuple(x.shape)}")
    check_same_device_dtype(q=q, q_rot=q_rot, k_rot=k_rot)


def _check_code_width(q, k, q_rot, assignment) -> None:
    """q and the codebook score the codes on Dc dims, k (and q_rot, k_rot) has D. Dc ≠ D (e.g. the slow RoPE dims
    only) is well defined only when nothing multiplies q by k or k by a code: the window is scored by
    q_rot·k_rot and the keys come assigned."""
    if q.shape[-1] != k.shape[-1] and (q_rot is None or assignment is None):
        raise ValueError(
            f"q and k must share the feature dim D, got q D={q.shape[-1]} and k D={k.shape[-1]}: q and the codebook "
            "may score the codes on other dims than k's only with q_rot and k_rot (the window's queries and keys, "
            "of k's D) and a precomputed assignment of k"
        )


def validate(q, k, v, codebook, *, causal, assign, block_len, exact_window, state, return_state, impl, q_rot,
              k_rot, assignment, memory_cap=None) -> None:
    check_qkv(q, k, v, causal=causal, same_dim=False)  # q's D is the codes' width: _check_code_width
    _check_rotated(q, k, q_rot, k_rot, causal=causal, exact_window=exact_window)
    _check_codebook(codebook, q, k)
    _check_code_width(q, k, q_rot, assignment)
    if assign == "kernel":
        raise ValueError("assign must be 'hard' or 'soft'; the kernel assignment makes codebook attention linear "
                         "attention: use linear_attention with vqattn.analysis.codebook_kernel_features")
    check_choice("assign", assign, ASSIGNMENTS)
    check_choice("impl", impl, IMPLS)
    check_block_len(block_len)
    if not causal and (exact_window or state is not None or return_state or impl in ("recurrent", "triton")):
        raise ValueError("exact_window, state, return_state and impl='recurrent' or 'triton' need causal=True "
                         "(non-causal attention has no window)")
    check_memory_cap(memory_cap)
    if memory_cap is not None and (not causal or assign == "soft" and not exact_window):
        raise ValueError("memory_cap bounds the causal memory behind a raw window: it needs causal=True, and "
                         "exact_window=True for assign='soft' (the mixture window reads the previous block through "
                         "the memory)")
    if impl == "naive" and (state is not None or return_state):
        raise ValueError("impl='naive' takes no state and returns none; use impl='chunk' or 'recurrent'")
    if impl == "triton":
        require_triton(q)
        reason = fused_unsupported(q, k, v, assign=assign, exact_window=exact_window, block_len=block_len,
                                    state=state)
        if reason is not None:
            raise ValueError(reason)
    if state is not None:
        _check_state(state, k, v, codebook, assign=assign, block_len=block_len)
    if assignment is not None:
        check_assignment(assignment, assign=assign, shape=tuple(k.shape[:3]), num_codes=codebook.shape[-2],
                         device=q.device)


def fused_unsupported(q, k, v, *, assign, exact_window, block_len, state) -> str | None:
    """Why the Triton impl cannot compute this call, or None."""
    if assign == "soft" and not exact_window:
        return "impl='triton' has no soft mixture window: pass exact_window=True, or impl='chunk'"
    L = resolve_block_len(block_len, state)
    return unsupported(L, (q.shape[-1], k.shape[-1], v.shape[-1]), q.dtype)


def _without_nonfinite_keys(k, k_rot, *, causal: bool, state, in_kernel: bool = False):
    """k and k_rot with the rows of non-finite keys zeroed, those rows ``bad`` (B, H, T), and the poison (B, H, T, 1)
    that makes NaN the outputs that see them. Inside the kernels a bad key would also reach queries that cannot see
    it, so it reaches the outputs only through the poison (:mod:`vqattn.ops.nonfinite`). ``bad`` and the poison are
    None when no key is bad and that is known for free (:func:`~vqattn.ops.nonfinite.may_be_nonfinite`). With
    ``in_kernel`` the keys stay as they are: the fused kernels zero the ``bad`` rows of the window's keys as they
    read them, and nothing else reads k."""
    bad, poison = nonfinite_keys(k) if k_rot is None else nonfinite_keys(k, k_rot)
    if not may_be_nonfinite(bad):
        return k, k_rot, None, None
    if not in_kernel:
        k, k_rot = zero_rows(k, bad), None if k_rot is None else zero_rows(k_rot, bad)
    return k, k_rot, bad, visible_poison(poison, causal=causal, state_counts=None if state is None else state.counts)


def _keys_assignment(assignment: Assignment | SoftMixture | None, dtype, x: Inputs, *, whole: bool,
                     fused: bool) -> Assignment | SoftMixture | None:
    """The given assignment in the compute ``dtype`` (a :class:`SoftMixture` formed unless the call runs the
    ``fused`` blocks); else x's keys assigned here when ``whole``, or None (the chunk impl then assigns group by
    group, so that no (T, S) tensor exists at once; the fused blocks recompute soft weights)."""
    if isinstance(assignment, SoftMixture):  # kept for the fused blocks of a first call, formed for the rest
        return assignment if fused else assignment.formed()
    if assignment is not None:
        return map_time(lambda t: t.to(dtype) if t.is_floating_point() else t, assignment)
    return x.assign_keys(x.k) if whole else None


def prepare(q, k, v, codebook, *, impl: str, causal: bool, assign: str, temperature, block_len, scale,
            exact_window: bool, state: VQState | None, assignment: Assignment | None, q_rot, k_rot,
            schedule: Schedule, memory_cap: int | None = None):
    """The validated arguments of a call that ``impl`` computes (not naive) as :class:`Inputs`, the ``state`` in
    the compute dtype, and the poison (B, H, T, 1) that makes NaN the outputs that see a non-finite key, or None."""
    dtype = compute_dtype(q.dtype)
    tensor_dtype = q.dtype if impl == "triton" else dtype
    q, k, v, q_rot, k_rot = (None if t is None else t.to(tensor_dtype) for t in (q, k, v, q_rot, k_rot))
    c = codebook.to(dtype)
    c = c.unsqueeze(0).expand(q.shape[1], -1, -1) if c.dim() == 2 else c  # (H, S, Dc)
    # The fused causal blocks of a first call (a training step) read k only to assign it, and only when it is not
    # assigned already: the window's keys zero their bad rows in the kernels. A hard assignment of a bad key is a
    # valid code (the nearest-code kernel keeps code 0 against NaN scores) that only the queries that see the key
    # read; soft weights of one would be NaN, and so would the codebook's gradient through them.
    in_kernel = (impl == "triton" and causal and state is None and exact_window and k_rot is not None
                 and (assignment is not None or assign == "hard"))
    k, k_rot, bad, poison = _without_nonfinite_keys(k, k_rot, causal=causal, state=state, in_kernel=in_kernel)
    if state is not None:
        state = state.to(dtype)
        state = dataclasses.replace(state, keys=state.keys.to(tensor_dtype), values=state.values.to(tensor_dtype))
    L = resolve_block_len(block_len, state)
    x = Inputs(q, k, v, c, None, q_rot, k_rot, bad, assign, temperature, L,
               resolve_scale(scale, k.shape[-1]),  # k's D: q's may be the codes' narrower width
               exact_window, schedule, memory_cap, bad if in_kernel else None)
    whole = not causal or state is not None or impl == "recurrent"
    fused = impl == "triton" and causal and state is None
    return replaced(x, assignment=_keys_assignment(assignment, dtype, x, whole=whole, fused=fused)), state, poison


class Continued(NamedTuple):
    """A causal call's inputs as the block algorithms run them: ``x`` with a state's raw window in front, the
    position ``start`` of its first row, the cache before it (``counts0`` (B, H, S), ``sums0`` (B, H, S, Dv)), and
    ``keep``, the rows that leave the raw window by the call's end (whole blocks)."""

    x: Inputs
    start: int
    counts0: torch.Tensor
    sums0: torch.Tensor
    keep: int


def continued(x: Inputs, state: VQState | None) -> Continued:
    """What the chunk and fused impls start from (:class:`Continued`): the new tokens after ``state``'s raw window,
    whose keys come assigned (only the window's keys are read), or a zero cache."""
    B, H, T, _ = x.q.shape
    S, Dv = x.codebook.shape[1], x.v.shape[-1]
    if x.assign != "soft" or x.exact_window:
        # Only the mixture's window logits read a key's weights directly. Everywhere else they reach the cache
        # alone, which only the queries that see the key read, and the poison makes those NaN anyway.
        x = replaced(x, bad=None)
    if state is None:
        counts0, sums0 = x.codebook.new_zeros(B, H, S), x.codebook.new_zeros(B, H, S, Dv)  # float32 for a fused q
        return Continued(x, 0, counts0, sums0, window_start(T, x.block_len))
    start = state.length - state.keys.shape[2]
    q_rot = None if x.q_rot is None else prepend_window(x.q_rot, x.k_rot, x.v, state.keys, state.values)[0]
    q, window_k, v = prepend_window(x.q, x.window_k, x.v, state.keys, state.values)
    keys = dict(k_rot=window_k, k=None) if x.k_rot is not None else dict(k=window_k)
    x = replaced(x, q=q, v=v, q_rot=q_rot, bad=None, **keys,
                 assignment=cat_time(state.assignment, zero_assignment_rows(x.assignment, x.bad)))
    return Continued(x, start, state.counts, state.sums, window_start(state.length + T, x.block_len) - start)


def state_after(c: Continued, counts: torch.Tensor, sums: torch.Tensor) -> VQState:
    """The :class:`VQState` at the call's end: the cache after the ``keep`` rows (``counts``, ``sums``), and the
    raw window's keys, values and assignment (a soft mixture's weights formed)."""
    x, keep = c.x, c.keep
    a = x.assignment
    if isinstance(a, SoftMixture):
        window = SoftMixture(window_tail(a.keys, keep), a.codes, a.temperature).formed()
    else:
        window = x.assign_keys(x.k[:, :, keep:]) if a is None else map_time(lambda w: window_tail(w, keep), a)
    keys = window_tail(x.window_k, keep)
    if x.window_bad is not None:  # the kernels zeroed them as they read them; a state keeps them zeroed
        keys = zero_rows(keys, window_tail(x.window_bad, keep))
    return VQState(counts, sums, keys, window_tail(x.v, keep), c.start + x.v.shape[2], x.block_len, window)
