"""A FLOP and byte floor of every GPU kernel of one forward+backward step of the vq_hard op, as
``attention_speed.py``'s ``vq_hard_rope`` runs it (codebook (H, S, Dc), ``exact_window=True``, q_rot and k_rot given
as inputs, bf16), for the designs of the GPU plan and for fla's ``chunk_simple_gla`` at the same shape; of the
vq_soft op (``vq_soft_rope``) as it runs and two candidates; and of the ovq op.

A kernel's floor is max(FLOPs / peak, bytes / bandwidth) on a GPU of :data:`GPUS`; a step's floor is the sum over its
kernels. FLOPs are tensor-core products, 2·m·n·k each, of the tiles the kernel multiplies: whole (L, L) window
tiles, as the kernels form them before masking (fla's counts the same way); a TF32 product counts
:data:`TF32_COST` times, at the bf16 peak. Bytes are what a kernel must move through HBM at least: each input
read once and each output written once, however often its programs reread it from L2.

The designs (:data:`DESIGNS`):

* ``block_dc`` (the kernels' for soft keys, and for hard ones with ``Schedule(superblocks=0)``): every
  block's cache, (S, Dv) bf16 sums and (S,) float32 counts (1056 bytes per token and head at S = 512, L = 64),
  written by the prefix walk, read by the forward and by the backward's code part; that part writes every block's
  cache gradient dC (S, Dv), which the reverse walk reads.
* ``walk_dc`` (a design the kernels no longer run: slower than block_dc on an H200): as block_dc, but the reverse
  walk forms each block's dC_b = exp2(σ qc·c − lse)ᵀ dO itself, from qc, dO and the logsumexp: two products per
  block more in the walk, one less in the code part, no dC in memory; the walk adds the values' gradient to the
  window's in place.
* ``walk_dc_split``: walk_dc with both walks split into segments of
  ``SEGMENT_STEPS`` steps (fla's chunk_h_split): the segments' sums (float32 states; the backward's formed from the
  queries, its dC products twice), two scans, every segment's walk from its own start.
* ``superblock`` (:data:`CURRENT`, the kernels' default for hard keys: ``Schedule.superblocks = 8``, the
  K here), as built (``vqattn/ops/triton/superblock.py``): a cache only every K blocks (K·L tokens),
  nsb = ⌊max(nb − 2, 0)/K⌋ + 1 per sequence, half sums and float32 counts (:func:`caches`); a query attends to
  the keys between its superblock's cache and its window (blocks c..b−2) through their codes, logit σ q·c_{z_j},
  value v_j. No walk: ``_superblock_sums_kernel`` forms each superblock's own sums Δᵀ V and
  ``exclusive_scan_kernel`` scans them into the caches; ``_superblock_forward_kernel`` reads window, gathered keys
  and cache in one pass. Backward: ``_superblock_code_backward_kernel`` forms dqc from the S codes and the
  gathered keys; ``_superblock_cache_grad_kernel`` each cache's gradient Σ wᵀ·dO over the query blocks that read
  it (every block once), from qc, dO and the logsumexp; ``exclusive_scan_kernel`` again, their suffix sums;
  ``_superblock_key_backward_kernel``, key-major, a gathered key's pᵀ·dO plus row z_j of its suffix sum, added
  to the window's dv in place. The two scans are one row (2 launches).
* ``superblock_walk``: the plan's superblock: caches every K blocks written by the prefix walk, the keys gathered
  as above in the forward and the code part of the backward, and walk_dc's reverse walk, whose running sum of the
  blocks' dC_b is also the gradient of the hard keys' values, so the key side costs nothing more.
* ``fla``: fla's ``chunk_simple_gla`` (a D×Dv state per chunk of L): chunk_fwd_h (bf16 states) and chunk_fwd_o
  forward; chunk_fwd_h again (float32 states), chunk_bwd_dh (float32), chunk_bwd_dqkwg and chunk_bwd_dv backward.

The soft mixture's designs (:data:`SOFT_DESIGNS`; vq_soft_rope's step, the codebook learned by gradient):

* ``soft_block_dc`` (what formed weights run: an Assignment handed to the op, a state continued):
  ``_soft_assign_kernel`` writes the (T, S) float32 weights, which the prefix walk, the reverse walk (writing their
  gradient as well) and the assignment's two backward kernels
  (``_soft_key_grad_kernel``, ``_soft_code_grad_kernel``) read; the code backward writes every block's dC and count
  gradient and adds the codebook's share atomically.
* ``soft_block_sums`` (:data:`SOFT_CURRENT`, what soft keys run, ``vqattn/ops/triton/soft.py``): one float
  per key, the logsumexp (``_soft_assign_kernel``'s LOGSUMEXP output); ``_soft_block_sums_kernel`` recomputes each
  block's weights for its increments, written into the caches and scanned there (``exclusive_scan_kernel``); the
  window-code kernels as block_dc's; backward, the code backward's every block's cache gradient, reverse-scanned in
  place, then ``_soft_block_grads_kernel`` (key-major: dv, r, dk, dτ, the weights formed twice) and
  ``_soft_code_grads_kernel`` (code-major: dc). No (T, S) tensor.
* ``soft_block_recompute`` (a candidate): one float per key, the mixture's logsumexp (``_soft_lse_kernel``); both
  walks recompute a block's weights from k, the codes and it; the reverse walk turns the weights' gradient into the
  keys' and the codes' at once. No (T, S) tensor in memory.
* ``soft_superblock`` (a candidate): caches every K blocks (each superblock's sums, weights recomputed, and a scan);
  a query block reads the key blocks between its cache and its window through the mixture, A = exp(σ qc·cᵀ)·P_jᵀ,
  recomputing P_j for every such pair (and, key-major in the backward, the reading block's exp(σ qc·cᵀ)).

``ovq``: ovq_attention's Triton impl at S slots, the online assignment (``_online_slots_kernel``), vq's cache walk
and its reverse over the memory keys and values side by side (every block's slot counts and sums), and the window-code
kernels reading every block's float32 slot means (the sums divided by PyTorch, not counted), counts and value sums.

Not counted: the PyTorch glue between the kernels (the masked copies of k and k_rot and the poison of
``ops.nonfinite``, the codebook's TF32 split and half norms; block_dc's sum of the window's and the walk's value
gradients; the superblock's copies of the initial state), the zero count gradients block_dc's reverse walk
reads (hard counts take no gradient), and the superblock's launch for a state kept after ``fold`` blocks (fold = 0
here).

Against the plan's table (B·H·T = 2²⁰; every count here is per token, so 8k and 32k agree but for the superblocks'
gathered keys and caches and the segments):

* block_dc: 962 GFLOP as the plan (the nearest code's two TF32 products at half rate: 275 GFLOP, its 0.28 ms floor);
  8.55 GB against 8.74 (the plan does not itemise its bytes; 0.2 GB is one and a half (B, H, T, 64) passes).
  Its floor, 2.79 ms on an H100 and 2.03 on an H200, is the plan's (2.80, 2.04).
* walk_dc: 1031 GFLOP against 876, 6.8 GB against 6.59 (H100): here the walk does the two products that form dC_b
  (+137 GFLOP) and reads qc, dO and the counts, and reads the window's dv to add to it; the plan's total leaves
  these out (its FLOPs are below block_dc's, though the walk's products outnumber the one the code part drops).
* superblock (K = 8): 1169 GFLOP, 5.14 GB, 1.87 ms on an H100 and 1.59 on an H200 at 8k (1172, 5.11, 1.86,
  1.59 at 32k), against the plan's 1087, 4.08, 1.48 and 1.30. Its FLOPs are superblock_walk's but for the cache
  gradient's two products a block (in place of the reverse walk's three) and the key-major kernel's gathered tiles
  (59 GFLOP); its bytes hold nine passes over the nsb caches or their gradients (the sums written, both scans
  reading and rewriting, the forward, the code backward and the key backward reading, the gradients written):
  1.3 GB at 8k. K = 4 gives 1051 GFLOP, 6.38 GB, 2.14 and 1.67 ms; K = 16 1406 GFLOP, 4.51 GB, 1.91 and 1.69 ms
  (8k; 32k within 0.01 ms): K = 8 is the best of the three on both GPUs.
* superblock_walk (K = 8): 1179 GFLOP against 1087, 4.09 GB against 4.08, 1.57 and 1.40 ms against 1.48 and
  1.30: the walk's products as in walk_dc, and the gathered keys counted exactly (Σ_b (b−1) mod K blocks per
  sequence, 3.45 per query block at 8k); the bytes, again, are not itemised there. K = 4 and 16 give 1.60 and
  1.71 ms (H100, 8k and 32k): K = 8 is the best of the three.
* fla: as the plan, 120 GFLOP and 4.29 GB (1.28 ms H100, 0.89 ms H200).

    python benchmarks/kernel_floor.py                          # every design, 8k and 32k, 64k tokens a step
    python benchmarks/kernel_floor.py --designs superblock superblock_walk block_dc --superblock-blocks 4 8 16
    python benchmarks/kernel_floor.py --designs soft_block_dc soft_block_recompute soft_superblock ovq
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (byte/s), SXM parts.
GPUS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}
# A TF32 product runs at half the bf16 rate on both (494.7 TFLOP/s dense): it costs two bf16 products' time.
TF32_COST = 2
F32 = 4
INDEX_BYTES = 8  # the codes are int64
DESIGNS = ("block_dc", "walk_dc", "walk_dc_split", "superblock", "superblock_walk", "fla", "soft_block_dc",
           "soft_block_sums", "soft_block_recompute", "soft_superblock", "ovq")
# The soft mixture's designs (vq_soft_rope: the codebook learned by gradient, τ fixed): the weights in memory (what
# formed assignments run), the weights recomputed with per-block caches (what soft keys run: soft_block_sums), and
# two candidates (module doc).
SOFT_DESIGNS = ("soft_block_dc", "soft_block_sums", "soft_block_recompute", "soft_superblock")
SOFT_CURRENT = "soft_block_sums"
# What vqattn's kernels do by default for hard keys: the superblock kernels (Schedule.superblocks = 8);
# block_dc with superblock_blocks = 0.
CURRENT = "superblock"
SEGMENT_STEPS = 16  # the steps of a split cache walk's segment (walk_dc_split, a design the kernels no longer run)


@dataclass(frozen=True)
class Shape:
    """The op's shape: B·H sequences of T tokens, window dims D, value dims Dv, code dims Dc, S codes, blocks of L
    tokens, half-precision elements of ``half_bytes``."""

    B: int
    H: int
    T: int
    D: int = 64
    Dv: int = 64
    S: int = 512
    L: int = 64
    Dc: int = 64
    half_bytes: int = 2

    @property
    def nb(self) -> int:
        """Blocks per sequence, ⌈T/L⌉."""
        return -(-self.T // self.L)

    @property
    def seqs(self) -> int:
        return self.B * self.H


@dataclass(frozen=True)
class KernelCost:
    """One kernel's tensor-core FLOPs and HBM bytes in a step."""

    name: str
    what: str
    flop: float
    bytes: float

    def floor_s(self, gpu: str) -> float:
        """max(flop / peak, bytes / bandwidth) on ``gpu`` (a key of :data:`GPUS`), in seconds."""
        peak, bandwidth = GPUS[gpu]
        return max(self.flop / peak, self.bytes / bandwidth)


