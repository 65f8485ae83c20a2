"""What each Triton kernel of a step costs a GPU's SMs, found on a machine without one: registers, spills, shared
memory and element-wise (unvectorised) global accesses, per kernel, from Triton's own compiler and ptxas.

Two phases. First a subprocess runs one forward + backward of the op or layer (``kernel_profile.py``'s steps, bf16,
at a small length with the same head shapes) on CPU tensors under Triton's interpreter, with the GPU's kernel paths
and operand types forced, and records every launch: kernel, argument dtypes, shapes and strides, constexprs, launch
settings. Then each distinct launch is compiled for an NVIDIA target (sm_90 by default) without running it, and
ptxas' resource usage and the PTX's global accesses are read:

    python benchmarks/kernel_resources.py --what layer --method vq_hard
    python benchmarks/kernel_resources.py --what op --method vq_hard_rope --arch 90

A kernel using 255 registers with spill bytes runs one or two programs per SM; ``ld.global.b16`` (one half element
per instruction) marks loads that Triton could not vectorise, most often rows whose width or stride is not a
multiple of 16 elements; SASS counts the kernel's machine instructions (a loop's body once): for a kernel without
loops, the issue slots each of its warps needs; loop, those of its largest innermost loop's body, once per
iteration (the code-tile loops of the window-code kernels and the cache walks). ``--dump DIR`` writes each launch's
SASS listing. The figures are those of the Triton that compiles; ``--compiler-python`` names a Python whose Triton is
another version (the GPU machine's), which compiles the launches recorded here:

    python -m venv --system-site-packages /tmp/triton36
    /tmp/triton36/bin/pip install --no-deps triton==3.6.0
    python benchmarks/kernel_resources.py --what layer --method vq_hard --compiler-python /tmp/triton36/bin/python

They say nothing of time: time is ``kernel_profile.py``'s, on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile

import torch

# the constexprs that tell the launches of one kernel apart in the table: tile widths and product types
SHOWN_CONSTEXPRS = ("BDC", "BD", "BDV", "DOT", "BS", "L", "PREC", "EXACT_PREC")
# a line of cuobjdump's SASS listing that holds one instruction: its address comment, then the opcode
SASS_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", re.MULTILINE)
# an instruction's address and text; a branch's target address
SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", re.MULTILINE)
BRANCH_TARGET = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")
ACCESS = re.compile(r"\b((?:ld|st)\.global(?:\.\w+)*|cp\.async\.c[ag]\.shared\.global)")


def record(args, path: str) -> None:
    """Run one step under the interpreter with the GPU's kernel paths, pickling every launch to ``path``."""
    import triton.runtime.interpreter as interpreter
    from kernel_profile import layer_step, op_step, set_precision

    import vqattn.codebook as codebook
    import vqattn.ops.nonfinite as nonfinite
    import vqattn.ops.triton.rotation as rotation
    import vqattn.ops.triton.utils as utils
    import vqattn.ops.vq.assign as assign

    # the kernels a CUDA tensor takes, and their half-precision products (the interpreter's own are float32)
    rotation.runs_rotation_kernel = lambda x: (x.dim() == 4 and x.stride(-1) == 1
                                               and x.dtype in rotation.SUPPORTED_DTYPES)
    kernels = lambda x: x.dtype in utils.SUPPORTED_DTYPES  # noqa: E731
    for module in (nonfinite, assign, codebook):
        module.runs_kernels = kernels
    utils.INTERPRET = False
    utils.capability = lambda device: divmod(args.arch, 10)  # the launch settings of the GPU compiled for

    launches = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *call_args, grid, warmup, **kwargs):
        spec = (self.fn.__module__, self.fn.__name__, tuple(map(_describe, call_args)),
                tuple(sorted((k, _describe(v)) for k, v in kwargs.items())))
        launches.setdefault(repr(spec), spec)
        return run(self, *call_args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    set_precision(args)
    torch.manual_seed(0)
    args.impl = "triton"
    (op_step if args.what == "op" else layer_step)(args, device="cpu")()
    with open(path, "wb") as f:
        pickle.dump(list(launches.values()), f)


def _describe(x):
    if isinstance(x, torch.Tensor):  # what specialisation sees: dtype, layout and the pointer's alignment
        return ("tensor", str(x.dtype).removeprefix("torch."), tuple(x.shape), tuple(x.stride()),
                x.data_ptr() % 16 // x.element_size())
    return x


class _CompileOnlyDriver:
    """Triton's driver interface as far as compiling needs it, for a GPU that is not here."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _rebuild(x):
    if isinstance(x, tuple) and x and x[0] == "tensor":
        _, dtype, shape, stride, misalign = x
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        buffer = torch.empty(size + misalign, dtype=getattr(torch, dtype))
        return buffer.as_strided(shape, stride, misalign)
    return x


def innermost_loops(sass: str) -> list[list[str]]:
    """The bodies of the innermost loops of a SASS listing (instruction texts, from a backward branch's target to
    the branch), largest first: a kernel's loop over code tiles is read there, once per iteration."""
    lines = [(int(address, 16), text) for address, text in SASS_LINE.findall(sass)]
    spans = []
    for address, text in lines:
        target = BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    bodies = [[text for address, text in lines if a <= address <= b] for a, b in innermost]
    return sorted(bodies, key=len, reverse=True)


def compile_and_measure(launches, arch: int, dump: str | None = None) -> list[dict]:
    import triton
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner

    driver.set_active(_CompileOnlyDriver(arch))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for module, name, call_args, kwargs in launches:
        kernel = getattr(importlib.import_module(module), name)
        if isinstance(kernel, Autotuner):  # the recorded launch holds the config it ran with
            kernel = kernel.fn
        compiled = kernel.warmup(*map(_rebuild, call_args), grid=(1,), **{k: _rebuild(v) for k, v in kwargs})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        if dump:  # each launch's SASS, numbered in launch order: a loop's body is read there
            with open(os.path.join(dump, f"{len(rows):02d}_{name}.sass"), "w") as out:
                out.write(sass)
        resources = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
        accesses = collections.Counter(ACCESS.findall(compiled.asm["ptx"]))
        rows.append(dict(
            kernel=name, warps=compiled.metadata.num_warps, stages=compiled.metadata.num_stages,
            regs=int(resources.get("REG", 0)), stack=int(resources.get("STACK", 0)),
            shared_kb=compiled.metadata.shared / 1024,
            instructions=len(SASS_INSTRUCTION.findall(sass)),
            loop=len((innermost_loops(sass) or [[]])[0]),
            scalar_loads=sum(n for a, n in accesses.items() if a.startswith("ld") and _element_wise(a)),
            scalar_stores=sum(n for a, n in accesses.items() if a.startswith("st") and _element_wise(a)),
            vector_loads=sum(n for a, n in accesses.items() if ".v" in a and a.startswith("ld")),
            async_copies=sum(n for a, n in accesses.items() if a.startswith("cp.async")),
            constexprs=", ".join(f"{k}={v}" for k, v in kwargs if k in SHOWN_CONSTEXPRS),
        ))
    return rows


def _element_wise(access: str) -> bool:
    """A global access of one half element per instruction (a b16/u16/f16 load or store without .v2/.v4)."""
    return ".v" not in access and access.rsplit(".", 1)[-1] in ("b16", "u16", "s16", "f16", "bf16")


def main(argv=None) -> None:
    from kernel_profile import add_precision_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=["op", "layer"], default="layer")
    parser.add_argument("--method", default="vq_hard", help="an op method or a layer (kernel_profile.py's)")
    parser.add_argument("--length", type=int, default=256,
                        help="the recorded step's T (constexprs do not depend on it)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--num-codes", type=int, default=512)
    parser.add_argument("--block-len", type=int, default=None)
    parser.add_argument("--arch", type=int, default=90, help="the compute capability compiled for (90: H100, H200)")
    parser.add_argument("--dump", help="a folder to write each launch's SASS listing to")
    parser.add_argument("--compiler-python", default=sys.executable,
                        help="the Python (and so the Triton) that compiles the launches (default: this one)")
    add_precision_arguments(parser)
    parser.add_argument("--phase", choices=["record", "compile"], help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase == "record":
        return record(args, args.file)
    if args.phase == "compile":
        with open(args.file, "rb") as f:
            rows = compile_and_measure(pickle.load(f), args.arch, args.dump)
        with open(args.file, "wb") as f:
            pickle.dump(rows, f)
        return
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        # each phase in a fresh process: Triton picks the interpreter or the compiler when the kernels are defined
        for phase, interpret, python in (("record", "1", sys.executable), ("compile", "0", args.compiler_python)):
            _run_phase(python, argv if argv is not None else sys.argv[1:], phase, f.name, interpret)
        with open(f.name, "rb") as results:
            rows = pickle.load(results)
    version = subprocess.run([args.compiler_python, "-c", "import triton; print(triton.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    print(f"{args.what} {args.method}, {args.dtype}{' tf32' if args.tf32 else ''}, sm_{args.arch}, Triton {version}: "
          f"{len(rows)} kernel launches")
    print(f"{'kernel':28s} {'warps':>5s} {'stages':>6s} {'regs':>4s} {'spill B':>7s} {'shared KB':>9s} "
          f"{'ld.b16':>6s} {'st.b16':>6s} {'ld.v':>4s} {'cp.async':>8s} {'SASS':>6s} {'loop':>5s}  constexprs")
    for r in rows:
        print(f"{r['kernel']:28s} {r['warps']:5d} {r['stages']:6d} {r['regs']:4d} {r['stack']:7d} "
              f"{r['shared_kb']:9.1f} "
              f"{r['scalar_loads']:6d} {r['scalar_stores']:6d} {r['vector_loads']:4d} {r['async_copies']:8d} "
              f"{r['instructions']:6d} {r['loop']:5d}  {r['constexprs']}")


def _run_phase(python: str, argv, phase: str, path: str, interpret: str) -> None:
    """This script's ``phase`` in a fresh process of ``python`` that finds the tree's package, with
    TRITON_INTERPRET=interpret."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET=interpret,
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    subprocess.run([python, os.path.abspath(__file__), *argv, "--phase", phase, "--file", path], env=env, check=True)


if __name__ == "__main__":
    main()
