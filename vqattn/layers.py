"""Attention layers (nn.Modules) built on the functional ops, and a registry to pick them by name.

Every layer maps x: (B, T, C) -> (B, T, C) and is causal. It owns

* a fused q/k/v projection and an output projection,
* optional per-head RMS normalisation of q and k (``qk_norm``, as in Transformer-VQ),
* optional rotary position embedding (``rope``); learned absolute positions live in the model,
  so a layer with ``rope=False`` is position-free,
* ``aux_loss``: a scalar tensor set by every forward (the commitment loss for vq layers, 0 otherwise),
* ``usage_stats()``: codebook usage for vq layers, ``{}`` otherwise,
* a recurrent decoding path: ``forward(x, state, return_state=True)`` consumes a chunk of tokens that
  follows the tokens summarised by ``state`` and returns the state after the chunk. Feeding a sequence in
  chunks gives the same outputs as one call on the whole sequence.

Build a layer with ``build_attention(name, dim=..., num_heads=..., **kwargs)``; ``ATTENTIONS`` maps each
name to its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .codebook import Codebook
from .feature_maps import EluFeatures, FeatureMap, PerformerFeatures, TaylorFeatures
from .functional import kernel_attention, softmax_attention, vq_attention
from .ops.linear import linear_attention
from .ops._checks import check_positive_int


@dataclass
class AttentionState:
    """Decoding state of one layer after ``pos`` tokens: the op's own state plus the position counter.

    ``inner`` is a ``KVCache`` for softmax, the op's ``VQState`` for vq layers and its ``LinearState``
    for the kernel family.
    """

    pos: int
    inner: Any


class KVCache(NamedTuple):
    """Softmax decoding state: all past keys (already rotated when RoPE is on) and values, (B, H, P, D)."""

    k: torch.Tensor
    v: torch.Tensor


def rope_rotate(x: torch.Tensor, start: int, base: float) -> torch.Tensor:
    """Rotary position embedding of x: (B, H, T, D) at absolute positions start..start+T-1.

    Feature pairs (x_m, x_{m+D/2}) are rotated by the angle pos * base^(-2m/D), so that
    <rope(q, i), rope(k, j)> depends on i and j only through i - j. Angles are computed in float64
    and the rotation in at least float32, so fp64 decoding matches the full pass to rounding.
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / d)  # (D/2,)
    pos = torch.arange(start, start + x.shape[-2], dtype=torch.float64, device=x.device)  # (T,)
    angle = pos[:, None] * inv_freq[None, :]  # (T, D/2)
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Base class: projections, q/k normalisation, RoPE and the chunked-state protocol.

    Subclasses implement ``_attend(q, k, v, pos, state, return_state)`` on (B, H, T, Dh) tensors, where
    q and k are projected and normalised but not rotated (each variant decides where RoPE goes), ``pos``
    is the absolute position of the first token and ``state`` the op state (or None for a fresh start).
    """


    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        bias: bool = False,
        dropout: float = 0.0,
        qk_norm: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        layer_idx: int = 0,
    ):
        """layer_idx: position of the layer in its model; layers with random features derive their seed from it."""
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
        self.rope, self.rope_base, self.layer_idx = rope, rope_base, layer_idx
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        # Transformer-VQ RMS-normalises q and k per head; this bounds |q.k| and keeps codes comparable.
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.aux_loss = torch.zeros(())

    def rotate(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """RoPE at positions pos.. when this layer uses it, else x unchanged."""
        return rope_rotate(x, pos, self.rope_base) if self.rope else x

    def forward(self, x: torch.Tensor, state: AttentionState | None = None, return_state: bool = False):
        """x: (B, T, C) -> (B, T, C), or (out, AttentionState) when ``return_state``.

        ``state`` summarises the tokens before x (from a previous call with ``return_state=True``).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, T, {self.dim}), got {tuple(x.shape)}")
        if state is not None and not isinstance(state, AttentionState):
            raise ValueError(f"state must be an AttentionState or None, got {type(state).__name__}")
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = 0 if state is None else state.pos
        self.aux_loss = x.new_zeros(())
        out, inner = self._attend(q, k, v, pos, None if state is None else state.inner, return_state)  # (B, H, T, Dh)
        y = self.resid_dropout(self.proj(out.transpose(1, 2).reshape(b, t, c)))  # (B, T, C)
        return (y, AttentionState(pos + t, inner)) if return_state else y

    def _attend(self, q, k, v, pos: int, state, return_state: bool):
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
        return self._quadratic(q, k, v), (KVCache(k, v) if return_state else None)

    def _quadratic(self, q, k, v):
        raise NotImplementedError


