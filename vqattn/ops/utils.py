"""What every op shares on the host, as flash-linear-attention's ``fla/utils.py``: where the kernels can run, the
precision rule, the argument checks, how a causal op picks its impl, and the gradients' memory order. It imports no
kernel, so every op package may import it.

* **Devices.** Triton is optional: without it (or on a CPU) the ops run their PyTorch impls. ``TRITON_INTERPRET=1``
  runs the same kernels on CPU tensors under Triton's interpreter, slowly but exactly (:func:`triton_device`); and
  whether reading a tensor on the host is free (:func:`host_read_is_free`).
* **Precision.** The ops compute in float32 (float64 stays float64) whatever the ambient autocast says: their
  softmaxes over thousands of keys, exp features and per-code sums lose 2-3 digits in bf16, so half-precision inputs
  are computed in float32 (:func:`compute_dtype`) and autocast is switched off inside (:func:`autocast_off`),
  forward and custom backward alike.
* **Checks.** Bad input raises ``ValueError`` naming the argument and what it allows (the ops, the layers, the model
  and the codebook).
* **Impls.** How a causal op picks the impl that computes a call (flash-linear-attention's ``mode``): one rule for
  all (:func:`pick_impl`).
* **Memory order.** A layer's q, k and v are (B, H, T, D) views of one (B, T, 3, H, D) projection: token-major
  memory. Autograd stacks their gradients back into that layout. Gradients laid out (B, H, T, D)-contiguous make
  that stack a transposing copy (on an H200, 0.75 ms of the vq_hard layer's 18.6 ms step at 64k tokens); gradients
  in the views' own order make it a plain one, as flash attention's are. So the kernels write each gradient in its
  input's order (:func:`empty_like_order`).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple, TypeVar

import torch

try:
    import triton
except ImportError:  # the op library needs torch alone
    triton = None


# Devices: where the kernels can run.

# Read when the kernels are defined, as Triton itself reads it: set it before the first import of vqattn.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_device(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on x's device: CUDA with Triton installed, or the CPU under
    ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    return x.device.type == "cuda" or (INTERPRET and x.device.type == "cpu")


def require_triton(x: torch.Tensor) -> None:
    """ValueError naming what ``impl="triton"`` needs, unless the kernels can run on x's device."""
    if triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install triton)")
    if not triton_device(x):
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on a CPU), got a tensor on "
                         f"{x.device}")


def host_read_is_free(x: torch.Tensor) -> bool:
    """Whether reading x's value in Python costs nothing: on a CPU in eager mode. A GPU would synchronise, and a
    compiled graph cannot branch on a value."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


# Precision: the ops' one autocast rule.

def autocast_off(fn):
    """Run ``fn`` with autocast disabled on the device of its first tensor argument.

    Under ``torch.autocast`` the ops' matmuls would otherwise run in bf16/fp16 whatever the input dtype. The result
    keeps the dtype the op gives without autocast (the input's), which autocast's callers accept as is. Also used on
    the ``forward`` and ``backward`` of the ops' autograd Functions, so a backward called inside autocast stays in
    the forward's dtype.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:  # not a tensor: fn's own checks raise the ValueError
            return fn(*args, **kwargs)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


# Checks: bad input raises ValueError naming the argument.

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


# Records: copies of the ops' NamedTuple inputs.

Record = TypeVar("Record", bound=NamedTuple)


def replaced(record: Record, **changes) -> Record:
    """``record._replace(**changes)``, built by calling the record's class. ``_replace`` builds its copy with
    ``tuple.__new__``, which dynamo (torch 2.11) cannot rebuild when a graph break leaves the copy alive, as every
    launch of a Triton kernel does: compiling the layer then fails with an AssertionError in ``side_effects``."""
    return type(record)(**{**record._asdict(), **changes})


# Impls: how a causal op picks the impl of a call.

# Chunks of up to this many new tokens that continue a state run token by token; longer ones (prefill) run the
# block algorithm, whose per-call cost is re-running the state's window (< 2L tokens) once.
RECURRENT_MAX_LEN = 4

# ``impl``: the values every causal op takes (linear attention: all but triton)
IMPLS = ("auto", "chunk", "recurrent", "naive", "triton")


def decoding(q: torch.Tensor, state) -> bool:
    """Whether a call continues a ``state`` by at most ``RECURRENT_MAX_LEN`` tokens (q: (B, H, T, D)): a decoding
    step, which the recurrent impls (and the fused step, :mod:`vqattn.ops.triton.decode`) compute in
    O(window + codes) per token, flat in the length."""
    return state is not None and q.dim() == 4 and q.shape[2] <= RECURRENT_MAX_LEN


def needs_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def pick_impl(impl: str, q: torch.Tensor, *, state, fused_unsupported: Callable[[], str | None] | None) -> str:
    """``impl`` itself, or for "auto": for a decoding step (:func:`decoding`) triton when it is fusable (below) and
    grad mode is off (the fused step is forward only: generation), else recurrent; for other calls triton when
    fusable, else chunk. Fusable: CUDA tensors, Triton imports and the op's fused kernel supports the call
    (``fused_unsupported()`` gives no reason; None: the op has no fused kernel). On a CPU, under the interpreter
    too, "auto" never picks triton. An op given triton for a decoding step runs its fused step when no input needs a
    gradient (:func:`needs_grad`), else its Triton block kernels."""
    if impl != "auto":
        return impl
    fusable = fused_unsupported is not None and q.is_cuda and triton_device(q) and fused_unsupported() is None
    if decoding(q, state):
        return "triton" if fusable and not torch.is_grad_enabled() else "recurrent"
    return "triton" if fusable else "chunk"


def with_impl(op: Callable, impl: str) -> Callable:
    """``op`` with its ``impl`` fixed: the public ``chunk_*`` / ``recurrent_*`` functions, which take the
    op's own arguments (one signature family) and never pick another impl."""

    @functools.wraps(op)
    def fixed(*args, **kwargs):
        return op(*args, impl=impl, **kwargs)

    fixed.__name__ = fixed.__qualname__ = f"{impl}_{op.__name__}"
    fixed.__doc__ = f"``{op.__name__}(..., impl={impl!r})``: the {impl} impl, with :func:`{op.__name__}`'s arguments."
    return fixed


# Memory order: gradients in their inputs' layout.

def memory_order(x: torch.Tensor) -> tuple[int, ...]:
    """x's dims from the outermost in memory to the innermost (by stride; ties in logical order)."""
    return tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))


def empty_in_order(shape, order: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised dense tensor of ``shape`` whose memory runs in ``order`` (:func:`memory_order`'s form).
    Made by ``torch.empty``, so that tests which fill it with NaN see every element a kernel leaves unwritten."""
    physical = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
    return physical.permute(sorted(range(len(order)), key=order.__getitem__))


def empty_like_order(x: torch.Tensor, *, dtype: torch.dtype | None = None, leading: tuple[int, ...] = ()
                     ) -> torch.Tensor:
    """An uninitialised tensor of x's shape (after ``leading`` outer dims) in x's memory order: ``torch.empty_like``
    keeps a layout only for dense x, and a layer's q, k and v are not dense (each is a third of the projection)."""
    order = tuple(range(len(leading))) + tuple(len(leading) + d for d in memory_order(x))
    return empty_in_order((*leading, *x.shape), order, dtype=dtype or x.dtype, device=x.device)
