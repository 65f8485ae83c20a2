"""Rotary position embedding (RoPE): angles in float64, rotations in at least float32, one autograd node that can
also hand back the unrotated slow pairs."""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ..ops.common.pairs import pair_dims
from ..ops.triton import rotation
from ..ops.utils import memory_order


def rope_frequencies(head_dim: int, base: float, device=None) -> torch.Tensor:
    """(head_dim/2,) float64 angle per position of RoPE pair (x_m, x_{m+D/2}): base^(-2m/D)."""
    return base ** (-torch.arange(head_dim // 2, dtype=torch.float64, device=device) * 2.0 / head_dim)


def token_positions(start: int | torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """(T,) float64 positions: start..start+T-1 for an int ``start``, or ``start`` itself, a (T,) tensor of each
    token's position (packed sequences restart at 0: :func:`vqattn.ops.varlen.positions`)."""
    if isinstance(start, torch.Tensor):
        if start.shape != (length,):
            raise ValueError(f"positions must be a ({length},) tensor, one per token, got {tuple(start.shape)}")
        return start.to(device=device, dtype=torch.float64)
    return torch.arange(start, start + length, dtype=torch.float64, device=device)


def _rope_cos_sin(start: int | torch.Tensor, length: int, head_dim: int, base: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_frequencies(head_dim, base, device)  # (D/2,)
    pos = token_positions(start, length, device)  # (T,)
    angle = pos[:, None] * inv_freq[None, :]  # (T, D/2), in float64
    return angle.cos().to(dtype), angle.sin().to(dtype)


@functools.lru_cache(maxsize=8)
def _rope_cos_sin_cached(start: int, length: int, head_dim: int, base: float, device: torch.device,
                         dtype: torch.dtype, inference_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope_cos_sin`, cached; ``inference_mode`` is part of the key only."""
    return _rope_cos_sin(start, length, head_dim, base, device, dtype)


def rope_cos_sin(start: int | torch.Tensor, length: int, head_dim: int, base: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D/2) of RoPE's angles pos * base^(-2m/D) at positions start..start+T-1 (or at the (T,)
    positions ``start`` holds), in ``dtype``.

    Every layer of a forward pass (and q and k in each) rotates at the same positions, so outside
    ``torch.compile`` they are computed once and cached: in decoding that is ~20 fewer small kernels per layer and
    token. The key includes inference mode, because an inference-mode tensor cannot be saved for a backward pass.
    """
    if torch.compiler.is_compiling() or isinstance(start, torch.Tensor):
        return _rope_cos_sin(start, length, head_dim, base, device, dtype)
    return _rope_cos_sin_cached(start, length, head_dim, base, torch.device(device), dtype,
                                torch.is_inference_mode_enabled())


def slow_pair_start(head_dim: int, base: float, window: int) -> int:
    """m0: the first RoPE pair (m, m + Dh/2) that turns by less than one radian over ``window`` tokens,
    θ_m·window < 1. θ_m = base^(−2m/Dh) falls with m, so the slow pairs are m0 .. Dh/2 − 1 (on the host, float64).
    A pair that turns by a radian or more within the window turns through every angle within 2π windows, so inside
    any training length past that; a slow pair meets angles past the training length that it never met in training."""
    return int((rope_frequencies(head_dim, base) * window >= 1).sum())


def rope_rotate(x: torch.Tensor, start: int | torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding of x: (B, H, T, D) at absolute positions start..start+T-1 (or at the (T,)
    positions of a tensor ``start``, as packed sequences pass them).

    Feature pairs (x_m, x_{m+D/2}) are rotated by the angle pos * base^(-2m/D), so that
    <rope(q, i), rope(k, j)> depends on i and j only through i - j. Angles are computed in float64
    and the rotation in at least float32, so fp64 decoding matches the full pass to rounding.
    """
    return _rope(x, start, base, None)


def rope_rotate_keeping(x: torch.Tensor, start: int | torch.Tensor, base: float, first_pair: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`rope_rotate` of x, the unrotated ``pair_dims(x, first_pair)``): for layers that score some things
    with rotated and others with raw vectors. One autograd node, so the backward pass adds the raw part's gradient
    into the rotation's in place; separate uses of x would each write an x-sized gradient (and a slice's backward
    zero-fills one) for autograd to add up: at T = 32768, three fresh 32 MB tensors per layer step."""
    return _rope(x, start, base, first_pair)


def with_raw_pairs(rotated: torch.Tensor, raw: torch.Tensor, first_pair: int) -> torch.Tensor:
    """rotated (..., D) with its pairs m ≥ ``first_pair`` taken from ``raw`` (..., D − 2·first_pair), the
    ``pair_dims`` of the unrotated x (:func:`rope_rotate_keeping`): the fast pairs rotated, the slow ones not."""
    if first_pair == 0:
        return raw
    half = rotated.shape[-1] // 2
    return torch.cat((rotated.unflatten(-1, (2, half))[..., :first_pair],
                      raw.unflatten(-1, (2, half - first_pair))), dim=-1).flatten(-2)


def rope_rotate_clamped(x: torch.Tensor, start: int | torch.Tensor, base: float, first_pair: int, max_pos: int) -> torch.Tensor:
    """:func:`rope_rotate` of x (B, H, T, D) with the pairs m ≥ ``first_pair`` rotated by min(position, max_pos).

    For two positions i ≥ j those pairs turn by θ_m·(min(i, P) − min(j, P)) ∈ [0, θ_m·P]: at positions up to P it is
    RoPE itself, and past P no such angle leaves the range that positions up to P produce (a slow pair, which turns
    less than a radian over the raw window, never meets an angle that a training length of P did not)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = rope_frequencies(x.shape[-1], base, x.device)  # (D/2,)
    pos = token_positions(start, x.shape[-2], x.device)  # (T,)
    clamped = torch.arange(x.shape[-1] // 2, device=x.device) >= first_pair  # (D/2,)
    angle = torch.where(clamped, pos.clamp(max=max_pos)[:, None], pos[:, None]) * inv_freq  # (T, D/2), float64
    return _rotate_by(x, angle.cos().to(dtype), angle.sin().to(dtype), None)


def _rope(x: torch.Tensor, start: int | torch.Tensor, base: float, first_pair: int | None):
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = rope_cos_sin(start, x.shape[-2], x.shape[-1], base, x.device, dtype)
    return _rotate_by(x, cos, sin, first_pair)


def _rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first_pair: int | None):
    """x rotated by the angles with cos and sin (T, D/2) (and, with ``first_pair`` not None, x's raw pair_dims)."""
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
        ctx.dtype, ctx.first_pair, ctx.order = x.dtype, first_pair, memory_order(x)
        if rotation.runs_rotation_kernel(x):  # one pass on a GPU
            rotated = rotation.rotate(x, cos, sin, 1.0)
        else:
            rotated = _rotate(x, cos, sin, 1.0).to(x.dtype)
        return rotated if first_pair is None else (rotated, pair_dims(x, first_pair))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_raw=None):
        cos, sin = ctx.saved_tensors
        if grad.dtype == ctx.dtype and rotation.runs_rotation_kernel(grad):  # the raw part added in the same pass
            # written in x's memory order: a layer's q and k are token-major views of its projection
            return rotation.rotate(grad, cos, sin, -1.0, grad_raw, ctx.first_pair or 0, ctx.order), None, None, None
        out = _rotate(grad, cos, sin, -1.0)
        if grad_raw is not None:
            raw = out if ctx.first_pair == 0 else out.unflatten(-1, (2, out.shape[-1] // 2))[..., ctx.first_pair:]
            raw.add_(grad_raw.view(raw.shape))
        return out.to(ctx.dtype), None, None, None