class SoftmaxAttention(CachedAttention):
    """Exact causal softmax attention (SDPA)."""

    def _quadratic(self, q, k, v):
        past, t = k.shape[2] - q.shape[2], q.shape[2]
        if past == 0:
            return softmax_attention(q, k, v, causal=True)
        # Query i sits at position past + i and sees keys 0..past+i.
        rows = torch.arange(t, device=q.device)[:, None] + past
        mask = torch.arange(past + t, device=q.device)[None, :] <= rows  # (T, P+T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class KernelSmootherAttention(CachedAttention):
    """Kernel-smoother attention (Tsai et al. 2019) with an explicit kernel: ``kernel_attention``.

    The analysis baseline of the kernel family, quadratic in T: ``kernel_rbf`` (exp(−s‖q − k‖²/2)),
    ``kernel_poly`` ((s q·k)^degree, default degree 2) and ``kernel_linear`` (s q·k, signed, count-normalised).
    """

    kernel: ClassVar[str]

    def __init__(self, dim: int, num_heads: int, *, degree: int = 2, **attention_kwargs):
        super().__init__(dim, num_heads, **attention_kwargs)
        check_positive_int("degree", degree)
        self.degree = degree

    def _quadratic(self, q, k, v):
        return kernel_attention(q, k, v, kernel=self.kernel, causal=True, degree=self.degree)


class RBFSmootherAttention(KernelSmootherAttention):
    kernel = "rbf"


class PolySmootherAttention(KernelSmootherAttention):
    kernel = "poly"


class LinearSmootherAttention(KernelSmootherAttention):
    kernel = "linear"


class VQAttention(Attention):
    """Codebook attention (``vq_attention``) with a learned per-head :class:`~vqattn.codebook.Codebook`.

    The codebook module quantises the keys (EMA k-means or gradient learning), and its commitment loss is
    this layer's ``aux_loss``. Decoding keeps ``VQState``: per-code counts and value sums plus a raw window of
    under 2·block_len keys, i.e. constant memory per token.

    RoPE (``rope=True``) acts only inside the uncompressed window, which must hold the raw keys
    (``exact_window=True``): the codes stay position-free, so the compressed cache is the same whichever
    position a key came from. Rotating keys before quantisation would instead make the code of a key depend
    on its absolute position (the codebook would have to cover every rotation of every key), and rotating
    quantised keys per position cannot be summed per code. The layer implements window-only RoPE with the
    unchanged op by running it on augmented vectors (D' = 3D):

        q' = [R_i q, q, −q]    k' = [R_j k, k, k]    c' = [0, c, 0]

    so that the window logit q'·k' = (R_i q)·(R_j k) is RoPE attention, the cache logit q'·c' = q·c is the
    position-free code score, and ‖k' − c'‖² = ‖k − c‖² + 2‖k‖² gives the same hard and soft assignments.
    """

    assign: ClassVar[str]

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_codes: int = 64,
        block_len: int | None = 64,
        exact_window: bool = True,
        detach_cache: bool = False,
        codebook: dict | None = None,
        **attention_kwargs,
    ):
        """``codebook``: extra :class:`~vqattn.codebook.Codebook` kwargs (learning, decay, commitment, ...);
        ``attention_kwargs`` go to :class:`Attention`."""
        super().__init__(dim, num_heads, **attention_kwargs)
        if self.rope and not exact_window:
            raise ValueError(
                f"{type(self).__name__} with rope=True needs exact_window=True: RoPE is applied only inside the "
                "uncompressed window, which must then hold the raw keys (codes are position-free so that the "
                "compressed cache stays valid). Pass exact_window=True, or use learned or no positions."
            )
        if block_len is not None:
            check_positive_int("block_len", block_len)
        check_positive_int("num_codes", num_codes)
        self.block_len, self.exact_window, self.detach_cache = block_len, exact_window, detach_cache
        self.codebook = Codebook(num_heads, num_codes, self.head_dim, assign=self.assign, **(codebook or {}))

    def _attend(self, q, k, v, pos, state, return_state):
        codebook, self.aux_loss = self.codebook(k)  # (H, S, Dh), scalar; codes are learned on unrotated keys
        if self.rope:
            q = torch.cat((self.rotate(q, pos), q, -q), dim=-1)  # (B, H, T, 3 Dh)
            k = torch.cat((self.rotate(k, pos), k, k), dim=-1)
            zeros = torch.zeros_like(codebook)
            codebook = torch.cat((zeros, codebook, zeros), dim=-1)  # (H, S, 3 Dh)
        result = vq_attention(
            q, k, v, codebook,
            causal=True,
            assign=self.codebook.assign,
            temperature=self.codebook.temperature,
            block_len=self.block_len,
            scale=self.head_dim**-0.5,
            exact_window=self.exact_window,
            detach_cache=self.detach_cache,
            state=state,
            return_state=return_state,
        )
        return result if return_state else (result, None)

    def usage_stats(self) -> dict[str, float]:
        return self.codebook.usage_stats()


