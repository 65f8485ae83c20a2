"""The fused window-code kernel's launch settings and input layouts, side by side in one run.

Times the kernel (``vqattn/ops/triton/window_codes.py``) forward alone and forward + backward, at the shape the vq
layers hand it (``layer``: q, k and v views of one projection, the output's gradient a transposed view, the code
scores on the slow RoPE pairs, Dc = 30, with the memory bound's bias) or the op table's (``op``: contiguous inputs,
Dc = D), for each launch setting (warps, pipeline stages) of the backward and the forward, and the ``layer`` shape
with its code dims zero-padded to 32 (q·c unchanged), so that a row of the code scores is 64 bytes, or with
contiguous inputs (``layer_contiguous``: the op's layout at the layer's Dc). Then the vq
layers' whole step (``benchmarks/layer_speed.py``'s) under each backward setting, when ``--layers`` names them.

    python benchmarks/kernel_launch.py                       # B = 8, T = 8192, H = 16, S = 512, bf16
    python benchmarks/kernel_launch.py --layers vq_hard vq_soft
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from layer_speed import build

from vqattn.ops.triton import window_codes

# (num_warps, num_stages), the defaults first: a setting that faults the GPU ends the process
LAYOUTS = ("layer", "layer_padded", "layer_contiguous", "op")
SETTINGS = [(4, 3), (4, 1), (8, 1), (4, 2), (8, 2), (8, 3)]


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
    if layout == "layer_padded":
        qc, codebook = F.pad(qc, (0, 32 - dc)), F.pad(codebook, (0, 32 - dc))
    counts = torch.randint(0, 40, (B, H, nb, S), device=device).float()
    sums = torch.randn(B, H, nb, S, D, **bf16)
    bias = -torch.rand(nb, device=device) if layout != "op" else None
    tensors = dict(qw=q.contiguous(), kw=k.contiguous(), v=v, qc=qc, codebook=codebook, counts=counts, sums=sums)
    for name in ("qw", "kw", "v", "qc", "sums"):  # the layer's codebook is an EMA buffer: no gradient
        tensors[name].requires_grad_()
    return tensors, bias, grad


def time_kernel(layout: str, args) -> None:
    tensors, bias, grad = kernel_inputs(layout, args.batch, args.length, args.heads, args.num_codes, 64, "cuda")

    def forward():
        return window_codes.fused_window_code_attention(**tensors, code_bias=bias, scale=0.125, block_len=64)

    def step():
        forward().backward(grad)

    forward_ms = median_ms(forward, args.reps)  # the default forward, inside every step below
    for warps, stages in SETTINGS:
        try:
            window_codes.BACKWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
            backward_ms = median_ms(step, args.reps) - forward_ms
            window_codes.FORWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
            print(f"| {layout} | {warps} | {stages} | {median_ms(forward, args.reps):.3f} | {backward_ms:.3f} |",
                  flush=True)
        except Exception as e:  # a setting Triton cannot compile or run here: say so, go on
            print(f"| {layout} | {warps} | {stages} | failed: {type(e).__name__} {str(e)[:80]} | |", flush=True)
        finally:
            window_codes.FORWARD_LAUNCH, window_codes.BACKWARD_LAUNCH = dict(DEFAULTS[0]), dict(DEFAULTS[1])


def time_layer(name: str, args) -> None:
    layer = build(name, 1024, args.heads, args.num_codes, "cuda", torch.float32)
    x = torch.randn(args.batch, args.length, 1024, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, aux_loss, _ = layer(x)
            loss = out.float().sum() + aux_loss
        loss.backward()

    for warps, stages in SETTINGS:
        window_codes.BACKWARD_LAUNCH = dict(num_warps=warps, num_stages=stages)
        try:
            print(f"| {name} layer | {warps} | {stages} | | {median_ms(step, args.reps):.2f} |", flush=True)
        except Exception as e:
            print(f"| {name} layer | {warps} | {stages} | failed: {type(e).__name__} | |", flush=True)
        finally:
            window_codes.BACKWARD_LAUNCH = dict(DEFAULTS[1])


DEFAULTS = (dict(window_codes.FORWARD_LAUNCH), dict(window_codes.BACKWARD_LAUNCH))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--num-codes", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--layers", nargs="*", default=[], help="vq layers to time under each backward setting")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, B={args.batch} T={args.length} H={args.heads} S={args.num_codes} bf16; "
          f"defaults: forward {DEFAULTS[0]}, backward {DEFAULTS[1]}; median ms of {args.reps}")
    print("| inputs | warps | stages | forward ms | backward ms (layer: the step) |\n|---|---|---|---|---|")
    for layout in args.layouts:
        time_kernel(layout, args)
    for name in args.layers:
        time_layer(name, args)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
