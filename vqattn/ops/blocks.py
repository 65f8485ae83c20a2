"""Block machinery shared by the block-causal ops (:func:`~vqattn.ops.vq.vq_attention`,
:func:`~vqattn.ops.window.window_attention`): padding to blocks, each block's window (itself and the block
before), groups of blocks run one after another, the schedule that runs them, and a decoding state's raw window.

Queries run in blocks of L. Block b sees, uncompressed, the window of blocks b−1 and b (causally masked):
query i sees the keys j ≤ i from ``window_start(i + 1, L)`` = (b − 1)·L on, between L and 2L − 1 of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .utils import check_choice, check_positive_int, size_max, size_min

# Measured in benchmarks/attention_speed.py (docs/performance.md): at S=512, D=64, T=8192 on CPU, 64 is as
# fast as 128 for hard and clearly faster for soft (whose exact in-block mixture costs L·S per query).
DEFAULT_BLOCK_LEN = 64


def resolve_block_len(block_len: int | None, state=None) -> int:
    """The block length a call runs: ``block_len``, else the ``state``'s it continues (any object with a
    ``block_len``), else :data:`DEFAULT_BLOCK_LEN`."""
    if block_len:
        return block_len
    return getattr(state, "block_len", None) or DEFAULT_BLOCK_LEN


def check_block_len(block_len: int | None) -> None:
    """ValueError unless ``block_len`` is None (the state's or the default, :func:`resolve_block_len`) or a positive
    int."""
    if block_len is not None:
        check_positive_int("block_len", block_len)

# Temporaries of at most this size per group of blocks (see :func:`block_groups`).
GROUP_BYTES = 8 * 2**20

CACHE_SCHEDULES = ("auto", "loop", "cumsum")


class Schedule(NamedTuple):
    """How the block algorithm runs; never what it computes (every schedule gives the same result to rounding).

    cache: how the blocks read the codes' running value sums. ``"loop"`` walks the blocks one after another
        with one running (S, Dv) cache per batch·head (cache-friendly on CPU); ``"cumsum"`` forms every block's
        cache at once with one cumulative sum (few kernel launches: GPUs, and graphs under torch.compile, which
        a loop would unroll). ``"auto"``: loop on CPU in eager mode, cumsum otherwise.
    group_blocks: blocks per group (see :func:`block_groups`); None picks them by :data:`GROUP_BYTES` on CPU and
        runs all blocks in one group on other devices.
    superblocks: the fused (Triton) impl's one design choice, for hard keys: their caches every K = ``superblocks``
        blocks, the keys in between read through their codes (:mod:`vqattn.ops.triton.superblock`; the default,
        the least memory); 0: every block's cache (:mod:`vqattn.ops.triton.block_caches`, the design soft keys and
        ovq always run), which on an H200 was 9% faster at 8192 tokens and held 1.9 GB more
        (docs/triton_kernels.md).
    """

    cache: str = "auto"
    group_blocks: int | None = None
    superblocks: int = 8


def as_schedule(schedule: str | Schedule) -> Schedule:
    """A ``schedule`` argument ("auto", "loop", "cumsum" or a :class:`Schedule`), validated."""
    if isinstance(schedule, str):
        schedule = Schedule(schedule)
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be one of {CACHE_SCHEDULES} or a Schedule, got {type(schedule).__name__}")
    check_choice("schedule.cache", schedule.cache, CACHE_SCHEDULES)
    if schedule.group_blocks is not None:
        check_positive_int("schedule.group_blocks", schedule.group_blocks)
    value = schedule.superblocks
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"schedule.superblocks must be an int ≥ 0 (0: every block's cache), got {value!r}")
    return schedule


def loops(schedule: Schedule, device: torch.device) -> bool:
    """Whether the code caches are read block by block (``"loop"``) rather than formed by one cumsum."""
    if schedule.cache == "auto":
        return device.type == "cpu" and not torch.compiler.is_compiling()
    return schedule.cache == "loop"


def blocks(x: torch.Tensor, L: int) -> torch.Tensor:
    """(B, H, nb·L, ...) -> (B, H, nb, L, ...)."""
    return x.view(*x.shape[:2], x.shape[2] // L, L, *x.shape[3:])


def pad_to_blocks(x: torch.Tensor, L: int, value=0) -> torch.Tensor:
    """Pad the time dim (dim 2) of x up to a multiple of L."""
    pad = -x.shape[2] % L
    return F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad), value=value) if pad else x


def block_bias(L: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(L, L) additive causal mask of a window that is the current block only."""
    return torch.full((L, L), float("-inf"), device=device, dtype=dtype).triu_(1)


