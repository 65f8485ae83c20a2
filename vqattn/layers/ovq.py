"""Online codebook attention layer: a raw window plus a per-sequence memory of slot means (``ovq_attention``)."""

from __future__ import annotations

import math

import torch

from ..codebook import Codebook
from ..modules.rope import rope_rotate_clamped, rope_rotate_keeping, slow_pair_start, with_raw_pairs
from ..ops.blocks import DEFAULT_BLOCK_LEN
from ..ops.common.memory_cap import RAW_WINDOW, layer_memory_cap
from ..ops.common.memory_decay import check_memory_decay
from ..ops.ovq import IMPLS as OVQ_IMPLS
from ..ops.ovq import OVERFLOW, ovq_attention
from ..ops.utils import check_choice, check_positive_int
from .base import Attention, op_result

SLOTS_BY = ("online", "codebook")
MEMORY_PAIRS = ("slow", "all")


class OnlineVQAttention(Attention):
    """Online codebook attention (:func:`~vqattn.ops.ovq.ovq_attention`): each query attends to the current and the
    previous block of ``block_len`` raw keys and to ``num_slots`` memory slots, each scored by the mean of the keys
    it absorbed in this sequence (σ q̃·k̄_s + log n_s) and read as their mean value.

    ``slots_by``: how keys find their slot. ``"online"``: per sequence, with growth: a key farther than ``threshold``
    (a squared distance relative to its squared norm) from every occupied slot's mean key opens a new slot while
    slots remain; once none remains, a novel key is not stored (``overflow="drop"``, default) or joins its nearest
    slot (``"nearest"``); a key near a slot joins it. ``"codebook"``: the hard argmin of a learned per-head
    :class:`~vqattn.codebook.Codebook` over the unrotated keys (``codebook``: its extra kwargs); its commitment loss
    is the layer's ``aux_loss``.

    With RoPE, the window uses rotated q and k; ``memory_rope`` says which RoPE pairs the memory's q and k rotate.
    ``True`` (default): every pair, so the slot means are sums of rotated keys: the fast-turning pairs of far keys
    average out and the slow ones keep coarse positions, which far recall uses. ``"fast"``: only the pairs that turn
    by a radian or more across the raw window (``slow_pair_start``), whose angles all occur within a training
    sequence; the slow pairs score position-free, so past the training length no memory score meets an angle that
    training never produced (it reads past that length evenly, and recalls less: docs/evaluation.md). ``False``:
    unrotated q and k. ``memory_pairs``: which RoPE pairs of those the memory scores, assigns and stores. ``"slow"``
    (default): the pairs that turn by less than a radian across the raw window (``slow_pair_start``, as vq's
    ``cache_scores``): a far key's fast pairs average out of its logit, so a slot keeps D − 2·m0 features per head
    instead of D. ``"all"``: every pair; without RoPE both keep every feature. Other than ``True``, the state keeps
    the window's memory keys too. ``memory_rope_clamp``
    (with ``True``): the slow pairs rotate by positions clamped there; it reads past the training length worse than
    no clamp (docs/evaluation.md), and is there for that comparison.

    ``qk_norm="l2"`` (unit q and k, q times a learned scale) makes the relative threshold and the slot means
    independent of the keys' norms. Decoding keeps the memory (S counts, S·(Dh + Dh) sums per head) and under
    2·block_len raw keys and values: constant in the length. ``memory_pairs="slow"`` with ``overflow="drop"``
    recall far keys at a quarter of softmax's state (docs/far_recall.md).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_slots: int = 64,
        block_len: int = DEFAULT_BLOCK_LEN,
        slots_by: str = "online",
        threshold: float = 0.1,
        memory_rope: bool | str = True,
        memory_pairs: str = "slow",
        overflow: str = "drop",
        codebook: dict | None = None,
        memory_cap: int | str | None = RAW_WINDOW,
        memory_decay: float | None = None,
        memory_rope_clamp: int | None = None,
        impl: str = "auto",
        **attention_kwargs,
    ):
        """``memory_cap``: the slots weigh as if they held at most this many keys (``ovq_attention``'s); ``"window"``
        (default): 2 × block_len, the raw window's keys, with which a model reads past its training length as the
        window does and trains better (docs/evaluation.md); None: no bound;
        ``memory_decay`` γ: forgetting (``ovq_attention``'s): each block of keys keeps γ^block_len of its weight per
        later block, so the slots are moving averages over about 1 / (1 − γ) keys, for training with carried state,
        or set on a trained model (the attribute) to read far past its training length T with γ = e^(−1/T)
        (docs/evaluation.md); None: none;
        ``memory_rope_clamp`` P: with ``memory_rope=True``, the memory's slow pairs (those ``"fast"`` leaves
        unrotated) rotate by min(position, P) (:func:`~vqattn.modules.rope.rope_rotate_clamped`): up to P nothing
        changes, and past P no memory score meets a slow-pair angle that positions up to P did not produce (it
        reads past the training length worse than no clamp: docs/evaluation.md); None: no clamp;
        ``impl``: the op's impl (``ovq_attention``'s: "auto" runs the Triton kernels on CUDA where they apply);
        ``attention_kwargs`` go to :class:`Attention`."""
        super().__init__(dim, num_heads, **attention_kwargs)
        check_positive_int("num_slots", num_slots)
        if memory_rope_clamp is not None:
            check_positive_int("memory_rope_clamp", memory_rope_clamp)
        check_positive_int("block_len", block_len)
        check_memory_decay(memory_decay, block_len)
        check_choice("slots_by", slots_by, SLOTS_BY)
        check_choice("memory_pairs", memory_pairs, MEMORY_PAIRS)
        check_choice("overflow", overflow, OVERFLOW)
        if not isinstance(memory_rope, bool) and memory_rope != "fast":
            raise ValueError(f"memory_rope must be True (every RoPE pair), False (none) or 'fast' (the pairs that turn "
                             f"by a radian or more across the raw window), got {memory_rope!r}")
        check_choice("impl", impl, OVQ_IMPLS)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold) \
                or threshold < 0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        if codebook is not None and slots_by != "codebook":
            raise ValueError("codebook kwargs configure the learned codebook of slots_by='codebook'; got "
                             f"slots_by={slots_by!r}")
        self.num_slots, self.block_len, self.slots_by, self.impl = num_slots, block_len, slots_by, impl
        self.threshold, self.memory_rope = float(threshold), memory_rope
        # the first slow pair: "fast" leaves it and those after it unrotated, memory_rope_clamp clamps them
        self.memory_clamped_from = slow_pair_start(self.head_dim, self.rope_base, 2 * block_len)
        # the first of the memory's unrotated RoPE pairs: a Python int, so that slicing by it is static under compile
        self.memory_raw_from = self.memory_clamped_from if memory_rope == "fast" \
            else self.head_dim // 2 if memory_rope else 0
        self.memory_cap, self.memory_rope_clamp = layer_memory_cap(memory_cap, block_len), memory_rope_clamp
        self.memory_pairs, self.overflow = memory_pairs, overflow
        # the memory's first pair: the slow ones alone (at least the slowest) under RoPE with memory_pairs="slow"
        self.memory_first_pair = min(self.memory_clamped_from, self.head_dim // 2 - 1) \
            if self.rope and memory_pairs == "slow" else 0
        self.memory_decay = memory_decay
        self.codebook = Codebook(num_heads, num_slots, self.head_dim, assign="hard", **(codebook or {})) \
            if slots_by == "codebook" else None
        # Mean occupied slots per sequence and head after the last forward (read by usage_stats, outside a step).
        self.register_buffer("last_occupied", torch.zeros((), dtype=torch.float32), persistent=False)

    def _attend(self, q, k, v, pos, state, return_state, cu_seqlens=None):
        slots, aux_loss, q_mem, k_mem = None, None, None, None
        if self.codebook is not None:
            # A decoding step (eval, with a state) records no statistics, as in the vq layers.
            _, assignment, aux_loss = self.codebook(k, record=self.training or state is None)
            slots = assignment.index
        if self.raw_memory_pairs:  # the memory's q and k leave the pairs from memory_raw_from on unrotated
            first = self.memory_raw_from
            (q, q_raw), (k, k_raw) = (rope_rotate_keeping(x, pos, self.rope_base, first) for x in (q, k))
            q_mem, k_mem = with_raw_pairs(q, q_raw, first), with_raw_pairs(k, k_raw, first)
        elif self.clamped_memory_pairs:
            q_mem, k_mem = self._clamped_memory_rotation(q, pos), self._clamped_memory_rotation(k, pos)
            q, k = self.rotate(q, pos), self.rotate(k, pos)
            if q_mem is None:  # every position within the clamp: the memory's rotation is the window's
                q_mem, k_mem = q, k
        else:
            q, k = self.rotate(q, pos), self.rotate(k, pos)
        result = ovq_attention(
            q, k, v,
            num_slots=self.num_slots,
            block_len=self.block_len,
            scale=self.head_dim**-0.5,
            threshold=self.threshold if slots is None else None,
            slots=slots,
            q_mem=q_mem,
            k_mem=k_mem,
            state=state,
            memory_cap=self.memory_cap,
            memory_decay=self.memory_decay,
            memory_first_pair=self.memory_first_pair,
            overflow=self.overflow if slots is None else "nearest",  # a codebook's slots are given: none dropped
            impl=self.impl,
            # its memory gives usage_stats, for the few statistics it costs (O(T·Dh)); a packed call would return
            # one state per sequence, computed one sequence at a time, so it asks for none
            return_state=cu_seqlens is None,
            cu_seqlens=cu_seqlens,
        )
        out, op_state = op_result(result, cu_seqlens is None)
        if op_state is not None:
            with torch.no_grad():
                self.last_occupied.copy_(op_state.occupied.float().mean())
        return out, aux_loss, op_state if return_state else None

    def _clamped_memory_rotation(self, x: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor | None:
        """x (B, H, T, Dh) at positions pos.. rotated with the slow pairs clamped at memory_rope_clamp, or None when
        no position passes it (then it is RoPE's rotation)."""
        # packed sequences' positions are a tensor: rotated with the clamp, a no-op below it (no host read)
        if not isinstance(pos, torch.Tensor) and pos + x.shape[-2] - 1 <= self.memory_rope_clamp:
            return None
        return rope_rotate_clamped(x, pos, self.rope_base, self.memory_clamped_from, self.memory_rope_clamp)

    @property
    def raw_memory_pairs(self) -> bool:
        """Whether the memory scores some RoPE pairs unrotated (memory_rope "fast" or False)."""
        return self.rope and self.memory_raw_from < self.head_dim // 2

    @property
    def clamped_memory_pairs(self) -> bool:
        """Whether the memory's slow pairs rotate by clamped positions (memory_rope True and a memory_rope_clamp)."""
        return self.rope and not self.raw_memory_pairs and self.memory_rope_clamp is not None

    @property
    def separate_memory_keys(self) -> bool:
        """Whether the memory gets q and k of its own (the state then keeps the window's memory keys too)."""
        return self.raw_memory_pairs or self.clamped_memory_pairs

    def usage_stats(self) -> dict[str, float]:
        """Mean occupied slots after the last forward, and the codebook's usage (slots_by="codebook"). Reads the
        device (call it outside the training step)."""
        stats = {} if self.codebook is None else self.codebook.usage_stats()
        return {**stats, "occupied_slots": float(self.last_occupied)}

    def _op_state_floats(self, seq_len: int) -> int:
        memory_dim = self.head_dim - 2 * self.memory_first_pair  # a slot's key features per head
        window = min(seq_len, 2 * self.block_len)  # raw keys and values (and unrotated memory keys)
        raw = (2 * self.head_dim + (memory_dim if self.separate_memory_keys else 0)) * window * self.num_heads
        return self.num_heads * self.num_slots * (memory_dim + self.head_dim + 1) + raw
