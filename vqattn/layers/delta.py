"""DeltaNet and Gated DeltaNet as attention layers of this library: the recurrent baselines whose state is edited by
the delta rule (:func:`~vqattn.ops.delta_rule.delta_rule_attention`), modelled on flash-linear-attention's
``DeltaNet`` and ``GatedDeltaNet`` layers (Yang et al. 2024, 2025; Qwen3-Next's linear-attention layers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules.conv import ShortConvolution
from ..ops.blocks import check_block_len
from ..ops.delta_rule import IMPLS, delta_rule_attention
from ..ops.utils import check_choice, check_positive_int
from .base import Attention, AttentionOutput, AttentionState, op_result


class DeltaNetAttention(Attention):
    """DeltaNet's layer as flash-linear-attention builds it (``use_gate=True``), on the width ``dim`` of the model.

    From x (B, T, C): one projection ``qkv`` to q, k (``num_heads`` heads of ``head_dim`` Dk) and v (heads of
    Dv = ``expand_v``·Dk); a causal depthwise convolution over time of the three (``conv_size`` taps) and a SiLU; q and
    k L2-normalised per head (unit keys keep each update I − β k kᵀ a contraction); β = sigmoid(``b_proj``(x)) per
    head and token (2·sigmoid with ``allow_neg_eigval``); then the delta rule

        S_t = S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    o_t = S_t q_t / √Dk,

    an RMSNorm of each head's o_t (one weight of Dv shared by the heads), times SiLU(``g_proj``(x)) (the output gate;
    ``output_gate=False``: fla's DeltaNet default, the norm alone), and the output projection ``proj``.
    :class:`GatedDeltaNetAttention` adds the decay.

    The decoding state is S (H × Dv × Dk per layer, constant in the length) and the convolution's last
    ``conv_size − 1`` inputs. With the defaults (Dk = 64, Dv = 128, 4 taps) and the model's 4 heads: 4·128·64 +
    3·(2·256 + 512) = 35 840 numbers per layer, beside vq_hard's 41 216 at the default model (C = 128, 4 heads of 32,
    64 codes, block_len 64: 4·64·33 + 2·128·128). Its projections are wider than a softmax layer's (2·H·Dk + 2·H·Dv
    outputs and an H·Dv input instead of 3·C and C): at C = 128, 4.0× the parameters of softmax's q/k/v and output
    projections; ``head_dim`` and ``expand_v`` trade state and parameters.

    Differences from the base :class:`~vqattn.layers.base.Attention`:

    * ``short_conv`` > 0 (the model's ``short_conv``) sets the convolution's taps in place of ``conv_size``; 0 leaves
      the layer's own (``conv_size=0``: none, the SiLU stays). As the library's short convolution it starts as the
      identity (fla initialises it at random).
    * ``rope`` is accepted and leaves the layer unchanged: the delta rule has no position encoding (the convolution
      and the order of the updates carry position), as Qwen3-Next's linear layers beside its RoPE attention.
    * ``qk_norm`` is accepted and changes nothing: q and k are always unit vectors.
    """

    decay = False

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        head_dim: int = 64,
        expand_v: float = 2.0,
        conv_size: int = 4,
        block_len: int | None = None,
        output_gate: bool = True,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        impl: str = "auto",
        **attention_kwargs,
    ):
        """``head_dim``: Dk, the keys' dims per head; ``expand_v``: Dv / Dk; ``block_len``: the op's chunk (default
        64), which never changes the result; ``impl``: the op's (:func:`~vqattn.ops.delta_rule.delta_rule_attention`).
        Other kwargs go to :class:`~vqattn.layers.base.Attention` (see the class docstring for ``short_conv``,
        ``rope`` and ``qk_norm``)."""
        short_conv = attention_kwargs.pop("short_conv", 0)
        attention_kwargs.pop("qk_norm", None)
        attention_kwargs.pop("rope", None)
        attention_kwargs.pop("rope_base", None)
        super().__init__(dim, num_heads, short_conv=short_conv, **attention_kwargs)
        check_positive_int("head_dim", head_dim)
        head_v_dim = head_dim * expand_v
        if isinstance(expand_v, bool) or not isinstance(expand_v, (int, float)) or head_v_dim <= 0 or \
                head_v_dim != int(head_v_dim):
            raise ValueError(f"expand_v must be > 0 with head_dim * expand_v a whole number (Dv), got expand_v = "
                             f"{expand_v!r} and head_dim = {head_dim}")
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 0:
            raise ValueError(f"conv_size must be an int >= 0 (a kernel size; 0 = no convolution), got {conv_size!r}")
        check_block_len(block_len)
        check_choice("impl", impl, IMPLS)
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps!r}")
        bias = attention_kwargs.get("bias", False)
        self.rope = False  # see the class docstring
        self.block_len, self.impl, self.allow_neg_eigval, self.norm_eps = block_len, impl, allow_neg_eigval, norm_eps
        self.head_dim, self.head_v_dim = head_dim, int(head_v_dim)  # Dk, Dv
        self.key_dim, self.value_dim = num_heads * head_dim, num_heads * self.head_v_dim
        self.qkv = nn.Linear(dim, 2 * self.key_dim + self.value_dim, bias=bias)
        self.short_conv = short_conv or conv_size
        self.conv = ShortConvolution(self.qkv.out_features, self.short_conv) if self.short_conv else None
        self.b_proj = nn.Linear(dim, num_heads, bias=bias)
        self.g_proj = nn.Linear(dim, self.value_dim, bias=bias) if output_gate else None
        self.o_norm = nn.RMSNorm(self.head_v_dim, eps=norm_eps)
        self.proj = nn.Linear(self.value_dim, dim, bias=bias)

    def _log_decay(self, x: torch.Tensor, wide: torch.dtype) -> torch.Tensor | None:
        """(B, H, T) log decays g_t ≤ 0, or None (DeltaNet)."""
        return None

    def forward(self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False,
                cu_seqlens=None) -> AttentionOutput:
        """As :meth:`~vqattn.layers.base.Attention.forward`: x (B, T, C) -> AttentionOutput; the
        state holds the delta rule's S (the op's :class:`~vqattn.ops.delta_rule.DeltaRuleState`) and the
        convolution's last inputs."""
        per_sequence, cu_seqlens, positions = self._read_call(x, state, return_state, cu_seqlens)
        if per_sequence is not None:
            return per_sequence
        b, t, _ = x.shape
        H, Dk, Dv = self.num_heads, self.head_dim, self.head_v_dim
        h, conv = self.qkv(x), None  # (B, T, 2·H·Dk + H·Dv)
        if self.conv is not None:
            h, conv = self.conv(h, None if state is None else state.conv, positions)
        q, k, v = F.silu(h).split([H * Dk, H * Dk, H * Dv], dim=-1)
        wide = torch.promote_types(x.dtype, torch.float32)  # norms, β and the decay in float32 at least
        q, k = (F.normalize(z.view(b, t, H, Dk).transpose(1, 2).to(wide), dim=-1, eps=1e-6).to(v.dtype)
                for z in (q, k))  # (B, H, T, Dk)
        v = v.view(b, t, H, Dv).transpose(1, 2)
        beta = torch.sigmoid(self.b_proj(x).to(wide)).transpose(1, 2)  # (B, H, T)
        if self.allow_neg_eigval:  # β in (0, 2): eigenvalues of I − β k kᵀ in (−1, 1) (Grazzi et al. 2025)
            beta = 2 * beta
        result = delta_rule_attention(q, k, v, beta, self._log_decay(x, wide), block_len=self.block_len,
                                      state=None if state is None else state.inner, return_state=return_state,
                                      cu_seqlens=cu_seqlens, impl=self.impl)
        o, inner = op_result(result, return_state)
        o = F.rms_norm(o.transpose(1, 2).to(wide), (Dv,), self.o_norm.weight.to(wide), self.norm_eps)  # (B, T, H, Dv)
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x).to(wide)).view(b, t, H, Dv)
        out = self.resid_dropout(self.proj(o.reshape(b, t, H * Dv).to(x.dtype)))
        pos = 0 if state is None else state.pos
        return AttentionOutput(out, x.new_zeros(()), AttentionState(pos + t, inner, conv) if return_state else None)

    def state_floats(self, seq_len: int) -> int:
        """S (H × Dv × Dk) and the convolution's last ``short_conv − 1`` inputs of q, k and v."""
        return self.num_heads * self.head_v_dim * self.head_dim + max(self.short_conv - 1, 0) * self.qkv.out_features