def window_bias(num_blocks: int, L: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(nb, L, 2L) additive mask of the first nb blocks of a sequence: query i of block b sees window key jj iff
    jj ≤ i + L (causal); block 0 has no previous block. Later blocks share block 1's mask: ``bias[1:2]``."""
    i = torch.arange(L, device=device)[:, None]
    jj = torch.arange(2 * L, device=device)[None, :]
    bias = torch.zeros(num_blocks, L, 2 * L, device=device, dtype=dtype)
    bias.masked_fill_(jj > i + L, float("-inf"))
    bias[0, :, :L] = float("-inf")
    return bias


def group_window_bias(first: bool, num_blocks: int, L: int, device, dtype) -> torch.Tensor:
    """The window mask of a group of blocks: (n, L, 2L) for the sequence's first group, else (1, L, 2L)."""
    return window_bias(num_blocks, L, device, dtype) if first else window_bias(2, L, device, dtype)[1:]


def block_groups(num_blocks: int, bytes_per_block: int, device: torch.device,
                 group_blocks: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges [b0, b1) of blocks that the block algorithm runs one after another.

    glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MB as large blocks are
    freed) with fresh pages, which the kernel zero-fills on first touch: about 1.3 ms per MB on this project's CPU,
    more than the arithmetic of an (L, S) logit tile. Running the blocks in groups whose temporaries stay around
    :data:`GROUP_BYTES` keeps them under the threshold, so freed ones are reused, without a process-wide allocator
    setting (``vqattn.utils.tune_cpu_allocator``) that a user's script would not have; compiled CPU code allocates
    through the same malloc. On GPUs (a caching allocator) one group keeps the kernel count low. ``group_blocks``
    overrides the size (:class:`Schedule`).
    """
    if group_blocks is None:
        if device.type != "cpu":
            return [(0, num_blocks)]
        group_blocks = GROUP_BYTES // size_max(bytes_per_block, 1)
    size = size_max(1, size_min(num_blocks, group_blocks))
    return [(b0, size_min(b0 + size, num_blocks)) for b0 in range(0, num_blocks, size)]


def split_groups(x: torch.Tensor, groups: list[tuple[int, int]], L: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For every group [b0, b1) of blocks: (x's blocks b0..b1−1, (B, H, (b1−b0)·L, ...); the block before b0,
    (B, H, L, ...), zeros for b0 = 0). x: (B, H, nb·L, ...).

    One split of x, so the backward pass assembles x's gradient with one cat; slicing each group out of x instead
    would zero-fill a gradient of x's full size for every group.
    """
    pieces = x.split([(b1 - b0) * L for b0, b1 in groups], dim=2)
    before = [x.new_zeros(*x.shape[:2], L, *x.shape[3:])] + [piece[:, :, -L:] for piece in pieces[:-1]]
    return list(zip(pieces, before))


class _GroupWindows(torch.autograd.Function):
    """scale · [previous block, block] of every block of a group. Written into one tensor: two cats would copy the
    previous blocks twice, and their backward zero-fills two group-sized gradients (a slice's backward) before
    adding them; here the backward is one scaled copy and one shifted add."""

    @staticmethod
    def forward(ctx, piece, before, L: int, scale: float):
        ctx.L, ctx.scale = L, scale
        current = blocks(piece, L)  # (B, H, n, L, ...)
        windows = piece.new_empty(*current.shape[:3], 2 * L, *current.shape[4:])
        windows[:, :, :, L:] = current
        windows[:, :, 1:, :L] = current[:, :, :-1]
        windows[:, :, 0, :L] = before
        return windows if scale == 1 else windows.mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        L, scale = ctx.L, ctx.scale
        grad_piece = grad[:, :, :, L:] * scale
        grad_piece[:, :, :-1].add_(grad[:, :, 1:, :L], alpha=scale)
        return grad_piece.flatten(2, 3), grad[:, :, 0, :L] * scale, None, None


def group_windows(piece: torch.Tensor, before: torch.Tensor, L: int, scale: float = 1.0) -> torch.Tensor:
    """Windows (previous block + current block) of a group's blocks, from :func:`split_groups`, times ``scale`` (the
    keys carry the logits' scale, so no query-sized product is formed): (B, H, n, 2L, ...)."""
    return _GroupWindows.apply(piece, before, L, scale)


class _CatHeadsInner(torch.autograd.Function):
    """torch.cat(pieces, 2) of (B, H, t_i, Dv) pieces into memory laid out as (B, T, H, Dv); the backward pass
    hands every piece its slice of the gradient (views, no copy)."""

    @staticmethod
    def forward(ctx, *pieces):
        B, H, _, Dv = pieces[0].shape
        ctx.sizes = [p.shape[2] for p in pieces]
        out = pieces[0].new_empty(B, sum(ctx.sizes), H, Dv).transpose(1, 2)  # (B, H, T, Dv) view
        return torch.cat(pieces, 2, out=out)

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.sizes, 2)


