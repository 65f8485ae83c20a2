"""The buffers PyTorch allocates for one forward + backward of a Triton op, found on a machine without a GPU: the
op runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set here), and ``torch.profiler`` sums
the bytes every allocation of the step takes (its positive self memory; the inputs and their gradients' buffers
from an earlier step excluded, a first step run before).

    python benchmarks/op_buffers.py                     # vq_hard, vq_soft, ovq at B = 1, H = 2, T = 2048
    python benchmarks/op_buffers.py --methods vq_soft --length 4096

The shape is the kernels' (D = Dv = 64, S = 512 codes or 64 ovq slots with memory_cap 2L, L = 64, an exact window,
q_rot and k_rot given to vq). The interpreter runs the GPU's kernels and their host code, so the buffers are the
GPU's, but a GPU's kernels may run in another order; time is another matter (``kernel_profile.py``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from vqattn.functional import ovq_attention, vq_attention  # noqa: E402

METHODS = ("vq_hard", "vq_soft", "ovq")


def step(method: str, B: int, H: int, T: int, D: int = 64, S: int = 512, L: int = 64, slots: int = 64):
    """One fwd+bwd of ``method``'s Triton op as a function of no arguments, on fresh float32 CPU inputs."""
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    q, k, v, q_rot, k_rot = (make(B, H, T, D) for _ in range(5))
    codebook = make(H, S, D).requires_grad_(method == "vq_soft")  # hard codes learn by EMA, soft by gradient

    def run():
        if method == "ovq":
            out = ovq_attention(q, k, v, num_slots=slots, block_len=L, threshold=0.1, memory_cap=2 * L,
                                impl="triton")
        else:
            out = vq_attention(q, k, v, codebook, causal=True, assign=method.removeprefix("vq_"), block_len=L,
                               exact_window=True, q_rot=q_rot, k_rot=k_rot, impl="triton")
        out.backward(torch.ones_like(out))

    return run


def allocated_bytes(run) -> int:
    """The bytes the allocations of one call of ``run`` take (after one call that is not counted)."""
    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--num-codes", type=int, default=512)
    args = parser.parse_args(argv)
    print(f"B={args.batch} H={args.heads} T={args.length} D=Dv=64 S={args.num_codes} (ovq: 64 slots) L=64, "
          "float32, fwd+bwd under the interpreter\n\n| op | buffers MB | MiB |\n|---|---:|---:|")
    for method in args.methods:
        run = step(method, args.batch, args.heads, args.length, S=args.num_codes)
        total = allocated_bytes(run)
        print(f"| {method} | {total / 1e6:.1f} | {total / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
