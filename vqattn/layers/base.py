"""The attention base class (projections, q/k normalisation, RoPE, the chunked-state protocol) and the
state and output types every layer shares."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..ops._checks import check_positive_int


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


def rope_frequencies(head_dim: int, base: float, device=None) -> torch.Tensor:
    """(head_dim/2,) float64 angle per position of RoPE pair (x_m, x_{m+D/2}): base^(-2m/D)."""
    return base ** (-torch.arange(head_dim // 2, dtype=torch.float64, device=device) * 2.0 / head_dim)


def _rope_cos_sin(start: int, length: int, head_dim: int, base: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_frequencies(head_dim, base, device)  # (D/2,)
    pos = torch.arange(start, start + length, dtype=torch.float64, device=device)  # (T,)
    angle = pos[:, None] * inv_freq[None, :]  # (T, D/2), in float64
    return angle.cos().to(dtype), angle.sin().to(dtype)


@functools.lru_cache(maxsize=8)
def _rope_cos_sin_cached(start: int, length: int, head_dim: int, base: float, device: torch.device,
                         dtype: torch.dtype, inference_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope_cos_sin`, cached; ``inference_mode`` is part of the key only."""
    return _rope_cos_sin(start, length, head_dim, base, device, dtype)


def rope_cos_sin(start: int, length: int, head_dim: int, base: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D/2) of RoPE's angles pos * base^(-2m/D) at positions start..start+T-1, in ``dtype``.

    Every layer of a forward pass (and q and k in each) rotates at the same positions, so outside
    ``torch.compile`` they are computed once and cached: in decoding that is ~20 fewer small kernels per layer and
    token. The key includes inference mode, because an inference-mode tensor cannot be saved for a backward pass.
    """
    if torch.compiler.is_compiling():
        return _rope_cos_sin(start, length, head_dim, base, device, dtype)
    return _rope_cos_sin_cached(start, length, head_dim, base, torch.device(device), dtype,
                                torch.is_inference_mode_enabled())


def rope_rotate(x: torch.Tensor, start: int, base: float) -> torch.Tensor:
    """Rotary position embedding of x: (B, H, T, D) at absolute positions start..start+T-1.

    Feature pairs (x_m, x_{m+D/2}) are rotated by the angle pos * base^(-2m/D), so that
    <rope(q, i), rope(k, j)> depends on i and j only through i - j. Angles are computed in float64
    and the rotation in at least float32, so fp64 decoding matches the full pass to rounding.
    """
    return _rope(x, start, base, None)


def rope_rotate_keeping(x: torch.Tensor, start: int, base: float, first_pair: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`rope_rotate` of x, the unrotated ``pair_dims(x, first_pair)``): for layers that score some things
    with rotated and others with raw vectors. One autograd node, so the backward pass adds the raw part's gradient
    into the rotation's in place; separate uses of x would each write an x-sized gradient (and a slice's backward
    zero-fills one) for autograd to add up: at T = 32768, three fresh 32 MB tensors per layer step."""
    return _rope(x, start, base, first_pair)


