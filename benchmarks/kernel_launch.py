"""The fused window-code kernel's launch settings and input layouts, side by side in one run.

Times the kernel (``vqattn/ops/triton/window_codes.py``) forward alone and forward + backward under each launch
setting (warps, pipeline stages) of the backward and the forward, at these input layouts:

* ``layer``: what the vq layers hand it: q, k and v views of one projection, the output's gradient a transposed
  view, the code scores on the slow RoPE pairs (Dc = 30, which the kernel pads to 32), the memory bound's bias;
* ``layer_contiguous``: contiguous inputs at the layer's Dc;
* ``op``: the op table's, contiguous, Dc = D.

Then the vq layers' whole step (``benchmarks/layer_speed.py``'s) under each backward setting, when ``--layers``
names them. Every row runs in a process of its own: a setting that faults the GPU costs its row alone.

    python benchmarks/kernel_launch.py                       # B = 8, T = 8192, H = 16, S = 512, bf16
    python benchmarks/kernel_launch.py --layers vq_hard vq_soft
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys

import torch
from layer_speed import build

from vqattn.ops.triton import window_codes

LAYOUTS = ("layer", "layer_contiguous", "op")
SETTINGS = [(4, 3), (4, 1), (8, 1), (4, 2), (8, 2), (8, 3)]  # (num_warps, num_stages), the defaults first
CHILD_TIMEOUT_S = 120


def median_ms(fn, reps: int) -> float:
    fn()  # compiles the kernels
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_inputs(layout: str, B: int, T: int, H: int, S: int, L: int, device: str):
    """The kernel's arguments as ``layout`` has them, and the output's gradient."""
    D, bf16 = 64, dict(device=device, dtype=torch.bfloat16)
    dc = D if layout == "op" else 30
    nb = -(-T // L)
    if layout in ("op", "layer_contiguous"):
        q, k, v = (torch.randn(B, H, T, D, **bf16) for _ in range(3))
        grad = torch.randn(B, H, T, D, **bf16)
    else:  # views of one (B, T, 3, H, D) projection; the gradient arrives as the transposed (B, T, H, D) view
        q, k, v = torch.randn(B, T, 3, H, D, **bf16).permute(2, 0, 3, 1, 4).unbind(0)
        grad = torch.randn(B, T, H, D, **bf16).transpose(1, 2)
    qc, codebook = q[..., :dc].contiguous(), torch.randn(H, S, dc, **bf16)
    counts = torch.randint(0, 40, (B, H, nb, S), device=device).float()
    sums = torch.randn(B, H, nb, S, D, **bf16)
    bias = -torch.rand(nb, device=device) if layout != "op" else None
    tensors = dict(qw=q.contiguous(), kw=k.contiguous(), v=v, qc=qc, codebook=codebook, counts=counts, sums=sums)
    for name in ("qw", "kw", "v", "qc", "sums"):  # the layer's codebook is an EMA buffer: no gradient
        tensors[name].requires_grad_()
    return tensors, bias, grad


def kernel_row(layout: str, warps: int, stages: int, args) -> str:
    """The forward's and the backward's ms at ``layout`` under one launch setting (the backward's: the step's time
    less the forward's under the default setting)."""
    tensors, bias, grad = kernel_inputs(layout, args.batch, args.length, args.heads, args.num_codes, 64, "cuda")

    def forward():
        return window_codes.fused_window_code_attention(**tensors, code_bias=bias, scale=0.125, block_len=64)

    def step():
        forward().backward(grad)

    default_forward_ms = median_ms(forward, args.reps)
    window_codes.BACKWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
    backward_ms = median_ms(step, args.reps) - default_forward_ms
    window_codes.FORWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
    return f"| {layout} | {warps} | {stages} | {median_ms(forward, args.reps):.3f} | {backward_ms:.3f} |"


def layer_row(name: str, warps: int, stages: int, args) -> str:
    """The layer's whole step (forward + backward, bf16 autocast) with the kernel's backward under one setting."""
    layer = build(name, 1024, args.heads, args.num_codes, "cuda", torch.float32)
    x = torch.randn(args.batch, args.length, 1024, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, aux_loss, _ = layer(x)
            loss = out.float().sum() + aux_loss
        loss.backward()

    window_codes.BACKWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
    return f"| {name} layer | {warps} | {stages} | | {median_ms(step, args.reps):.2f} |"


def run_child(what: str, name: str, warps: int, stages: int, argv: list[str]) -> str:
    """One row in a process of its own: a setting that faults the GPU (an illegal memory access leaves the process's
    CUDA context unusable) costs its row alone."""
    cmd = [sys.executable, __file__, *argv, "--child", what, name, str(warps), str(stages)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"| {name} | {warps} | {stages} | timed out after {CHILD_TIMEOUT_S} s | |"
    rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    if done.returncode == 0 and rows:
        return rows[-1]
    errors = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()[-1:]
    return f"| {name} | {warps} | {stages} | failed: {(errors[-1] if errors else '')[:100]} | |"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--num-codes", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--layers", nargs="*", default=[], help="vq layers to time under each backward setting")
    parser.add_argument("--child", nargs=4, metavar=("WHAT", "NAME", "WARPS", "STAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.child:
        what, name, warps, stages = args.child
        print((kernel_row if what == "kernel" else layer_row)(name, int(warps), int(stages), args))
        return
    shared = ["--batch", str(args.batch), "--length", str(args.length), "--heads", str(args.heads),
              "--num-codes", str(args.num_codes), "--reps", str(args.reps)]
    print(f"# {torch.cuda.get_device_name()}, B={args.batch} T={args.length} H={args.heads} S={args.num_codes} bf16; "
          f"defaults: forward {window_codes.FORWARD_LAUNCH}, backward {window_codes.BACKWARD_LAUNCH}; median ms of "
          f"{args.reps}; one process per row")
    print("| inputs | warps | stages | forward ms | backward ms (layer: the step) |\n|---|---|---|---|---|", flush=True)
    jobs = [("kernel", layout) for layout in args.layouts] + [("layer", name) for name in args.layers]
    for what, name in jobs:
        for warps, stages in SETTINGS:
            print(run_child(what, name, warps, stages, shared), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