class GatedDeltaNetAttention(DeltaNetAttention):
    """Gated DeltaNet's layer as flash-linear-attention builds it: :class:`DeltaNetAttention` with a decay of the state
    per head and token,

        S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    α_t = exp(g_t),  g_t = −exp(A_log) · softplus(a_t + dt_bias),

    with a_t = ``a_proj``(x) (one number per head) and Mamba-2's parametrisation of A·Δ: a learned rate
    A = exp(``A_log``) per head and a step Δ = softplus(a_t + ``dt_bias``), initialised as Mamba-2's (Δ log-uniform in
    [``dt_min``, ``dt_max``], floored at ``dt_init_floor``; A uniform in ``a_init_range``). The state and parameters
    are DeltaNet's plus 3·H numbers of parameters (``a_proj``'s H·C weights aside); see :class:`DeltaNetAttention`."""

    decay = True

    def __init__(self, dim: int, num_heads: int, *, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, a_init_range: Sequence[float] = (1.0, 16.0), **kwargs):
        """The decay's initialisation (see the class docstring); other kwargs go to :class:`DeltaNetAttention`."""
        super().__init__(dim, num_heads, **kwargs)
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"dt_min and dt_max must satisfy 0 < dt_min <= dt_max (Δ's initial range), got "
                             f"{dt_min!r} and {dt_max!r}")
        if not dt_init_floor >= 0:
            raise ValueError(f"dt_init_floor must be >= 0, got {dt_init_floor!r}")
        if (not isinstance(a_init_range, Sequence) or len(a_init_range) != 2
                or not 0 < a_init_range[0] <= a_init_range[1]):
            raise ValueError(f"a_init_range must be two numbers 0 < low <= high (A's initial range), got "
                             f"{a_init_range!r}")
        self.a_proj = nn.Linear(dim, num_heads, bias=False)
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(*a_init_range).log())

    def _log_decay(self, x: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
        step = F.softplus(self.a_proj(x).to(wide) + self.dt_bias.to(wide))  # (B, T, H): Δ > 0
        return (-torch.exp(self.A_log.to(wide)) * step).transpose(1, 2)  # −A·Δ < 0
