"""What a packed call costs: a row of documents of mixed lengths (``cu_seqlens``) against the same tokens as one
document, forward and backward, op by op, side by side.

    python benchmarks/packed_speed.py                          # CPU, one thread: 7168 + 16 x 64 = 8192 tokens
    python benchmarks/packed_speed.py --layout 1024 16x64      # 2048 tokens
    python benchmarks/packed_speed.py --device cuda --heads 16 --dtype bfloat16 --in-process

The layout lists the documents: ``N`` one of N tokens, ``KxN`` K of them. The packed row is called with their
``cu_seqlens``, the single document with none; both hold the same tokens. The table gives each one's median ms,
packed / single (the median of the per-round ratios of interleaved rounds) and the peak memory of each (its own
process's high-water RSS above what it held before the call on a CPU, ``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from attention_speed import DTYPES, add_in_process_argument, machine, run_child, set_in_process, time_fwd_bwd

from vqattn.functional import ovq_attention, vq_attention, window_attention
from vqattn.utils import add_threads_argument, use_threads

OPS = ("vq_hard", "vq_soft", "ovq", "window")


def parse_layout(items: list[str]) -> list[int]:
    """Document lengths from ``N`` and ``KxN`` items: ["7168", "16x64"] -> [7168, 64, …, 64]."""
    lengths = []
    for item in items:
        count, _, n = item.rpartition("x")
        if not n.isdigit() or (count and not count.isdigit()) or int(n) < 1:
            raise ValueError(f"layout items are N or KxN with positive N, got {item!r}")
        lengths += [int(n)] * int(count or 1)
    return lengths


def call(op: str, q, k, v, codebook, *, block_len: int, slots: int, cu_seqlens):
    """The op on (1, H, T, D) inputs as a layer calls it by default (ovq: its memory cap of two blocks)."""
    if op in ("vq_hard", "vq_soft"):
        return vq_attention(q, k, v, codebook, causal=True, assign=op[3:], block_len=block_len,
                            cu_seqlens=cu_seqlens)
    if op == "ovq":
        return ovq_attention(q, k, v, num_slots=slots, block_len=block_len, memory_cap=2 * block_len,
                             cu_seqlens=cu_seqlens)
    return window_attention(q, k, v, block_len=block_len, cu_seqlens=cu_seqlens)


def child(op: str, lengths: list[int], packed: bool, device: str, reps: int, H: int, D: int, S: int, slots: int,
          block_len: int, dtype: str) -> dict:
    torch.manual_seed(0)
    T = sum(lengths)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=DTYPES[dtype]).requires_grad_(True)  # noqa: E731
    q, k, v, codebook = make(1, H, T, D), make(1, H, T, D), make(1, H, T, D), make(H, S, D)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device) if packed else None

    def run_once():
        out = call(op, q, k, v, codebook, block_len=block_len, slots=slots, cu_seqlens=cu)
        out.backward(torch.ones_like(out))

    return time_fwd_bwd(run_once, (q, k, v, codebook), device, reps)


def child_from_argv(argv: list[str]) -> dict:
    op, lengths, packed, device, reps, shape = argv
    return child(op, json.loads(lengths), packed == "packed", device, int(reps), **json.loads(shape))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", nargs="+", default=["7168", "16x64"], help="documents: N or KxN (see above)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-codes", type=int, default=256)
    parser.add_argument("--num-slots", type=int, default=64)
    parser.add_argument("--block-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    add_threads_argument(parser)
    add_in_process_argument(parser)
    parser.set_defaults(threads=1)  # as the cost was first measured: one thread, so a busy core count skews less
    args = parser.parse_args(argv)
    lengths = parse_layout(args.layout)
    set_in_process(args)
    if args.device == "cpu":
        use_threads(args.threads, "timing", children=True)
    shape = dict(H=args.heads, D=args.head_dim, S=args.num_codes, slots=args.num_slots, block_len=args.block_len,
                 dtype=args.dtype)
    print(f"# fwd+bwd, impl auto, H={args.heads} D={args.head_dim} S={args.num_codes} (ovq {args.num_slots} slots) "
          f"L={args.block_len} {args.dtype}, {args.device}: {machine()}, torch {torch.__version__}; "
          f"{len(lengths)} documents ({' '.join(args.layout)}) = {sum(lengths)} tokens against one document of "
          f"{sum(lengths)}; median of {args.reps} reps in each of {args.rounds} interleaved rounds")
    print("| op | one document ms | packed ms | packed / one | one document MB | packed MB | packed / one (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for op in args.ops:
        rounds = []
        for _ in range(args.rounds):
            rounds.append({kind: run_child(__file__, [op, json.dumps(lengths), kind, args.device, str(args.reps),
                                                      json.dumps(shape)]) for kind in ("single", "packed")})
        errors = [r[kind]["error"] for r in rounds for kind in r if "error" in r[kind]]
        if errors:
            print(f"| {op} | failed: {errors[0]} | | | | | |", flush=True)
            continue
        ms = {kind: statistics.median(r[kind]["ms"] for r in rounds) for kind in ("single", "packed")}
        mb = {kind: max(r[kind]["peak_mb"] for r in rounds) for kind in ("single", "packed")}
        ratio = statistics.median(r["packed"]["ms"] / r["single"]["ms"] for r in rounds)
        print(f"| {op} | {ms['single']:.1f} | {ms['packed']:.1f} | {ratio:.2f}x | {mb['single']:.0f} | "
              f"{mb['packed']:.0f} | {mb['packed'] / max(mb['single'], 1e-9):.2f}x |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child_from_argv(sys.argv[2:8])))
    else:
        main()