def pair_dims(x: torch.Tensor, first_pair: int) -> torch.Tensor:
    """x (..., D) -> (..., D − 2·first_pair): the dims [first_pair, D/2) and [D/2 + first_pair, D) of the RoPE pairs
    (m, m + D/2) with m ≥ first_pair; x itself for 0. A static slice: no host read, so it compiles into one graph
    and never synchronises a GPU; one slice of the (..., 2, D/2) view, not a cat of two."""
    return x if first_pair == 0 else x.unflatten(-1, (2, x.shape[-1] // 2))[..., first_pair:].flatten(-2)


def _rope(x: torch.Tensor, start: int, base: float, first_pair: int | None):
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = rope_cos_sin(start, x.shape[-2], x.shape[-1], base, x.device, dtype)
    if torch.compiler.is_compiling():  # autograd of the formula, which inductor fuses into one kernel
        rotated = _rotate(x, cos, sin, 1.0).to(x.dtype)
        return rotated if first_pair is None else (rotated, pair_dims(x, first_pair))
    return _Rotation.apply(x, cos, sin, first_pair)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """[x1·cos − sign·x2·sin, x2·cos + sign·x1·sin] for the halves x1, x2 of x (..., D), in cos's dtype: the rotation
    (sign 1) or its inverse (−1), written half by half into one output in eager mode."""
    x1, x2 = x.to(cos.dtype).chunk(2, -1)
    if torch.compiler.is_compiling():  # out= writes have no autograd; the formula's cat fuses away
        return torch.cat((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), dim=-1)
    out = torch.empty(x.shape, device=x.device, dtype=cos.dtype)
    first, second = out.chunk(2, -1)
    torch.mul(x1, cos, out=first).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=second).addcmul_(x1, sin, value=sign)
    return out


class _Rotation(torch.autograd.Function):
    """RoPE's rotation of x (B, H, T, D) by the angles with cos and sin (T, D/2) in eager mode, and with
    ``first_pair`` not None also x's raw ``pair_dims``; the gradient is the inverse rotation of the rotated output's,
    plus the raw part's added in place. By hand: eager autograd of the sliced formula zero-fills an (x-sized) gradient
    for each half and adds them, and keeps four products and a cat (at T = 32768, 53 ms of products and 17 ms of
    zero fills per layer step on a 2-core CPU, against 37 ms in all here)."""

    @staticmethod
    def forward(ctx, x, cos, sin, first_pair):
        ctx.save_for_backward(cos, sin)
        ctx.dtype, ctx.first_pair = x.dtype, first_pair
        rotated = _rotate(x, cos, sin, 1.0).to(x.dtype)
        return rotated if first_pair is None else (rotated, pair_dims(x, first_pair))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_raw=None):
        cos, sin = ctx.saved_tensors
        out = _rotate(grad, cos, sin, -1.0)
        if grad_raw is not None:
            raw = out if ctx.first_pair == 0 else out.unflatten(-1, (2, out.shape[-1] // 2))[..., ctx.first_pair:]
            raw.add_(grad_raw.view(raw.shape))
        return out.to(ctx.dtype), None, None, None


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
        self.conv = nn.Conv1d(3 * dim, 3 * dim, short_conv, groups=3 * dim, bias=False) if short_conv else None
        if self.conv is not None:
            with torch.no_grad():
                self.conv.weight.zero_()
                self.conv.weight[:, 0, -1] = 1.0
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

    def rotate(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """RoPE at positions pos.. when this layer uses it, else x unchanged."""
        return rope_rotate(x, pos, self.rope_base) if self.rope else x

    def forward(
        self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False
    ) -> AttentionOutput:
        """x: (B, T, C) -> AttentionOutput(output (B, T, C), aux_loss (scalar), state or None).

        ``state`` summarises the tokens before x (from a previous call with ``return_state=True``); the returned
        state (only when ``return_state``) summarises them and x.
        """
        check_layer_input(x, self.dim)
        if state is not None and not isinstance(state, AttentionState):
            raise ValueError(f"state must be an AttentionState or None, got {type(state).__name__}")
        b, t, c = x.shape
        qkv, conv = self.qkv(x), None  # (B, T, 3C)
        if self.conv is not None:
            qkv, conv = self._convolve(qkv, None if state is None else state.conv)
        # Unbind before transposing: the backward pass then stacks the three gradients straight into qkv's layout,
        # where permuting first left a stacked gradient that the view back had to copy once more.
        heads = qkv.view(b, t, 3, self.num_heads, self.head_dim).unbind(2)  # 3 x (B, T, H, Dh)
        q, k, v = (h.transpose(1, 2) for h in heads)  # (B, H, T, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = 0 if state is None else state.pos
        out, aux_loss, inner = self._attend(q, k, v, pos, None if state is None else state.inner, return_state)
        y = self.resid_dropout(self.proj(out.transpose(1, 2).reshape(b, t, c)))  # (B, T, C)
        aux_loss = x.new_zeros(()) if aux_loss is None else aux_loss
        return AttentionOutput(y, aux_loss, AttentionState(pos + t, inner, conv) if return_state else None)

    def _convolve(self, h: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Short causal convolution: out_t = sum_j w_j h_{t - K + 1 + j} per channel, with the K - 1 rows before
        h taken from ``past`` (zeros at the start of a sequence). h: (B, T, 3C) -> (out (B, T, 3C), the last
        K - 1 rows of [past, h] for the next chunk)."""
        k = self.short_conv
        if past is None:
            past = h.new_zeros(h.shape[0], k - 1, h.shape[-1])
        full = torch.cat((past.to(h.dtype), h), dim=1)  # (B, K - 1 + T, 3C)
        out = self.conv(full.transpose(1, 2)).transpose(1, 2)  # (B, T, 3C)
        return out, full[:, full.shape[1] - (k - 1):]

    def _attend(self, q, k, v, pos: int, state, return_state: bool):
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

    def _attend(self, q, k, v, pos, state: KVCache | None, return_state):
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        if state is not None:
            k, v = torch.cat((state.k, k), dim=2), torch.cat((state.v, v), dim=2)  # (B, H, P+T, Dh)
        return self._quadratic(q, k, v), None, (KVCache(k, v) if return_state else None)

    def _quadratic(self, q, k, v):
        raise NotImplementedError

    def _op_state_floats(self, seq_len: int) -> int:
        return 2 * seq_len * self.dim  # every key and value