def gpu_of(device_name: str) -> str | None:
    """The :data:`GPUS` key of a ``torch.cuda.get_device_name()``, or None."""
    return next((gpu for gpu in GPUS if gpu in device_name.upper()), None)


# Bytes: every helper gives the bytes of all B·H sequences.

def half(s: Shape, *widths: int) -> int:
    """(B, H, T, w) half tensors, one per width w."""
    return s.seqs * s.T * sum(widths) * s.half_bytes


def per_token(s: Shape, n: int = 1, nbytes: int = F32) -> int:
    """n (B, H, T) tensors of ``nbytes`` elements: logsumexps, Δ, codes."""
    return n * s.seqs * s.T * nbytes


def caches(s: Shape, n: int) -> int:
    """n caches per sequence: (S, Dv) half sums and (S,) float32 counts."""
    return n * s.seqs * s.S * (s.Dv * s.half_bytes + F32)


def cache_grads(s: Shape, n: int) -> int:
    """n cache gradients dC (S, Dv) per sequence, in half (hard counts take none)."""
    return n * s.seqs * s.S * s.Dv * s.half_bytes


def state(s: Shape) -> int:
    """One float32 state per sequence, counts (S,) and sums (S, Dv): the cache before the first block, or after
    ``fold`` blocks, or either's gradient."""
    return s.seqs * s.S * (s.Dv + 1) * F32


