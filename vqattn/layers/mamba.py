"""Mamba-2 (Dao & Gu 2024) as an attention layer of this library: the recurrent baseline whose state decays by a
learned, input-dependent scalar per head (:func:`~vqattn.ops.decay.decay_attention`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules.conv import ShortConvolution
from ..ops.blocks import check_block_len
from ..ops.decay import IMPLS, decay_attention
from ..ops.utils import check_choice, check_positive_int
from .base import Attention, AttentionOutput, AttentionState, L2Norm, op_result


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm (``RMSNormGated`` with ``norm_before_gate=False``): RMSNorm(y · SiLU(z)) over groups of
    the channels, times a learned weight; in float32 at least, returned in y's dtype."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(y.dtype, torch.float32)
        h = y.to(dt) * F.silu(z.to(dt))
        h = h.unflatten(-1, (self.groups, -1))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (h.flatten(-2) * self.weight.to(dt)).to(y.dtype)


class Mamba2Attention(Attention):
    """Mamba-2's block as mamba_ssm and flash-linear-attention build it, on the width ``dim`` of the model.

    From x (B, T, C): a projection to x̂ (``expand``·C channels in ``num_heads`` heads of P), B and C (``n_groups``
    groups of ``d_state`` N, shared by the heads of a group) through ``qkv``; a causal depthwise convolution over time
    of x̂, B and C (``conv_size`` taps, Mamba's d_conv) and a SiLU; per head a step Δ = softplus(``dt_proj``(x) + bias)
    and a rate A = −exp(A_log) < 0; then the SSD, linear attention with a scalar decay,

        S_t = exp(Δ_t A) S_{t−1} + (Δ_t x̂_t) B_tᵀ,    y_t = S_t C_t + D x̂_t

    (:func:`~vqattn.ops.decay.decay_attention` with q = C, k = B, v = Δ·x̂, log decay Δ·A, scale 1), a gated RMSNorm
    with z = ``gate_proj``(x) and the output projection ``proj``. The initialisation is Mamba-2's: Δ log-uniform in
    [``dt_min``, ``dt_max``] (floored at ``dt_init_floor``), A uniform in ``a_init_range``, D = 1.

    The decoding state is S (H × P × N per layer, constant in the length) and the convolution's last
    ``conv_size − 1`` inputs: with the defaults (expand 2, N = 128, one group, 4 taps) 2·C·128 + 3·(2·C + 256)
    numbers, 34 304 at C = 128 (vq_hard's default state there holds 41 216).

    Differences from the base :class:`~vqattn.layers.base.Attention`:

    * ``short_conv`` > 0 (the model's ``short_conv``) sets the convolution's taps in place of ``conv_size``; 0 leaves
      Mamba's own (``conv_size=0``: none).
    * ``rope`` is accepted and leaves the layer unchanged: Mamba-2 has no position encoding (the decay orders the
      tokens), as the Mamba layers of Jamba and Samba beside RoPE attention.
    * ``qk_norm`` normalises C and B per group after the convolution and before the SiLU (RMS, or unit vectors with a
      learned scale for C), so their scale no longer follows the projection's.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        expand: int = 2,
        d_state: int = 128,
        n_groups: int = 1,
        conv_size: int = 4,
        block_len: int | None = None,
        impl: str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        a_init_range: Sequence[float] = (1.0, 16.0),
        norm_eps: float = 1e-5,
        **attention_kwargs,
    ):
        """``block_len``: the op's chunk length (default 64), which never changes the result; ``impl``: the op's
        (:func:`~vqattn.ops.decay.decay_attention`: "auto" runs fla's kernels on CUDA when installed). Other kwargs go to
        :class:`~vqattn.layers.base.Attention` (see the class docstring for ``short_conv``, ``rope`` and
        ``qk_norm``)."""
        short_conv = attention_kwargs.pop("short_conv", 0)
        qk_norm = attention_kwargs.pop("qk_norm", False)
        attention_kwargs.pop("rope", None)
        attention_kwargs.pop("rope_base", None)
        super().__init__(dim, num_heads, short_conv=short_conv, qk_norm=qk_norm, **attention_kwargs)
        for name, value in (("expand", expand), ("d_state", d_state), ("n_groups", n_groups)):
            check_positive_int(name, value)
        if num_heads % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide num_heads ({num_heads}): each group's B and C serve "
                             f"num_heads / n_groups heads")
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 0:
            raise ValueError(f"conv_size must be an int >= 0 (a kernel size; 0 = no convolution), got {conv_size!r}")
        check_block_len(block_len)
        check_choice("impl", impl, IMPLS)
        _check_dt(dt_min, dt_max, dt_init_floor)
        if (not isinstance(a_init_range, Sequence) or len(a_init_range) != 2
                or not 0 < a_init_range[0] <= a_init_range[1]):
            raise ValueError(f"a_init_range must be two numbers 0 < low <= high (A's initial range), got "
                             f"{a_init_range!r}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps!r}")
        bias = attention_kwargs.get("bias", False)
        self.rope = False  # see the class docstring
        self.block_len, self.impl, self.expand, self.d_state, self.n_groups = block_len, impl, expand, d_state, n_groups
        self.inner_dim = expand * dim
        self.head_dim = self.inner_dim // num_heads  # P, the values' (x̂'s) head dim
        self.qkv = nn.Linear(dim, 2 * n_groups * d_state + self.inner_dim, bias=bias)  # C, B, x̂
        self.short_conv = short_conv or conv_size
        self.conv = ShortConvolution(self.qkv.out_features, self.short_conv) if self.short_conv else None
        self.gate_proj = nn.Linear(dim, self.inner_dim, bias=bias)  # z
        self.dt_proj = nn.Linear(dim, num_heads, bias=False)
        # Mamba-2's initialisation: Δ = softplus(dt_bias) log-uniform in [dt_min, dt_max] at the start, A in the range
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(*a_init_range).log())
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.inner_dim, n_groups, norm_eps)
        self.proj = nn.Linear(self.inner_dim, dim, bias=bias)
        if qk_norm == "l2":  # C with a learned per-group scale (N: the range of RMS-normalised vectors' C·B), B unit
            self.q_norm, self.k_norm = L2Norm(n_groups, scale=float(d_state)), L2Norm()
        else:
            self.q_norm = nn.RMSNorm(d_state) if qk_norm else nn.Identity()
            self.k_norm = nn.RMSNorm(d_state) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False,
                cu_seqlens=None) -> AttentionOutput:
        """As :meth:`~vqattn.layers.base.Attention.forward`: x (B, T, C) -> AttentionOutput; the
        state holds the SSD's S (the op's :class:`~vqattn.ops.decay.DecayState`) and the convolution's last inputs."""
        per_sequence, cu_seqlens, positions = self._read_call(x, state, return_state, cu_seqlens)
        if per_sequence is not None:
            return per_sequence
        b, t, _ = x.shape
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        xbc, conv = self.qkv(x), None  # (B, T, 2GN + HP)
        if self.conv is not None:
            xbc, conv = self.conv(xbc, None if state is None else state.conv, positions)
        c, k, xs = xbc.split([G * N, G * N, H * P], dim=-1)
        q = F.silu(self.q_norm(c.view(b, t, G, N).transpose(1, 2)))  # (B, G, T, N)
        k = F.silu(self.k_norm(k.view(b, t, G, N).transpose(1, 2)))
        if G < H:  # each head reads its group's C and B (one group: a view)
            q, k = (z.expand(b, H, t, N) if G == 1 else z.repeat_interleave(H // G, dim=1) for z in (q, k))
        xs = F.silu(xs).view(b, t, H, P).transpose(1, 2)  # (B, H, T, P)
        wide = torch.promote_types(x.dtype, torch.float32)  # Δ and the decay in float32 at least
        dt = F.softplus(self.dt_proj(x).to(wide) + self.dt_bias.to(wide)).transpose(1, 2)  # (B, H, T)
        log_decay = dt * -torch.exp(self.A_log.to(wide)).unsqueeze(-1)  # Δ·A < 0
        v = (xs * dt.unsqueeze(-1)).to(xs.dtype)
        result = decay_attention(q, k, v, log_decay, scale=1.0, block_len=self.block_len,
                                 state=None if state is None else state.inner, return_state=return_state,
                                 cu_seqlens=cu_seqlens, impl=self.impl)
        y, inner = op_result(result, return_state)
        y = y + self.D.to(y.dtype).view(H, 1, 1) * xs
        y = self.norm(y.transpose(1, 2).reshape(b, t, H * P), self.gate_proj(x))
        out = self.resid_dropout(self.proj(y))
        pos = 0 if state is None else state.pos
        return AttentionOutput(out, x.new_zeros(()), AttentionState(pos + t, inner, conv) if return_state else None)

    def state_floats(self, seq_len: int) -> int:
        """S (H × P × N) and the convolution's last ``short_conv − 1`` inputs of x̂, B and C."""
        return self.num_heads * self.head_dim * self.d_state + max(self.short_conv - 1, 0) * self.qkv.out_features


def _check_dt(dt_min, dt_max, dt_init_floor) -> None:
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"dt_min and dt_max must satisfy 0 < dt_min <= dt_max (Δ's initial range), got {dt_min!r} "
                         f"and {dt_max!r}")
    if not dt_init_floor >= 0:
        raise ValueError(f"dt_init_floor must be >= 0, got {dt_init_floor!r}")