def cat_groups(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The groups' outputs (B, H, t_i, Dv) along time, as (B, H, T, Dv) laid out in memory as (B, T, H, Dv): a
    layer's merge of the heads, out.transpose(1, 2).reshape(B, T, H·Dv), is then a view instead of another copy of
    the output (at T = 32768, 32 MB of fresh memory). Compiled graphs choose their own layouts: a plain cat."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, 2) if torch.compiler.is_compiling() else _CatHeadsInner.apply(*pieces)


def time_range(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """x[:, :, start:stop], or x itself when that is all of it: the backward pass of a slice zero-fills a gradient
    of x's full size and copies into it, even for a slice that keeps everything."""
    return x if (start, stop) == (0, x.shape[2]) else x[:, :, start:stop]


def window_start(length: int, block_len: int) -> int:
    """First position still uncompressed for the next query at ``length`` (start of its previous block)."""
    return max(0, (length // block_len - 1) * block_len)


def window_tail(x: torch.Tensor | None, start: int) -> torch.Tensor | None:
    """x[:, :, start:] as a tensor of its own, for a decoding state's raw window (None stays None). A view's strides
    would depend on the tensor it was sliced from, and a compiled decoding step recompiles for every new layout."""
    return None if x is None else x[:, :, start:].contiguous()


def prepend_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """Re-run a state's raw window: its keys (B, H, W, D) and values go in front of the new k and v, and W zero
    queries in front of q, whose outputs the caller drops. The window starts at a block boundary, so the new
    tokens' blocks line up with the blocks of one call over the whole sequence."""
    prefix = q.new_zeros(*q.shape[:2], keys.shape[2], q.shape[-1])
    return torch.cat([prefix, q], 2), torch.cat([keys, k], 2), torch.cat([values, v], 2)


def attend_one(window_logits, window_values, code_logits=None, means=None) -> torch.Tensor:
    """One query's softmax over its window keys (B, H, 1, W) and, if given, the codes (B, H, 1, S): the
    recurrent (decoding) impl of a block's attention."""
    if code_logits is None:
        return torch.softmax(window_logits, -1) @ window_values
    probs = torch.softmax(torch.cat([window_logits, code_logits], -1), -1)
    W = window_logits.shape[-1]
    return probs[..., :W] @ window_values + probs[..., W:] @ means