def codebook(s: Shape) -> int:
    """The (H, S, Dc) float32 codebook the op passes to the kernels."""
    return s.H * s.S * s.Dc * F32


# FLOPs

def block_products(s: Shape, keys: int, *widths: int) -> int:
    """Every query block's products with ``keys`` rows (codes, keys, or a tile's inner dim), one per width:
    2·L·keys·w a block, B·H·nb blocks."""
    return s.seqs * s.nb * 2 * s.L * keys * sum(widths)


def gathered_blocks(nb: int, K: int) -> int:
    """Key blocks a sequence's queries read through their codes under superblock caches: query block b reads its
    superblock's cache (the blocks before c = K·⌊(b−1)/K⌋) and blocks c..b−2, (b−1) mod K of them."""
    return sum((b - 1) % K for b in range(1, nb))


def gathered_products(s: Shape, K: int, *widths: int) -> int:
    """The (L, L) tiles of the gathered key blocks, one product per width: 2·L·L·w each."""
    return s.seqs * gathered_blocks(s.nb, K) * 2 * s.L * s.L * sum(widths)


# The vq kernels, in launch order. ``n`` is the caches per sequence, ``K`` the superblock's blocks (None: no keys
# gathered), ``dc`` whether the code part writes every block's cache gradient, ``ib`` the bytes of a code index.

def nonfinite_rows(s: Shape) -> KernelCost:
    """Two launches, on k (Dc) and k_rot (D): read, one bool per row written."""
    return KernelCost("_nonfinite_rows_kernel", "k and k_rot: rows with NaN or inf (2 launches)", 0,
                      half(s, s.Dc, s.D) + per_token(s, 2, 1))


def nearest(s: Shape, ib: int) -> KernelCost:
    """k·cᵀ (T, S, Dc) as two TF32 products (the codebook's leading and trailing parts); reads k, both parts and
    the half norms, writes the codes."""
    parts = 2 * codebook(s) + s.H * s.S * F32
    return KernelCost("_nearest_kernel", "each key's nearest code", TF32_COST * 2 * block_products(s, s.S, s.Dc),
                      half(s, s.Dc) + parts + per_token(s, 1, ib))


def prefix(s: Shape, n: int, ib: int) -> KernelCost:
    """Δᵀ V (S, L, Dv) per block; reads the codes, v and the initial state, writes n caches and the folded state."""
    return KernelCost("_prefix_kernel", f"walk: {n} caches per sequence written", block_products(s, s.S, s.Dv),
                      per_token(s, 1, ib) + half(s, s.Dv) + 2 * state(s) + caches(s, n))


def forward(s: Shape, n: int, K: int | None, ib: int) -> KernelCost:
    """The window, two (L, L) tiles: qw·kwᵀ (D) and p·v (Dv); the S codes: qc·cᵀ (Dc) and p·C (Dv); gathered keys:
    qc·c_zᵀ (Dc) and p·v (Dv). Reads qw, kw, v, qc, the codebook, n caches (and the codes of gathered keys),
    writes out and the logsumexp."""
    flop = block_products(s, 2 * s.L, s.D, s.Dv) + block_products(s, s.S, s.Dc, s.Dv)
    gathered = per_token(s, 1, ib) if K else 0
    if K:
        flop += gathered_products(s, K, s.Dc, s.Dv)
    return KernelCost("_window_code_forward_kernel", "window and codes, online softmax", flop,
                      half(s, s.D, s.D, s.Dv, s.Dc) + codebook(s) + caches(s, n) + gathered + half(s, s.Dv)
                      + per_token(s))


def output_delta(s: Shape) -> KernelCost:
    """Δ_i = dO_i·out_i: reads out and dO, writes Δ."""
    return KernelCost("_output_delta_kernel", "Δ = dO·out", 0, half(s, s.Dv, s.Dv) + per_token(s))


def window_backward(s: Shape) -> KernelCost:
    """Three (L, L) tiles per block: (b, b−1) s, dp, dq; (b, b) s, dp, dq, dk, dv; (b+1, b) recomputed: s, dp, dk,
    dv. Seven products over D, five over Dv. Reads qw, kw, v, dO, lse, Δ; writes dqw, dkw, dv."""
    flop = block_products(s, s.L, *[s.D] * 7, *[s.Dv] * 5)
    return KernelCost("_window_backward_kernel", "window: dq, dk, dv", flop,
                      half(s, s.D, s.D, s.Dv, s.Dv) + per_token(s, 2) + half(s, s.D, s.D, s.Dv))


