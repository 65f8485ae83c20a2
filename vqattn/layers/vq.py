"""Codebook attention layers: Transformer-VQ (hard) and the Gaussian mixture (soft)."""

from __future__ import annotations

from typing import ClassVar

from ..codebook import Codebook
from ..modules.rope import pair_dims, rope_rotate_keeping, slow_pair_start
from ..ops.blocks import DEFAULT_BLOCK_LEN, Schedule, check_block_len, resolve_block_len
from ..ops.common.memory_cap import RAW_WINDOW, layer_memory_cap
from ..ops.utils import check_choice, check_positive_int
from ..ops.vq import IMPLS as VQ_IMPLS
from ..ops.vq import vq_attention
from .base import Attention, op_result

CACHE_SCORES = ("all", "slow")


class VQAttention(Attention):
    """Codebook attention (``vq_attention``) with a learned per-head :class:`~vqattn.codebook.Codebook`.

    The codebook module quantises the keys (EMA k-means or gradient learning), and its commitment loss is
    the ``aux_loss`` this layer returns. Decoding keeps ``VQState``: per-code counts and value sums plus a raw window of
    under 2·block_len keys, i.e. constant memory per token.

    RoPE (``rope=True``) acts only inside the uncompressed window, which must hold the raw keys
    (``exact_window=True``): the codes stay position-free, so the compressed cache is the same whichever
    position a key came from. Rotating keys before quantisation would instead make the code of a key depend
    on its absolute position (the codebook would have to cover every rotation of every key), and rotating
    quantised keys per position cannot be summed per code. The op takes the rotated queries and keys for the
    window (``q_rot``, ``k_rot``) and scores the codes with the unrotated queries, q·c, so the window logit is RoPE
    attention and the cache logit the position-free code score; the codebook's assignment of the raw keys is
    handed over (``assignment=``), also when decoding.

    ``cache_scores``: the dims of the code score q·c under RoPE. ``"slow"`` (default) keeps only the pairs that
    turn by less than one radian across the raw window (2·block_len tokens): at the cache's distances the faster
    pairs' RoPE terms average out, as they do in softmax attention, so the code score keeps only what a far key's
    RoPE logit keeps (the assignment is unchanged). ``"all"`` scores a code as if its keys sat at distance 0 in
    every RoPE pair. "slow" won by 0.13-0.16 bpb at two seeds and two lengths (docs/vq_ablations.md,
    docs/experiments.md); without RoPE no pair turns, and both score every dim.
    """

    assign: ClassVar[str]

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_codes: int = 64,
        block_len: int | None = DEFAULT_BLOCK_LEN,
        exact_window: bool = True,
        cache_scores: str = "slow",
        codebook: dict | None = None,
        memory_cap: int | str | None = RAW_WINDOW,
        impl: str = "auto",
        **attention_kwargs,
    ):
        """``codebook``: extra :class:`~vqattn.codebook.Codebook` kwargs (learning, decay, commitment, ...);
        ``memory_cap``: the codes weigh as if they held at most this many keys (``vq_attention``'s); ``"window"``
        (default): 2 × block_len, the raw window's keys, with which a model reads past its training length as the
        window does and trains better (docs/evaluation.md); None: no bound. The soft mixture window
        (``exact_window=False``) reads the previous block through the codes, so it takes no bound ("window" gives
        None there);
        ``impl``: the op's impl (``vq_attention``'s: "auto" runs the Triton kernel on CUDA where it applies);
        ``attention_kwargs`` go to :class:`Attention`."""
        super().__init__(dim, num_heads, **attention_kwargs)
        if self.rope and not exact_window:
            raise ValueError(
                f"{type(self).__name__} with rope=True needs exact_window=True: RoPE is applied only inside the "
                "uncompressed window, which must then hold the raw keys (codes are position-free so that the "
                "compressed cache stays valid). Pass exact_window=True, or use learned or no positions."
            )
        check_block_len(block_len)
        mixture_window = self.assign == "soft" and not exact_window
        if mixture_window and memory_cap == RAW_WINDOW:
            memory_cap = None
        self.memory_cap = layer_memory_cap(memory_cap, resolve_block_len(block_len))
        if self.memory_cap is not None and mixture_window:
            raise ValueError("memory_cap needs exact_window=True with soft assignment (the mixture window reads the "
                             "previous block through the codes): pass memory_cap=None or exact_window=True")
        check_choice("cache_scores", cache_scores, CACHE_SCORES)
        check_choice("impl", impl, VQ_IMPLS)
        self.impl = impl
        # how the op runs its blocks and kernels (vqattn.ops.blocks.Schedule; never what it computes): the op's
        # default, set on an instance to time another kernel design (benchmarks/layer_speed.py --superblock-blocks)
        self.schedule: str | Schedule = "auto"
        check_positive_int("num_codes", num_codes)
        self.cache_scores = cache_scores
        self.block_len, self.exact_window = block_len, exact_window
        # a Python int, so that slicing by it is static under torch.compile
        self.slow_start = slow_pair_start(self.head_dim, self.rope_base, 2 * resolve_block_len(block_len))
        self.codebook = Codebook(num_heads, num_codes, self.head_dim, assign=self.assign, **(codebook or {}))

    def _attend(self, q, k, v, pos, state, return_state, cu_seqlens=None):
        # only the slow pairs' dims score the codes ("slow", under RoPE): the op gets those alone
        first_pair = self.slow_start if self.rope and self.cache_scores == "slow" else 0
        rotated = {}
        if self.rope:  # the window scores rotated q and k; the codes are scored by the unrotated q (position-free)
            (q_rot, q), (k_rot, k) = (rope_rotate_keeping(x, pos, self.rope_base, p)
                                      for x, p in ((q, first_pair), (k, 0)))
            rotated = dict(q_rot=q_rot, k_rot=k_rot)
        # (H, S, Dh); codes are learned on unrotated keys. A decoding step (eval, with a state) records no statistics.
        codebook, assignment, aux_loss = self.codebook(k, record=self.training or state is None)
        codebook = pair_dims(codebook, first_pair)
        result = vq_attention(
            q, k, v, codebook,
            causal=True,
            assign=self.codebook.assign,
            temperature=self.codebook.temperature,
            block_len=self.block_len,
            scale=self.head_dim**-0.5,
            exact_window=self.exact_window,
            state=state,
            return_state=return_state,
            assignment=assignment,  # computed once, by the codebook, from the raw keys and codes
            memory_cap=self.memory_cap,
            impl=self.impl,
            schedule=self.schedule,
            cu_seqlens=cu_seqlens,
            **rotated,
        )
        out, op_state = op_result(result, return_state)
        return out, aux_loss, op_state

    def usage_stats(self) -> dict[str, float]:
        return self.codebook.usage_stats()

    def _op_state_floats(self, seq_len: int) -> int:
        window = min(seq_len, 2 * resolve_block_len(self.block_len))  # raw keys and values
        return self.num_heads * self.codebook.num_codes * (self.head_dim + 1) + 2 * window * self.dim


class VQHardAttention(VQAttention):
    """Transformer-VQ: keys snap to their nearest code (straight-through gradient in the window)."""

    assign = "hard"


class VQSoftAttention(VQAttention):
    """Gaussian-mixture codebook attention: keys spread over codes by their posterior p(s | k)."""

    assign = "soft"