class VQHardAttention(VQAttention):
    """Transformer-VQ: keys snap to their nearest code (straight-through gradient in the window)."""

    assign = "hard"


class VQSoftAttention(VQAttention):
    """Gaussian-mixture codebook attention: keys spread over codes by their posterior p(s | k)."""

    assign = "soft"


class KernelAttention(Attention):
    """Linear attention φ(q)·φ(k) (``linear_attention``) with a feature map φ built by ``_make_features``.

    Decoding keeps ``LinearState``: Σ φ(k) vᵀ (M × Dv) and Σ φ(k) (M), constant memory per token.
    RoPE rotates q and k before φ. Every key's features are then fixed once computed, so the running sums
    stay valid; for Performer (E[φ(x)·φ(y)] = exp(s x·y), rotation-invariant ω) and Taylor (a polynomial in
    x·y) the kernel of rotated vectors depends on positions only through i − j, as in softmax RoPE.
    """

    def __init__(
        self, dim: int, num_heads: int, *, chunk_len: int | None = None, features: dict | None = None, **attention_kwargs
    ):
        """``features``: kwargs of the feature map; ``attention_kwargs`` go to :class:`Attention`."""
        super().__init__(dim, num_heads, **attention_kwargs)
        if chunk_len is not None:
            check_positive_int("chunk_len", chunk_len)
        self.chunk_len = chunk_len
        self.features = self._make_features(self.head_dim, self.layer_idx, **(features or {}))

    def _make_features(self, head_dim: int, layer_idx: int, **kwargs) -> FeatureMap:
        raise NotImplementedError

    def _attend(self, q, k, v, pos, state, return_state):
        q, k = self.rotate(q, pos), self.rotate(k, pos)
        phi_q, phi_k = self.features.map_qk(q, k)  # (B, H, T, M); one call = one step for Performer redraws
        result = linear_attention(
            phi_q,
            phi_k,
            v,
            causal=True,
            chunk_len=self.chunk_len,
            state=state,
            return_state=return_state,
        )
        return result if return_state else (result, None)


class PerformerAttention(KernelAttention):
    """FAVOR+ (Performer): positive random features estimating exp(q·k / √D).

    ``num_features`` defaults to 4·head_dim. The draw of layer ``layer_idx`` uses ``seed + layer_idx`` so
    layers differ and every DDP rank derives the same ω (see :class:`~vqattn.feature_maps.PerformerFeatures`).
    """

    def _make_features(self, head_dim, layer_idx, *, num_features=None, seed=0, **kwargs):
        return PerformerFeatures(head_dim, num_features or 4 * head_dim, seed=seed + layer_idx, **kwargs)


class EluLinearAttention(KernelAttention):
    """Linear transformer (Katharopoulos et al. 2020): φ(x) = elu(x) + 1."""

    def _make_features(self, head_dim, layer_idx, **kwargs):
        return EluFeatures(**kwargs)


class TaylorAttention(KernelAttention):
    """Second-order Taylor kernel 1 + s q·k + (s q·k)²/2 with s = 1/√D (M = 1 + D + D² features)."""

    def _make_features(self, head_dim, layer_idx, *, order=2, **kwargs):
        return TaylorFeatures(order, scale=head_dim**-0.5, **kwargs)


ATTENTIONS: dict[str, type[Attention]] = {
    "softmax": SoftmaxAttention,
    "vq_hard": VQHardAttention,
    "vq_soft": VQSoftAttention,
    "performer": PerformerAttention,
    "linear": EluLinearAttention,
    "taylor": TaylorAttention,
    "kernel_rbf": RBFSmootherAttention,
    "kernel_poly": PolySmootherAttention,
    "kernel_linear": LinearSmootherAttention,
}


def build_attention(name: str, **kwargs) -> Attention:
    """Instantiate the attention layer registered as ``name``; kwargs go to its constructor."""
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; valid names are: {', '.join(sorted(ATTENTIONS))}")
    return ATTENTIONS[name](**kwargs)
