"""The argument checks shared by the ops, the layers, the model and the codebook: bad input raises ``ValueError``
naming the argument and what it allows."""

from __future__ import annotations

import torch


def check_4d(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, T, D), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape (B, H, T, D), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_same_device_dtype(**tensors: torch.Tensor) -> None:
    """All tensors share one device and one dtype."""
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must share a device")
        if t.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; all inputs must share a dtype")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, same_dim: bool = True) -> None:
    """q, k: (B, H, Tq/Tk, D); v: (B, H, Tk, Dv). Causal attention needs Tq == Tk. ``same_dim=False``: the caller
    checks the feature dims of q and k itself (codebook attention may score codes on fewer dims than k has)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_4d(name, x)
    check_same_device_dtype(q=q, k=k, v=v)
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k and v must share batch and head dims (B, H), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if same_dim and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the feature dim D, got q D={q.shape[-1]} and k D={k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length T, got k T={k.shape[2]} and v T={v.shape[2]}")
    if k.shape[2] == 0:
        raise ValueError("k must have at least one position (T >= 1)")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs q and k of the same length, got q T={q.shape[2]} and k T={k.shape[2]}")


def check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def resolve_scale(scale, head_dim: int):
    """The σ a call multiplies q·k by: ``scale``, else head_dim**-0.5 (SDPA's default)."""
    return head_dim**-0.5 if scale is None else scale


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed and accumulated in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def size_min(a: int, b: int) -> int:
    """min of two sizes that may be symbolic under torch.compile, as a comparison that dynamo guards on: min() would
    give a ``Min`` expression that inductor can fail to resolve in later view sizes ("Failed to realize expression
    to int"), e.g. when a compiled model decodes prompts of a new length."""
    return a if a <= b else b


def size_max(a: int, b: int) -> int:
    """max of two sizes that may be symbolic, guarded like :func:`size_min`."""
    return a if a >= b else b
