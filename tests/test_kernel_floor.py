"""The floor model's counts on a small shape against counts written out by hand, its floors, and its CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# B = H = 1, T = 256 (nb = 4 blocks of L = 64), D = Dv = Dc = 16, S = 8, bf16 (2 bytes), int64 codes (8 bytes).
# One (T, 16) half tensor: 256·16·2 = 8192 bytes; one (T,) float32: 1024; the codes: 2048.
# A cache: S·(Dv·2 + 4) = 8·36 = 288 bytes, four of them 1152; a cache gradient 8·16·2 = 256, four 1024;
# the float32 state S·(Dv + 1)·4 = 544; the float32 codebook 8·16·4 = 512.
BLOCK_DC = {
    # k and k_rot read, a bool per row of each written
    "_nonfinite_rows_kernel": (0, 8192 + 8192 + 256 + 256),
    # two TF32 products (each at twice a bf16 product's time) of 2·256·8·16 = 65536; k, both codebook parts
    # (2·512), the half norms 8·4, the codes written
    "_nearest_kernel": (2 * 2 * 65536, 8192 + 1024 + 32 + 2048),
    # Δᵀ V, 2·8·64·16 = 16384 a block; codes, v, the state read and written, four caches written
    "_prefix_kernel": (4 * 16384, 2048 + 8192 + 2 * 544 + 1152),
    # per block the window's two (64, 64) tiles, qk and pv of 2·64·64·16 = 131072 each, and the codes' qc·cᵀ and
    # p·C, 2·64·8·16 = 16384 each; qw, kw, v, qc, the codebook, four caches read, out and the logsumexp written
    "_window_code_forward_kernel": (4 * (4 * 131072 + 2 * 16384), 4 * 8192 + 512 + 1152 + 8192 + 1024),
    # out and dO read, Δ written
    "_output_delta_kernel": (0, 2 * 8192 + 1024),
    # twelve (64, 64, 16) products a block; qw, kw, v, dO, lse, Δ read, dqw, dkw, dv written
    "_window_backward_kernel": (4 * 12 * 131072, 4 * 8192 + 2 * 1024 + 3 * 8192),
    # four (64, 8, 16) products a block; qc, dO, lse, Δ, codebook, caches read, dqc and four dC written
    "_code_backward_kernel": (4 * 4 * 16384, 2 * 8192 + 2 * 1024 + 512 + 1152 + 8192 + 1024),
    # Δ·G a block; codes, dC, the state's gradient read, dv and the initial state's gradient written
    "_prefix_backward_kernel": (4 * 16384, 2048 + 1024 + 2 * 544 + 8192),
}

# The built superblock design at K = 2: nsb = max(4 − 2, 0)//2 + 1 = 2 float32 caches, 2·544 = 1088 bytes; query
# blocks 1, 2, 3 gather (b − 1) mod 2 = 0, 1, 0 key blocks, one gathered (64, 64) tile a sequence.
SUPERBLOCK = {
    "_nonfinite_rows_kernel": BLOCK_DC["_nonfinite_rows_kernel"],
    "_nearest_kernel": BLOCK_DC["_nearest_kernel"],
    # Δᵀ V, 2·8·64·16 = 16384 a block; codes and v read, two caches (half sums, float32 counts: 288 each) written
    "_superblock_sums_kernel": (4 * 16384, 2048 + 8192 + 2 * 288),
    # forward: the initial state read, two caches read and rewritten; backward: two gradients read and rewritten,
    # the float32 total written
    "exclusive_scan_kernel": (0, 544 + 2 * 2 * 288 + 2 * 2 * 288 + 544),
    # per block the window's qk and pv (131072 each) and the codes' qc·cᵀ and p·C (16384 each); the gathered tile's
    # qc·c_zᵀ and p·v, 2·64·64·16 = 131072 each; qw, kw, v, qc, the codebook, two caches and the codes read, out and
    # the logsumexp written
    "_superblock_forward_kernel": (4 * (4 * 131072 + 2 * 16384) + 2 * 131072,
                                   4 * 8192 + 512 + 2 * 288 + 2048 + 8192 + 1024),
    "_output_delta_kernel": BLOCK_DC["_output_delta_kernel"],
    "_window_backward_kernel": BLOCK_DC["_window_backward_kernel"],
    # qc·cᵀ, dO·Cᵀ, ds·c a block (16384 each); the gathered tile's qc·c_zᵀ, dO·vᵀ, ds·c_z (131072 each); qc, dO, lse,
    # Δ, the codebook, two caches, the codes and v read, dqc written
    "_superblock_code_backward_kernel": (4 * 3 * 16384 + 3 * 131072,
                                         2 * 8192 + 2 * 1024 + 512 + 2 * 288 + 2048 + 8192 + 8192),
    # qc·cᵀ and wᵀ·dO a block; qc, dO, lse, the codebook, the codes, two caches' counts (2·8·4) read, two gradients
    # written
    "_superblock_cache_grad_kernel": (4 * 2 * 16384, 2 * 8192 + 1024 + 512 + 2048 + 2 * 8 * 4 + 2 * 288),
    # the gathered tile's qc·c_zᵀ and pᵀ·dO; the codes, qc, dO, lse, the codebook, two half suffix sums (8·16·2 =
    # 256 each) and the window's dv read, dv written
    "_superblock_key_backward_kernel": (2 * 131072, 2048 + 2 * 8192 + 1024 + 512 + 2 * 256 + 8192 + 8192),
}


# The soft mixture as vq_soft_rope runs it today. The (T, S) float32 weights (or their gradient): 256·8·4 = 8192
# bytes; k·cᵀ of every block, 2·64·8·16 = 16384 a block, 65536 a sequence, as two TF32 products at twice the cost.
SOFT_BLOCK_DC = {
    "_nonfinite_rows_kernel": BLOCK_DC["_nonfinite_rows_kernel"],
    # two passes over the codes; k, the codebook, its half norms (8·4) read, the weights written
    "_soft_assign_kernel": (2 * 2 * 2 * 65536, 8192 + 512 + 32 + 8192),
    # Δᵀ V a block from the weights (not the codes); v and the state read, the state and four caches written
    "_prefix_kernel": (4 * 16384, 8192 + 8192 + 2 * 544 + 1152),
    "_window_code_forward_kernel": BLOCK_DC["_window_code_forward_kernel"],
    "_output_delta_kernel": BLOCK_DC["_output_delta_kernel"],
    "_window_backward_kernel": BLOCK_DC["_window_backward_kernel"],
    # block_dc's four products a block and the codebook's share dsᵀ·qc; four blocks' count gradients (4·8·4) and
    # the codebook's gradient (8·16·4) written besides
    "_code_backward_kernel": (4 * 5 * 16384, 2 * 8192 + 2 * 1024 + 512 + 1152 + 8192 + 1024 + 128 + 512),
    # Δ·G and v·Gᵀ a block; the weights, dC, dn, the state's gradient, v and the window's dv read, dv (float32)
    # read and written, the initial state's gradient and the weights' gradient written
    "_prefix_backward_kernel": (4 * 2 * 16384,
                                8192 + 1024 + 128 + 2 * 544 + 2 * 8192 + 2 * 16384 + 8192),
    # ds·c as three TF32 products; the weights and their gradient, the codebook read, dk (float32) and r written
    "_soft_key_grad_kernel": (3 * 2 * 65536, 2 * 8192 + 512 + 16384 + 1024),
    # kᵀ·ds as two; the weights, their gradient, k and r read, the codebook's gradient written
    "_soft_code_grad_kernel": (2 * 2 * 65536, 2 * 8192 + 8192 + 1024 + 512),
}

# What soft keys run: no (T, S) tensor; the weights recomputed from k (8192), the logsumexp (1024) and the codebook
# (512): 9728 bytes read wherever they are formed.
SOFT_BLOCK_SUMS = {
    "_nonfinite_rows_kernel": BLOCK_DC["_nonfinite_rows_kernel"],
    # one pass over the codes; k, the codebook and its half norms read, the logsumexp written
    "_soft_assign_kernel": (2 * 2 * 65536, 8192 + 512 + 32 + 1024),
    # the weights recomputed and Δᵀ V a block; v read, four caches written
    "_soft_block_sums_kernel": (2 * 2 * 65536 + 4 * 16384, 9728 + 8192 + 1152),
    # forward: four caches read and rewritten, the initial state read and the total written; backward: four half
    # dC (4·8·16·2 = 1024) and their count gradients (4·8·4 = 128) read and rewritten, the float32 total written
    "exclusive_scan_kernel": (0, 2 * 1152 + 2 * 544 + 2 * (1024 + 128) + 544),
    "_window_code_forward_kernel": BLOCK_DC["_window_code_forward_kernel"],
    "_output_delta_kernel": BLOCK_DC["_output_delta_kernel"],
    "_window_backward_kernel": BLOCK_DC["_window_backward_kernel"],
    "_code_backward_kernel": SOFT_BLOCK_DC["_code_backward_kernel"],
    # the weights twice, P·G and v·Gᵀ a block, ds·c as three TF32 products; v, every block's G and count gradient
    # and the kept state's gradient read; dk, dv (float32) and r written
    "_soft_block_grads_kernel": (2 * 2 * 2 * 65536 + 4 * 2 * 16384 + 3 * 2 * 65536,
                                 9728 + 8192 + 1024 + 128 + 544 + 1024 * (16 + 16 + 1)),
    # the weights, v·Gᵀ a block, kᵀ·ds as two; as above with r read, the codebook's gradient written
    "_soft_code_grads_kernel": (2 * 2 * 2 * 65536 + 4 * 16384, 9728 + 8192 + 1024 + 128 + 544 + 1024 + 512),
}

# ovq with S = 8 slots: every block's float32 means, counts and value sums, 4·8·(16 + 1 + 16)·4 = 4224 bytes.
OVQ = {
    # the memory keys against the slots' means, two TF32 products; the keys read, the slots (int64) written
    "_online_slots_kernel": (2 * 2 * 65536, 8192 + 2048),
    # the one-hot rows times the keys and values side by side, 2·64·8·32 = 32768 a block; the slots, the float32
    # keys and values (256·32·4 = 32768) and the state read, the state after and every block's statistics written
    "_prefix_kernel": (4 * 32768, 2048 + 32768 + 2 * 8 * 33 * 4 + 4224),
    # block_dc's forward with every block's slots in place of the codebook and the caches
    "_window_code_forward_kernel": (4 * (4 * 131072 + 2 * 16384), 4 * 8192 + 4224 + 8192 + 1024),
    "_output_delta_kernel": BLOCK_DC["_output_delta_kernel"],
    "_window_backward_kernel": BLOCK_DC["_window_backward_kernel"],
    # qc·k̄ᵀ, dO·Cᵀ, ds·k̄, dC, the means' gradient: five products a block; qc, dO, lse, Δ and the blocks' slots read,
    # dqc and their gradients written
    "_code_backward_kernel": (4 * 5 * 16384, 2 * 8192 + 2 * 1024 + 4224 + 8192 + 4224),
    # the reverse walk's products as the walk's; the slots, the blocks' gradients and the state's gradient read, the
    # initial state's and the keys' and values' gradients written
    "_prefix_backward_kernel": (4 * 32768, 2048 + 4224 + 2 * 8 * 33 * 4 + 32768),
}

@pytest.fixture
def kernel_floor(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_floor

    return kernel_floor


@pytest.fixture
def small(kernel_floor):
    return kernel_floor.Shape(B=1, H=1, T=256, D=16, Dv=16, S=8, L=64, Dc=16)


def test_block_dc_counts_by_hand(kernel_floor, small):
    costs = kernel_floor.kernels("block_dc", small)
    assert [c.name for c in costs] == list(BLOCK_DC)
    assert {c.name: (c.flop, c.bytes) for c in costs} == BLOCK_DC


def test_walk_dc_moves_the_cache_gradient_into_the_walk(kernel_floor, small):
    block_dc = {c.name: c for c in kernel_floor.kernels("block_dc", small)}
    walk_dc = {c.name: c for c in kernel_floor.kernels("walk_dc", small)}
    code, walk = "_code_backward_kernel", "_prefix_backward_kernel"
    assert walk_dc[code].flop == block_dc[code].flop - 4 * 16384 and walk_dc[code].bytes == block_dc[code].bytes - 1024
    # the walk forms dC itself: qc·cᵀ and wᵀ·dO a block, reading qc, dO, lse, the codebook and the four blocks'
    # counts (4·8·4 = 128) instead of dC, and reads the window's dv (8192) to add its own
    assert walk_dc[walk].flop == block_dc[walk].flop + 4 * 2 * 16384
    assert walk_dc[walk].bytes == block_dc[walk].bytes - 1024 + 2 * 8192 + 1024 + 512 + 128 + 8192


def test_split_walks_by_hand(kernel_floor, small):
    """Segments of 2 steps: the forward walk's 5 steps in 3 segments, the reverse walk's 4 in 2; a segment's sum
    is a float32 state, 544 bytes."""
    walk_dc = {c.name: c for c in kernel_floor.kernels("walk_dc", small)}
    costs = kernel_floor.kernels("walk_dc_split", small, segment_steps=2)
    split = {c.name: c for c in costs}
    assert [c.name for c in costs] == ["_nonfinite_rows_kernel", "_nearest_kernel", "_prefix_segment_kernel",
                                       "exclusive_scan_kernel", "_prefix_kernel", "_window_code_forward_kernel",
                                       "_output_delta_kernel", "_window_backward_kernel", "_code_backward_kernel",
                                       "_reverse_segment_kernel", "_prefix_backward_kernel"]
    # Δᵀ V of every block; codes and v read, three sums written
    assert (split["_prefix_segment_kernel"].flop, split["_prefix_segment_kernel"].bytes) == (
        4 * 16384, 2048 + 8192 + 3 * 544)
    # both scans read and write their sums, the forward's also reads the initial cache
    assert split["exclusive_scan_kernel"].bytes == 2 * (3 + 2) * 544 + 544
    # dC of every block: qc·cᵀ and wᵀ·dO; qc, dO, lse, the codebook and the counts read, two sums written
    assert (split["_reverse_segment_kernel"].flop, split["_reverse_segment_kernel"].bytes) == (
        4 * 2 * 16384, 2 * 8192 + 1024 + 512 + 128 + 2 * 544)
    # each walk reads its segments' starts
    assert split["_prefix_kernel"].bytes == walk_dc["_prefix_kernel"].bytes + 3 * 544
    assert split["_prefix_backward_kernel"].bytes == walk_dc["_prefix_backward_kernel"].bytes + 2 * 544
    # segments that cover the walk split nothing
    assert kernel_floor.kernels("walk_dc_split", small, segment_steps=8) == kernel_floor.kernels("walk_dc", small)


def test_superblock_counts_by_hand(kernel_floor, small):
    assert kernel_floor.superblocks(small, 2) == 2 and kernel_floor.gathered_blocks(4, 2) == 1
    costs = kernel_floor.kernels("superblock", small, K=2)
    assert [c.name for c in costs] == list(SUPERBLOCK)
    assert {c.name: (c.flop, c.bytes) for c in costs} == SUPERBLOCK



def test_soft_block_dc_counts_by_hand(kernel_floor, small):
    costs = kernel_floor.kernels("soft_block_dc", small)
    assert [c.name for c in costs] == list(SOFT_BLOCK_DC)
    assert {c.name: (c.flop, c.bytes) for c in costs} == SOFT_BLOCK_DC


def test_soft_block_sums_counts_by_hand(kernel_floor, small):
    costs = kernel_floor.kernels("soft_block_sums", small)
    assert [c.name for c in costs] == list(SOFT_BLOCK_SUMS)
    assert {c.name: (c.flop, c.bytes) for c in costs} == SOFT_BLOCK_SUMS
    # at the benchmark shape: 15.3 GB against the weights' 26.9, for 43% more products
    big = kernel_floor.Shape(B=8, H=16, T=8192)
    gb = {d: sum(c.bytes for c in kernel_floor.kernels(d, big)) / 1e9 for d in ("soft_block_dc", "soft_block_sums")}
    assert gb == {"soft_block_dc": pytest.approx(26.89, abs=0.01), "soft_block_sums": pytest.approx(15.28, abs=0.01)}


def test_ovq_counts_by_hand(kernel_floor, small):
    costs = kernel_floor.kernels("ovq", small)
    assert [c.name for c in costs] == list(OVQ)
    assert {c.name: (c.flop, c.bytes) for c in costs} == OVQ


def test_soft_recompute_trades_the_weights_for_products(kernel_floor, small):
    """The candidate without weights in memory: a logsumexp per key (1024 bytes) in place of every (T, S) pass; each
    recomputation is k·cᵀ again (2·2·65536)."""
    today = {c.name: c for c in kernel_floor.kernels("soft_block_dc", small)}
    costs = kernel_floor.kernels("soft_block_recompute", small)
    recompute = {c.name: c for c in costs}
    assert "_soft_assign_kernel" not in recompute and "_soft_key_grad_kernel" not in recompute
    assert recompute["_soft_lse_kernel"].flop == 2 * 2 * 65536
    walk = "_prefix_kernel"
    assert recompute[walk].flop == today[walk].flop + 2 * 2 * 65536
    # the weights (8192) replaced by k, the logsumexp and the codebook (8192 + 1024 + 512)
    assert recompute[walk].bytes == today[walk].bytes - 8192 + 8192 + 1024 + 512
    reverse = "_prefix_backward_kernel"
    # the weights recomputed, and the mixture's backward (3 + 2 TF32 products) fused into the walk
    assert recompute[reverse].flop == today[reverse].flop + 2 * 2 * 65536 + (3 + 2) * 2 * 65536
    # at the benchmark shape the weights' passes are most of today's bytes: 26.9 GB against 9.9
    big = kernel_floor.Shape(B=8, H=16, T=8192)
    gb = {d: sum(c.bytes for c in kernel_floor.kernels(d, big)) / 1e9 for d in ("soft_block_dc", "soft_block_recompute")}
    assert gb == {"soft_block_dc": pytest.approx(26.89, abs=0.01), "soft_block_recompute": pytest.approx(9.85, abs=0.01)}


def test_soft_superblock_reads_key_blocks_through_the_mixture(kernel_floor, small):
    """K = 2: one (query block, key block) pair a sequence read through the mixture; each costs the key block's
    weights again (2·2·2·64·8·16 = 65536 at TF32's cost) and three (64, 64) products over S or Dv."""
    at = {K: {c.name: c for c in kernel_floor.kernels("soft_superblock", small, K=K)} for K in (1, 2)}
    forward = "_soft_superblock_forward_kernel"
    pair = 2 * 2 * 2 * 64 * 8 * 16 + 2 * 64 * 64 * 8 + 2 * 64 * 64 * 16
    assert at[2][forward].flop - at[1][forward].flop == pair
    assert kernel_floor.superblocks(small, 1) == 3 and kernel_floor.superblocks(small, 2) == 2

def test_superblock_walk_gathers_the_keys_between_its_caches(kernel_floor, small):
    # K = 2: query blocks 1, 2, 3 read (b − 1) mod 2 = 0, 1, 0 blocks through their codes; 2 caches a sequence
    assert kernel_floor.gathered_blocks(4, 2) == 1
    costs = {c.name: c for c in kernel_floor.kernels("superblock_walk", small, K=2)}
    block_dc = {c.name: c for c in kernel_floor.kernels("block_dc", small)}
    forward = "_window_code_forward_kernel"
    # one (64, 64) tile more, qc·c_zᵀ and p·v; two caches fewer (2·288 bytes), the codes read
    assert costs[forward].flop == block_dc[forward].flop + 2 * 131072
    assert costs[forward].bytes == block_dc[forward].bytes - 2 * 288 + 2048


def test_floors_take_the_larger_term(kernel_floor):
    peak, bandwidth = kernel_floor.GPUS["H100"]
    compute = kernel_floor.KernelCost("a", "", flop=2 * peak, bytes=bandwidth)
    memory = kernel_floor.KernelCost("b", "", flop=peak, bytes=3 * bandwidth)
    assert compute.floor_s("H100") == 2.0 and memory.floor_s("H100") == 3.0
    assert memory.floor_s("H200") == pytest.approx(max(1.0, 3 * bandwidth / kernel_floor.GPUS["H200"][1]))


def test_fla_and_block_dc_at_the_benchmark_shape(kernel_floor):
    """The plan's figures: block_dc 962 GFLOP and about 2.8 ms on an H100; fla 120 GFLOP, 4.29 GB, 1.28 ms."""
    shape = kernel_floor.Shape(B=8, H=16, T=8192)
    block_dc, fla = kernel_floor.kernels("block_dc", shape), kernel_floor.kernels("fla", shape)
    assert sum(c.flop for c in block_dc) / 1e9 == pytest.approx(962, abs=1)
    assert sum(c.floor_s("H100") for c in block_dc) * 1e3 == pytest.approx(2.8, abs=0.05)
    assert sum(c.flop for c in fla) / 1e9 == pytest.approx(120, abs=1)
    assert sum(c.bytes for c in fla) / 1e9 == pytest.approx(4.29, abs=0.01)


def test_gpu_names(kernel_floor):
    assert kernel_floor.gpu_of("NVIDIA H100 80GB HBM3") == "H100"
    assert kernel_floor.gpu_of("NVIDIA H200") == "H200"
    assert kernel_floor.gpu_of("NVIDIA A100-SXM4-80GB") is None


def test_cli_prints_every_design(kernel_floor, capsys):
    kernel_floor.main(["--length", "8192", "--designs", "block_dc", "superblock", "superblock_walk",
                       "--superblock-blocks", "4", "8"])
    out = capsys.readouterr().out
    assert out.count("| **total** |") == 5 and "_prefix_backward_kernel" in out
    assert "_superblock_key_backward_kernel" in out
    with pytest.raises(ValueError):
        kernel_floor.kernels("no_such_design", kernel_floor.Shape(B=1, H=1, T=64))


def test_the_script_runs():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_floor.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    assert out.count("| **total** |") == 22  # eleven designs at 8k and 32k