def code_backward(s: Shape, n: int, K: int | None, dc: bool, ib: int) -> KernelCost:
    """Over the S codes: qc·cᵀ (Dc), dO·Cᵀ (Dv), ds·c (Dc) and, with ``dc``, dC = wᵀ·dO (Dv, written per block);
    over gathered keys: qc·c_zᵀ (Dc), dO·vᵀ (Dv), ds·c_z (Dc), reading v and the codes. Reads qc, dO, lse, Δ, the
    codebook and n caches, writes dqc."""
    flop = block_products(s, s.S, s.Dc, s.Dv, s.Dc, *([s.Dv] if dc else []))
    gathered = per_token(s, 1, ib) + half(s, s.Dv) if K else 0
    if K:
        flop += gathered_products(s, K, s.Dc, s.Dv, s.Dc)
    return KernelCost("_code_backward_kernel", "codes: dqc" + (", every block's dC" if dc else ""), flop,
                      half(s, s.Dc, s.Dv) + per_token(s, 2) + codebook(s) + caches(s, n) + gathered
                      + half(s, s.Dc) + (cache_grads(s, s.nb) if dc else 0))


def walk_dc_reads(s: Shape) -> int:
    """What forming every block's dC_b in a walk reads: qc, dO, lse, the codebook, and every block's counts (an
    empty code takes no gradient)."""
    return half(s, s.Dc, s.Dv) + per_token(s) + codebook(s) + s.seqs * s.nb * s.S * F32


def prefix_backward(s: Shape, dc: bool, ib: int, nseg: int) -> KernelCost:
    """The reverse walk, Δ·G (L, S, Dv) per block. With ``dc`` it reads every block's dC; else it forms dC_b from
    qc·cᵀ (Dc) and wᵀ·dO (Dv) (:func:`walk_dc_reads`) and adds the values' gradient to the window's (read and
    written in place). Reads the codes, the state's gradient and, split into ``nseg`` segments, each segment's
    running sum; writes the values' gradient and the initial state's."""
    if dc:
        flop, reads, what = block_products(s, s.S, s.Dv), cache_grads(s, s.nb), "reverse walk: dv from dC"
    else:
        flop = block_products(s, s.S, s.Dv, s.Dc, s.Dv)
        reads, what = walk_dc_reads(s) + half(s, s.Dv), "reverse walk: dC from qc, dO; dv added to the window's"
    totals = state(s) * nseg if nseg > 1 else 0
    return KernelCost("_prefix_backward_kernel", what, flop, per_token(s, 1, ib) + reads + 2 * state(s) + totals
                      + half(s, s.Dv))


