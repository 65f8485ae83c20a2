"""The attention base class (projections, the short convolution, q/k normalisation, RoPE, the chunked-state
protocol) and the state and output types every layer shares. RoPE and the convolution themselves are modules of
their own (:mod:`vqattn.modules`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ..modules.conv import ShortConvolution
from ..modules.rope import rope_rotate
from ..ops.utils import check_positive_int
from ..ops.varlen import Packing, Segments, as_packing, check_state_list, resolve_call


@dataclass
class AttentionState:
    """Decoding state of one layer after ``pos`` tokens: the op's own state plus the position counter.

    ``inner`` is a ``KVCache`` for softmax, the op's ``VQState`` for vq layers and its ``LinearState``
    for the kernel family. ``conv``: the last ``short_conv - 1`` q/k/v projections (B, short_conv - 1, 3C) that
    the short convolution of the next token reads (None without one).
    """

    pos: int
    inner: Any
    conv: torch.Tensor | None = None

    def detached(self, max_cache: int | None = None) -> AttentionState:
        """This state without autograd history; KV caches keep their newest ``max_cache`` keys when given."""
        inner = self.inner
        if isinstance(inner, KVCache) and max_cache is not None:
            inner = KVCache(inner.k[:, :, -max_cache:], inner.v[:, :, -max_cache:])
        return AttentionState(self.pos, _detach(inner), _detach(self.conv))


def _detach(obj: Any) -> Any:
    """Detach every tensor of a (possibly nested) NamedTuple / dataclass state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_detach(x) for x in obj))
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _detach(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    return obj


class AttentionOutput(NamedTuple):
    """What every attention layer returns."""

    output: torch.Tensor  # (B, T, C)
    aux_loss: torch.Tensor  # scalar: the vq commitment loss, 0 for the other attentions
    state: AttentionState | None  # the state after this chunk when return_state=True, else None


def op_result(result, return_state: bool):
    """(out, the op's state or None) of an op called with ``return_state``: every op returns out, or (out, state)
    when asked for its state."""
    return result if return_state else (result, None)


class KVCache(NamedTuple):
    """Softmax decoding state: all past keys (already rotated when RoPE is on) and values, (B, H, P, D)."""

    k: torch.Tensor
    v: torch.Tensor


QK_NORMS = (False, True, "rms", "l2")


def check_layer_input(x, dim: int) -> None:
    """What every layer's ``forward`` takes: x a floating-point (B, T, dim) tensor with T >= 1, else a ValueError
    naming x. The ops check their inputs too, but only after the projections, where an integer x has already failed
    in a matmul (a dtype mismatch) and an empty one in a reshape or a cat."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != dim:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (B, T, {dim}), got {got}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("x must have at least one position (T >= 1), got shape " + str(tuple(x.shape)))


class L2Norm(nn.Module):
    """x / ‖x‖ per head vector of x (B, H, T, Dh), times a learned per-head scale when ``num_heads`` is given.

    For q, with the scale initialised to Dh, the logit Dh^{−1/2} q·k of a unit key starts at √Dh·cos θ, the range
    of RMS-normalised vectors; learning it sets how sharp attention can get (unit keys leave it to q)."""

    def __init__(self, num_heads: int | None = None, *, scale: float = 1.0):
        super().__init__()
        self.scale = None if num_heads is None else nn.Parameter(torch.full((num_heads, 1, 1), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.normalize(x, dim=-1)
        return x if self.scale is None else x * self.scale.to(x.dtype)


class Attention(nn.Module):
    """Base class: projections, an optional short convolution, q/k normalisation, RoPE and the chunked-state
    protocol.

    Subclasses implement ``_attend(q, k, v, pos, state, return_state) -> (out, aux_loss, op_state)`` on
    (B, H, T, Dh) tensors, where q and k are projected and normalised but not rotated (each variant decides where
    RoPE goes), ``pos`` is the absolute position of the first token and ``state`` the op state (or None for a
    fresh start); ``aux_loss`` may be None (no auxiliary loss).
    """


    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        qk_norm: bool | str = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        short_conv: int = 0,
        layer_idx: int = 0,
    ):
        """layer_idx: position of the layer in its model; layers with random features derive their seed from it.

        qk_norm: normalise q and k per head: False; True or "rms" (RMSNorm, as in Transformer-VQ); or "l2" (unit
        vectors, q times a learned per-head scale: :class:`L2Norm`).

        short_conv: kernel size of a causal depthwise convolution over time of the fused q/k/v projections
        (flash-linear-attention's ShortConvolution, as in H3, Based and Mamba); 0 = none. Each of q, k and v then
        mixes its token with the ``short_conv - 1`` before it, so one attention layer can match a query against the
        token *before* each key: the associative-recall (induction) step that plain attention needs two layers and
        a long training plateau to learn. It is initialised to the identity (the last tap 1, the others 0), so a
        fresh layer computes what the layer without it does.
        """
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got dim // num_heads = {self.head_dim}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if rope_base <= 0:
            raise ValueError(f"rope_base must be > 0, got {rope_base!r}")
        if isinstance(short_conv, bool) or not isinstance(short_conv, int) or short_conv < 0:
            raise ValueError(f"short_conv must be an int >= 0 (a kernel size; 0 = no convolution), got {short_conv!r}")
        self.rope, self.rope_base, self.layer_idx = rope, rope_base, layer_idx
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.short_conv = short_conv
        self.conv = ShortConvolution(3 * dim, short_conv) if short_conv else None
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of False, True, 'rms', 'l2'; got {qk_norm!r}")
        # Transformer-VQ RMS-normalises q and k per head; this bounds |q.k| and keeps codes comparable.
        if qk_norm == "l2":
            self.q_norm, self.k_norm = L2Norm(num_heads, scale=float(self.head_dim)), L2Norm()
        else:
            self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
            self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def rotate(self, x: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        """RoPE at positions pos.. when this layer uses it, else x unchanged."""
        return rope_rotate(x, pos, self.rope_base) if self.rope else x

    def forward(
        self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False,
        cu_seqlens: torch.Tensor | Packing | Segments | None = None,
    ) -> AttentionOutput:
        """x: (B, T, C) -> AttentionOutput(output (B, T, C), aux_loss (scalar), state or None).

        ``state`` summarises the tokens before x (from a previous call with ``return_state=True``); the returned
        state (only when ``return_state``) summarises them and x.

        ``cu_seqlens`` (int32 (N+1,), with B = 1): x packs N sequences along T (:mod:`vqattn.ops.varlen`); each
        is attended as a call of its own would attend it (RoPE positions, the short convolution and the op all
        restart at its first token). ``state`` is then a list of N states (None entries start fresh) and the
        returned state such a list. A :class:`~vqattn.ops.varlen.Packing` (boundaries already read, as the model
        hands them to its layers) is taken in place of the tensor, and so are
        :class:`~vqattn.ops.varlen.Segments` (the boundaries as tensors, for ``torch.compile``; no states).
        """
        per_sequence, cu_seqlens, positions = self._read_call(x, state, return_state, cu_seqlens)
        if per_sequence is not None:
            return per_sequence
        b, t, c = x.shape
        qkv, conv = self.qkv(x), None  # (B, T, 3C)
        if self.conv is not None:
            qkv, conv = self.conv(qkv, None if state is None else state.conv, positions)
        # Unbind before transposing: the backward pass then stacks the three gradients straight into qkv's layout,
        # where permuting first left a stacked gradient that the view back had to copy once more.
        heads = qkv.view(b, t, 3, self.num_heads, self.head_dim).unbind(2)  # 3 x (B, T, H, Dh)
        q, k, v = (h.transpose(1, 2) for h in heads)  # (B, H, T, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = 0 if state is None else state.pos
        if cu_seqlens is None:
            out, aux_loss, inner = self._attend(q, k, v, pos, None if state is None else state.inner, return_state)
        else:  # per-token positions; no state
            out, aux_loss, inner = self._attend(q, k, v, positions, None, False, cu_seqlens=cu_seqlens)
        y = self.resid_dropout(self.proj(out.transpose(1, 2).reshape(b, t, c)))  # (B, T, C)
        aux_loss = x.new_zeros(()) if aux_loss is None else aux_loss
        return AttentionOutput(y, aux_loss, AttentionState(pos + t, inner, conv) if return_state else None)

    def _read_call(self, x, state, return_state: bool, cu_seqlens):
        """The checks and the packing dispatch every layer's forward starts with: (the output of a packed call with
        states, run sequence by sequence, else None; the boundaries the op takes, a Packing or Segments or None;
        the (T,) positions of packed tokens or None)."""
        check_layer_input(x, self.dim)
        call = resolve_call(cu_seqlens, batch=x.shape[0], length=x.shape[1], state=state, return_state=return_state,
                            device=x.device)
        if call.each is not None:
            return self._per_sequence(x, call.each, state, return_state), None, None
        if state is not None and not isinstance(state, AttentionState):
            raise ValueError(f"state must be an AttentionState or None, got {type(state).__name__}")
        return None, call.boundaries, call.positions

    def _per_sequence(self, x, bounds: tuple[int, ...], state, return_state: bool) -> AttentionOutput:
        """A packed call with states: each sequence alone, with its own state; the aux loss their token-weighted
        mean, as one packed call gives it."""
        check_state_list(state, bounds, "AttentionStates")
        parts = [self(x[:, a:b], None if state is None else state[i], return_state)
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        aux = sum(p.aux_loss * (b - a) for p, a, b in zip(parts, bounds, bounds[1:])) / bounds[-1]
        return AttentionOutput(torch.cat([p.output for p in parts], 1), aux,
                               [p.state for p in parts] if return_state else None)

    def _attend(self, q, k, v, pos: int | torch.Tensor, state, return_state: bool, cu_seqlens: Packing | None = None):
        """q, k, v (B, H, T, Dh) at positions pos.. (an int; or, with ``cu_seqlens`` (a Packing), the (T,)
        positions of packed sequences, then with no state) -> (out (B, H, T, Dh), aux loss or None, the op's state or None)."""
        raise NotImplementedError

    def state_floats(self, seq_len: int) -> int:
        """Numbers held by this layer's decoding state (all heads) after ``seq_len`` tokens: the memory that
        recall must fit through, compared across attentions at equal size (as in Zoology). The short
        convolution's (short_conv - 1) x 3C projections count too."""
        return self._op_state_floats(seq_len) + max(self.short_conv - 1, 0) * 3 * self.dim

    def _op_state_floats(self, seq_len: int) -> int:
        """The op's own state: the part that depends on the attention."""
        raise NotImplementedError

    def usage_stats(self) -> dict[str, float]:
        """Codebook usage statistics (vq layers); empty for the others."""
        return {}


class CachedAttention(Attention):
    """Quadratic attention whose decoding state is a KV cache (memory grows with the sequence).

    Subclasses implement ``_quadratic(q, k, v)``: causal attention of the last Tq positions (q) over all Tk ≥ Tq
    keys, query i sitting at position Tk − Tq + i.
    """

    def _attend(self, q, k, v, pos, state: KVCache | None, return_state, cu_seqlens=None):
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        if cu_seqlens is not None:
            return self._packed_quadratic(q, k, v, cu_seqlens), None, None
        if state is not None:
            k, v = torch.cat((state.k, k), dim=2), torch.cat((state.v, v), dim=2)  # (B, H, P+T, Dh)
        # A prefill's k and v are views of the q/k/v projection, with strides that depend on its length: the cache
        # holds tensors of its own, so that a compiled decoding step does not recompile for every prompt's layout.
        cache = KVCache(k.contiguous(), v.contiguous()) if return_state else None
        return self._quadratic(q, k, v), None, cache

    def _quadratic(self, q, k, v):
        raise NotImplementedError

    def _packed_quadratic(self, q, k, v, cu_seqlens: Packing | Segments) -> torch.Tensor:
        """Causal attention of packed sequences: each one's ``_quadratic`` alone."""
        return _each_sequence(self._quadratic, q, k, v, cu_seqlens)

    def _op_state_floats(self, seq_len: int) -> int:
        return 2 * seq_len * self.dim  # every key and value


@torch.compiler.disable  # one call per sequence: a graph would recompile for every new batch of documents
def _each_sequence(quadratic, q, k, v, cu_seqlens: Packing | Segments) -> torch.Tensor:
    if isinstance(cu_seqlens, Segments):  # read here, outside the graph
        cu_seqlens = cu_seqlens.cu_seqlens
    bounds = as_packing(cu_seqlens, batch=q.shape[0], length=q.shape[2]).bounds
    return torch.cat([quadratic(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])], 2)