def segments(steps: int, seg: int) -> int:
    """Segments of a walk of ``steps`` split into ``seg`` steps each (1: not split)."""
    return -(-steps // seg) if 0 < seg < steps else 1


def split_kernels(s: Shape, seg: int, ib: int) -> list[KernelCost]:
    """The split walks' extra kernels: each segment's sums (forward: Δᵀ V of its blocks; backward: its blocks'
    dC, formed from the queries), written as float32 states, and the two scans that read and rewrite them."""
    forward_segs, backward_segs = segments(s.nb + 1, seg), segments(s.nb, seg)
    return [
        KernelCost("_prefix_segment_kernel", f"walk: {forward_segs} segments' sums", block_products(s, s.S, s.Dv),
                   per_token(s, 1, ib) + half(s, s.Dv) + forward_segs * state(s)),
        KernelCost("exclusive_scan_kernel", "both walks: the segments' running sums (2 launches)", 0,
                   2 * (forward_segs + backward_segs) * state(s) + state(s)),
        KernelCost("_reverse_segment_kernel", f"reverse walk: {backward_segs} segments' dC sums",
                   block_products(s, s.S, s.Dc, s.Dv), walk_dc_reads(s) + backward_segs * state(s)),
    ]


def vq_kernels(s: Shape, n: int, K: int | None, dc: bool, ib: int, seg: int = 0) -> list[KernelCost]:
    """``seg``: the walks split into segments of that many steps (0: one walk per tile and sequence)."""
    forward_segs, backward_segs = segments(s.nb + 1, seg), segments(s.nb, seg)
    walk = prefix(s, n, ib)
    if forward_segs > 1:  # every segment reads its first cache
        walk = KernelCost(walk.name, walk.what, walk.flop, walk.bytes + forward_segs * state(s))
    split = split_kernels(s, seg, ib) if forward_segs > 1 or backward_segs > 1 else []
    return [nonfinite_rows(s), nearest(s, ib), *split[:2], walk, forward(s, n, K, ib), output_delta(s),
            window_backward(s), code_backward(s, n, K, dc, ib), *split[2:],
            prefix_backward(s, dc, ib, backward_segs)]


def superblocks(s: Shape, K: int) -> int:
    """The caches a sequence reads under superblocks of K blocks: query block b reads cache ⌊max(b−1, 0)/K⌋."""
    return max(s.nb - 2, 0) // K + 1


def superblock_kernels(s: Shape, K: int, ib: int) -> list[KernelCost]:
    """The superblock kernels (vqattn/ops/triton/superblock.py) in launch order: nsb caches (half sums, float32
    counts: :func:`caches`), formed as each superblock's own sums and scanned; the forward reads the window, the
    gathered keys through their codes and its superblock's cache; the backward's code part forms dqc, the cache
    gradient kernel each cache's gradient from the queries that read it (half sums and float32 counts, scanned in
    reverse), and the key-major kernel the gathered keys' and the caches' share of dv, added to the window's in
    place. No codebook gradient."""
    nsb = superblocks(s, K)
    stored = caches(s, nsb)  # the caches, or their gradients
    codes = per_token(s, 1, ib)
    return [
        nonfinite_rows(s), nearest(s, ib),
        KernelCost("_superblock_sums_kernel", f"{nsb} superblocks' sums", block_products(s, s.S, s.Dv),
                   codes + half(s, s.Dv) + stored),
        # forward: the initial state read, the sums read and rewritten; backward: the same, the float32 total written
        KernelCost("exclusive_scan_kernel", "both scans: the caches and their gradients' suffix sums (2 launches)", 0,
                   state(s) + 2 * stored + 2 * stored + state(s)),
        KernelCost("_superblock_forward_kernel", "window, gathered keys and the cache's codes, online softmax",
                   block_products(s, 2 * s.L, s.D, s.Dv) + block_products(s, s.S, s.Dc, s.Dv)
                   + gathered_products(s, K, s.Dc, s.Dv),
                   half(s, s.D, s.D, s.Dv, s.Dc) + codebook(s) + stored + codes + half(s, s.Dv) + per_token(s)),
        output_delta(s),
        window_backward(s),
        KernelCost("_superblock_code_backward_kernel", "codes and gathered keys: dqc",
                   block_products(s, s.S, s.Dc, s.Dv, s.Dc) + gathered_products(s, K, s.Dc, s.Dv, s.Dc),
                   half(s, s.Dc, s.Dv) + per_token(s, 2) + codebook(s) + stored + codes + half(s, s.Dv)
                   + half(s, s.Dc)),
        KernelCost("_superblock_cache_grad_kernel", f"{nsb} caches' gradients from qc, dO",
                   block_products(s, s.S, s.Dc, s.Dv),
                   half(s, s.Dc, s.Dv) + per_token(s) + codebook(s) + codes + nsb * s.seqs * s.S * F32 + stored),
        KernelCost("_superblock_key_backward_kernel", "gathered keys and caches: dv added to the window's",
                   gathered_products(s, K, s.Dc, s.Dv),
                   codes + half(s, s.Dc, s.Dv) + per_token(s) + codebook(s) + cache_grads(s, nsb) + 2 * half(s, s.Dv)),
    ]


def weights(s: Shape) -> int:
    """A (B, H, T, S) float32 tensor: the soft mixture's weights, or their gradient."""
    return s.seqs * s.T * s.S * F32


def mixture_products(s: Shape, passes: int = 1, parts: int = 2) -> int:
    """k·cᵀ (T, S, Dc) ``passes`` times, each as ``parts`` TF32 products (half keys are exact in TF32: only the
    float32 codes split; float32 operands on both sides take three), at TF32's cost."""
    return passes * parts * TF32_COST * block_products(s, s.S, s.Dc)


def codebook_grad(s: Shape) -> int:
    """The codebook's gradient, (B·H, S, Dc) float32 added atomically: one write per sequence at least."""
    return s.seqs * s.S * s.Dc * F32


def soft_assign(s: Shape) -> KernelCost:
    """Two passes over the code tiles (the running max and sum, then the weights); reads k, the codebook and its
    half norms, writes the (T, S) float32 weights."""
    return KernelCost("_soft_assign_kernel", "the mixture's weights, (T, S) float32 written", mixture_products(s, 2),
                      half(s, s.Dc) + codebook(s) + s.H * s.S * F32 + weights(s))


def soft_block_dc_kernels(s: Shape, ib: int) -> list[KernelCost]:
    """What vq_soft_rope runs today: the weights written by the assignment, read by the prefix walk (every block's
    cache), the reverse walk (which writes their gradient) and both of the assignment's backward kernels; the code
    backward writes every block's cache gradient and count gradient, and adds the codebook's gradient from the code
    scores."""
    nb = s.nb
    walk = prefix(s, nb, ib)
    code = code_backward(s, nb, None, True, ib)
    counts_grads = s.seqs * nb * s.S * F32
    return [
        nonfinite_rows(s), soft_assign(s),
        KernelCost(walk.name, f"walk: {nb} caches from the weights", walk.flop,
                   walk.bytes - per_token(s, 1, ib) + weights(s)),
        forward(s, nb, None, ib), output_delta(s), window_backward(s),
        KernelCost(code.name, "codes: dqc, every block's dC and dn, the codebook's share",
                   code.flop + block_products(s, s.S, s.Dc), code.bytes + counts_grads + codebook_grad(s)),
        # dv = Δ·G and the weights' gradient v·Gᵀ + Gn, block by block; dv added to the window's in float32
        KernelCost("_prefix_backward_kernel", "reverse walk: dv and the weights' gradient from dC",
                   block_products(s, s.S, s.Dv, s.Dv),
                   weights(s) + cache_grads(s, nb) + counts_grads + 2 * state(s) + half(s, s.Dv, s.Dv)
                   + 2 * per_token(s, s.Dv) + weights(s)),
        # r = Σ_s g p in a first walk, then dk = Σ_s ds c / τ: ds·c float32 operands, three TF32 products
        KernelCost("_soft_key_grad_kernel", "the keys' gradient through the weights", mixture_products(s, 1, 3),
                   2 * weights(s) + codebook(s) + per_token(s, s.Dc) + per_token(s)),
        KernelCost("_soft_code_grad_kernel", "the codes' gradient through the weights", mixture_products(s),
                   2 * weights(s) + half(s, s.Dc) + per_token(s) + codebook_grad(s)),
    ]


def mixture_backward_products(s: Shape) -> int:
    """The mixture's backward at a key block, from the weights' gradient dP: dk = Σ_s ds c / τ (three TF32
    products) and dc = Σ_j ds k (two)."""
    return mixture_products(s, 1, 3) + mixture_products(s)


def soft_block_sums_kernels(s: Shape, ib: int) -> list[KernelCost]:
    """What soft keys run (``vqattn/ops/triton/soft.py``): each key's mixture logsumexp; every block's
    increments Δᵀ1, ΔᵀV with the weights recomputed, written into the caches and scanned there; the window-code
    kernels as for block_dc (the code backward writes every block's cache gradient, which a reverse scan turns into
    every block's increment gradient G in place); the keys' and values' gradients key-major, two walks over the
    codes (dv = P·G and r, then ds = p (g − r) and ds·c: the weights and g = v·Gᵀ + Gn formed twice), the codes'
    gradient code-major (the weights, g and kᵀ·ds once more). No (T, S) tensor: per block only the caches and
    their gradients."""
    nb = s.nb
    code = code_backward(s, nb, None, True, ib)
    counts_grads = s.seqs * nb * s.S * F32
    keys = half(s, s.Dc) + per_token(s) + codebook(s)  # k, the logsumexp and the codes, read to recompute
    grads_read = cache_grads(s, nb) + counts_grads + state(s)  # every block's G and the kept state's gradient
    return [
        nonfinite_rows(s),
        KernelCost("_soft_assign_kernel", "each key's mixture logsumexp (its LOGSUMEXP output)", mixture_products(s),
                   half(s, s.Dc) + codebook(s) + s.H * s.S * F32 + per_token(s)),
        KernelCost("_soft_block_sums_kernel", f"{nb} blocks' increments, the weights recomputed",
                   mixture_products(s) + block_products(s, s.S, s.Dv), keys + half(s, s.Dv) + caches(s, nb)),
        KernelCost("exclusive_scan_kernel", "both scans: the caches, and their gradients' suffix sums (2 launches)", 0,
                   2 * caches(s, nb) + 2 * state(s) + 2 * (cache_grads(s, nb) + counts_grads) + state(s)),
        forward(s, nb, None, ib), output_delta(s), window_backward(s),
        KernelCost(code.name, "codes: dqc, every block's dC and dn, the codebook's share",
                   code.flop + block_products(s, s.S, s.Dc), code.bytes + counts_grads + codebook_grad(s)),
        KernelCost("_soft_block_grads_kernel", "keys and values through the weights: dk, dv, r (two walks)",
                   mixture_products(s, 2) + block_products(s, s.S, s.Dv, s.Dv) + mixture_products(s, 1, 3),
                   keys + half(s, s.Dv) + grads_read + per_token(s, s.Dc + s.Dv + 1)),
        KernelCost("_soft_code_grads_kernel", "the codes' gradient through the weights",
                   mixture_products(s, 2) + block_products(s, s.S, s.Dv),
                   keys + half(s, s.Dv) + grads_read + per_token(s) + codebook_grad(s)),
    ]


def soft_block_recompute_kernels(s: Shape, ib: int) -> list[KernelCost]:
    """Candidate: today's per-block caches and walks, the weights never in memory. A first kernel keeps each key's
    mixture logsumexp (one float); the prefix walk recomputes a block's weights from k, the codes and it; the
    reverse walk recomputes them, forms the weights' gradient v·Gᵀ + Gn on chip and turns it at once into the keys'
    gradient and the codes' share (r, ds, dk, dc), so the two backward kernels of the assignment go. Not counted,
    and why soft_block_sums was built instead: a walk's program holds one tile of codes, while r_j = Σ_s p_js g_js
    sums over all S, so each key's r and its Σ_s ds c would be reduced across the S/BS tiles' programs ((T, Dc)
    float32 atomics from each, 8× a (T, Dc) tensor at S = 512) and ds = p (g − r) would need r before any tile
    forms it: a second walk."""
    nb = s.nb
    walk = prefix(s, nb, ib)
    code = code_backward(s, nb, None, True, ib)
    counts_grads = s.seqs * nb * s.S * F32
    keys = half(s, s.Dc) + per_token(s) + codebook(s)  # k, the logsumexp and the codes, read to recompute
    return [
        nonfinite_rows(s),
        KernelCost("_soft_lse_kernel", "each key's mixture logsumexp", mixture_products(s),
                   half(s, s.Dc) + codebook(s) + s.H * s.S * F32 + per_token(s)),
        KernelCost(walk.name, f"walk: {nb} caches, the weights recomputed", walk.flop + mixture_products(s),
                   walk.bytes - per_token(s, 1, ib) + keys),
        forward(s, nb, None, ib), output_delta(s), window_backward(s),
        KernelCost(code.name, "codes: dqc, every block's dC and dn, the codebook's share",
                   code.flop + block_products(s, s.S, s.Dc), code.bytes + counts_grads + codebook_grad(s)),
        KernelCost("_prefix_backward_kernel", "reverse walk: dv, and dk, dc through the recomputed weights",
                   block_products(s, s.S, s.Dv, s.Dv) + mixture_products(s) + mixture_backward_products(s),
                   keys + cache_grads(s, nb) + counts_grads + 2 * state(s) + half(s, s.Dv, s.Dv)
                   + 2 * per_token(s, s.Dv) + per_token(s, s.Dc) + codebook_grad(s)),
    ]


def soft_superblock_kernels(s: Shape, K: int, ib: int) -> list[KernelCost]:
    """Candidate: the hard superblock design for soft keys, the weights recomputed wherever they are needed. The
    caches every K blocks as each superblock's sums (weights recomputed) and a scan. A query block reads a key
    block between its cache and its window through the mixture: with E = exp(σ qc·cᵀ) (L, S), which it forms for
    its cache's codes anyway, A = E·P_jᵀ (L, L) is the keys' share of the numerator, A·V_j of the values', so each
    such block costs the weights' recomputation and three products. Backward: the query-major kernel forms dqc from
    the codes and those blocks (dA = dO·V_jᵀ, dE = (A ∘ (dA − Δ))·P_j, then (dE ∘ E)·C once a block); the caches'
    gradients come from the queries, scanned in reverse; the key-major kernel recomputes P_j and, for every query
    block that reads key block j through the mixture, E of that block, and forms dv_j and the weights' gradient,
    then the caches' suffix sums' share (v·Gᵀ + Gn and P·G) and the mixture's backward (dk, dc)."""
    nsb = superblocks(s, K)
    stored = caches(s, nsb)
    reads = s.seqs * gathered_blocks(s.nb, K)  # (query block, key block) pairs read through the mixture
    L, S, Dc, Dv = s.L, s.S, s.Dc, s.Dv
    recompute = TF32_COST * 2 * 2 * L * S * Dc  # P_j (or E_b) of one block: k·cᵀ as two TF32 products
    keys = half(s, Dc) + per_token(s) + codebook(s)
    counts = nsb * s.seqs * S * F32
    return [
        nonfinite_rows(s),
        KernelCost("_soft_lse_kernel", "each key's mixture logsumexp", mixture_products(s),
                   half(s, Dc) + codebook(s) + s.H * S * F32 + per_token(s)),
        KernelCost("_soft_superblock_sums_kernel", f"{nsb} superblocks' sums, the weights recomputed",
                   mixture_products(s) + block_products(s, S, Dv), keys + half(s, Dv) + stored),
        KernelCost("exclusive_scan_kernel", "both scans: the caches and their gradients' suffix sums (2 launches)", 0,
                   state(s) + 2 * stored + 2 * stored + state(s)),
        KernelCost("_soft_superblock_forward_kernel", "window, the keys between through the mixture, the cache",
                   block_products(s, 2 * L, s.D, Dv) + block_products(s, S, Dc, Dv)
                   + reads * (recompute + 2 * L * L * S + 2 * L * L * Dv),
                   half(s, s.D, s.D, Dv, Dc) + codebook(s) + stored + keys + half(s, Dv) + per_token(s)),
        output_delta(s), window_backward(s),
        KernelCost("_soft_superblock_code_backward_kernel", "codes and the keys between: dqc, the codebook's share",
                   block_products(s, S, Dc, Dv, Dc, Dc) + block_products(s, S, Dc)
                   + reads * (recompute + 2 * L * L * S + 2 * L * L * Dv + 2 * L * L * S),
                   half(s, Dc, Dv) + per_token(s, 2) + codebook(s) + stored + keys + half(s, Dv) + half(s, Dc)
                   + codebook_grad(s)),
        KernelCost("_soft_superblock_cache_grad_kernel", f"{nsb} caches' gradients from qc, dO",
                   block_products(s, S, Dc, Dv),
                   half(s, Dc, Dv) + per_token(s) + codebook(s) + counts + stored),
        KernelCost("_soft_superblock_key_backward_kernel", "the keys between and the caches: dv, dk, dc",
                   mixture_products(s) + block_products(s, S, Dv, Dv) + mixture_backward_products(s)
                   + reads * (recompute + 2 * L * L * S + 2 * L * L * Dv + 2 * L * L * Dv + 2 * L * L * S),
                   keys + half(s, Dc, Dv) + per_token(s, 2) + cache_grads(s, nsb) + counts + 2 * half(s, Dv)
                   + per_token(s, Dc) + codebook_grad(s)),
    ]


def ovq_kernels(s: Shape) -> list[KernelCost]:
    """What ovq_attention's Triton impl runs (``S`` its slots, 64 by default): the online assignment (one program per
    sequence walks its blocks: each block's keys against the slots' running means, two TF32 products); vq's cache
    walk over the memory keys and values side by side, its slots as the codes' index (every block's float32 counts
    and key and value sums); the window-code kernels with one codebook per block, the slots' float32 mean keys (the
    sums divided by the counts, by PyTorch between the kernels, not counted), read by the forward and the code
    backward, which writes every block's gradients of the means, counts and value sums; the reverse walk carries
    them to the keys and values."""
    per_block = s.seqs * s.nb * s.S * (s.Dc + 1 + s.Dv) * F32  # every block's means, counts and value sums
    fwd = forward(s, 0, None, INDEX_BYTES)
    keys_values = per_token(s, s.Dc + s.Dv)  # the memory keys and values side by side, float32
    walk_state = s.seqs * s.S * (s.Dc + s.Dv + 1) * F32
    return [
        KernelCost("_online_slots_kernel", "the online assignment: each key's slot", mixture_products(s),
                   half(s, s.Dc) + per_token(s, 1, INDEX_BYTES)),
        KernelCost("_prefix_kernel", "walk: every block's slot counts, key and value sums",
                   block_products(s, s.S, s.Dc + s.Dv),
                   per_token(s, 1, INDEX_BYTES) + keys_values + 2 * walk_state + per_block),
        KernelCost(fwd.name, "window and every block's slots, online softmax", fwd.flop,
                   fwd.bytes - codebook(s) + per_block),
        output_delta(s), window_backward(s),
        KernelCost("_code_backward_kernel", "slots: dqc, every block's dC, dn and mean keys' gradient",
                   block_products(s, s.S, s.Dc, s.Dv, s.Dc, s.Dv, s.Dc),
                   half(s, s.Dc, s.Dv) + per_token(s, 2) + per_block + half(s, s.Dc) + per_block),
        KernelCost("_prefix_backward_kernel", "reverse walk: the memory keys' and values' gradients",
                   block_products(s, s.S, s.Dc + s.Dv),
                   per_token(s, 1, INDEX_BYTES) + per_block + 2 * walk_state + keys_values),
    ]


def fla_kernels(s: Shape) -> list[KernelCost]:
    """chunk_simple_gla with a state h (D, Dv) per chunk of L: P = q, k, v, o, dO, dq, dk, dv (B, H, T, ·) half,
    h and its gradient dh (B, H, nb, D, Dv), bf16 in the forward, float32 in the backward."""
    h = s.seqs * s.nb * s.D * s.Dv
    state_product = block_products(s, s.D, s.Dv)  # kᵀv, q·h, qᵀdO, …: 2·L·D·Dv a chunk
    qkv = half(s, s.D, s.D, s.Dv)
    return [
        KernelCost("chunk_fwd_kernel_h", "forward: states", state_product, half(s, s.D, s.Dv) + h * s.half_bytes),
        KernelCost("chunk_fwd_kernel_o", "forward: out", block_products(s, s.L, s.D, s.Dv) + state_product,
                   qkv + h * s.half_bytes + half(s, s.Dv)),
        KernelCost("chunk_fwd_kernel_h (backward)", "states again, float32", state_product,
                   half(s, s.D, s.Dv) + h * F32),
        KernelCost("chunk_bwd_kernel_dh", "state gradients, float32", state_product, half(s, s.D, s.Dv) + h * F32),
        KernelCost("chunk_bwd_kernel_dqkwg", "dq, dk", block_products(s, s.L, s.Dv, s.D, s.D) + 2 * state_product,
                   qkv + half(s, s.Dv) + 2 * h * F32 + half(s, s.D, s.D)),
        KernelCost("chunk_bwd_kernel_dv", "dv", block_products(s, s.L, s.D, s.Dv) + state_product,
                   half(s, s.D, s.D, s.Dv) + h * F32 + half(s, s.Dv)),
    ]


def kernels(design: str, shape: Shape, K: int = 8, index_bytes: int = INDEX_BYTES,
            segment_steps: int = SEGMENT_STEPS) -> list[KernelCost]:
    """The kernels of one fwd+bwd step of ``design`` (one of :data:`DESIGNS`) at ``shape``; ``K`` the blocks of a
    superblock, ``segment_steps`` a split walk's segment (walk_dc_split)."""
    if design == "fla":
        return fla_kernels(shape)
    if design == "ovq":
        return ovq_kernels(shape)
    if design == "superblock":
        return superblock_kernels(shape, K, index_bytes)
    if design == "soft_superblock":
        return soft_superblock_kernels(shape, K, index_bytes)
    if design == "soft_block_dc":
        return soft_block_dc_kernels(shape, index_bytes)
    if design == "soft_block_sums":
        return soft_block_sums_kernels(shape, index_bytes)
    if design == "soft_block_recompute":
        return soft_block_recompute_kernels(shape, index_bytes)
    if design == "superblock_walk":
        return vq_kernels(shape, -(-shape.nb // K), K, False, index_bytes)
    if design in ("block_dc", "walk_dc", "walk_dc_split"):
        seg = segment_steps if design == "walk_dc_split" else 0
        return vq_kernels(shape, shape.nb, None, design == "block_dc", index_bytes, seg)
    raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")


def table(costs: list[KernelCost]) -> list[str]:
    """Markdown rows: each kernel's GFLOP, GB and floor (ms) on every GPU, then the total."""
    gpus = list(GPUS)
    rows = ["| kernel | what | GFLOP | GB | " + " | ".join(f"{g} ms" for g in gpus) + " |",
            "|---|---|---:|---:|" + "---:|" * len(gpus)]
    for c in costs:
        rows.append(f"| {c.name} | {c.what} | {c.flop / 1e9:.1f} | {c.bytes / 1e9:.3f} | "
                    + " | ".join(f"{1e3 * c.floor_s(g):.3f}" for g in gpus) + " |")
    total = [1e3 * sum(c.floor_s(g) for c in costs) for g in gpus]
    flop, nbytes = sum(c.flop for c in costs) / 1e9, sum(c.bytes for c in costs) / 1e9
    rows.append(f"| **total** | | **{flop:.0f}** | **{nbytes:.2f}** | " + " | ".join(f"**{t:.2f}**" for t in total)
                + " |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS)
    parser.add_argument("--length", type=int, nargs="+", default=[8192, 32768], help="T, tokens per sequence")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per step: B = tokens // T")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--num-codes", type=int, default=512)
    parser.add_argument("--block-len", type=int, default=64)
    parser.add_argument("--superblock-blocks", type=int, nargs="+", default=[8], help="K, blocks per superblock")
    parser.add_argument("--slots", type=int, default=64, help="ovq's slots (its S)")
    args = parser.parse_args(argv)
    for T in args.length:
        codes = Shape(B=max(1, args.tokens // T), H=args.heads, T=T, S=args.num_codes, L=args.block_len)
        for design in args.designs:
            shape = dataclasses.replace(codes, S=args.slots) if design == "ovq" else codes
            for K in args.superblock_blocks if "superblock" in design else [None]:
                label = f"{design}, K = {K} ({K * shape.L} tokens)" if K else design
                print(f"\n### {label}: B={shape.B} H={shape.H} T={T} D={shape.D} Dv={shape.Dv} S={shape.S} "
                      f"L={shape.L}, bf16, fwd+bwd\n")
                print("\n".join(table(kernels(design, shape, **({"K": K} if K else {})))))


if __name__ == "__main__":
    main()
