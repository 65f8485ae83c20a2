"""The layers of the op library: the block machinery that the ops share (``vqattn/ops/common``) imports nothing from
the fused kernels (``vqattn/ops/triton``), which import it. Whether the kernels can run is
:mod:`vqattn.ops.utils`, which imports no kernel."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "vqattn" / "ops" / "common"
KERNELS = "vqattn.ops.triton"


def imported_modules(source: str, package: str) -> set[str]:
    """The absolute names of everything a module of ``package`` imports, relative imports resolved (``from ..x
    import y``: both ``..x`` and ``..x.y``, which may be a module), function-level imports included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def kernel_imports(names: set[str]) -> set[str]:
    return {name for name in names if name == KERNELS or name.startswith(KERNELS + ".")}


@pytest.mark.parametrize("path", sorted(COMMON.glob("*.py")), ids=lambda p: p.name)
def test_common_imports_nothing_from_the_kernels(path):
    assert not kernel_imports(imported_modules(path.read_text(), "vqattn.ops.common")), path.name


def test_relative_imports_resolve():
    """What the check above catches, and what it lets through."""
    assert kernel_imports(imported_modules("from ..triton import triton_device\n", "vqattn.ops.common"))
    assert kernel_imports(imported_modules("from .. import triton\n", "vqattn.ops.common"))
    assert kernel_imports(imported_modules("import vqattn.ops.triton.utils\n", "vqattn.ops.common"))
    assert not kernel_imports(imported_modules("from ..utils import triton\nfrom .statistics import x\n",
                                               "vqattn.ops.common"))


def test_common_imports_first_in_a_fresh_interpreter():
    """Every module of ``ops/common`` imports first, without loading a kernel module."""
    modules = [f"vqattn.ops.common.{p.stem}" for p in sorted(COMMON.glob("*.py")) if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"assert not [m for m in sys.modules if m == {KERNELS!r} or m.startswith({KERNELS + '.'!r})], "
            "sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


PACKAGE = ROOT / "vqattn"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imported_modules(path.read_text(), package)


def inside(names: set[str], package: str) -> set[str]:
    return {n for n in names if n == package or n.startswith(package + ".")}


@pytest.mark.parametrize("path", sorted((PACKAGE / "train").rglob("*.py")), ids=lambda p: p.name)
def test_the_trainer_imports_nothing_from_the_hf_package(path):
    """The layers of the package, bottom up: the library (ops, layers, model, tokenizer, checkpoint), the trainer
    (vqattn.train), the Hugging Face integration (vqattn.hf, which may read the trainer's corpus). An arrow up from
    the trainer to hf would make the two a cycle."""
    assert not inside(imports_of(path), "vqattn.hf"), path.name


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py")
                                        if p.relative_to(PACKAGE).parts[0] not in {"train", "hf"}),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_imports_neither_the_trainer_nor_hf(path):
    names = imports_of(path)
    assert not inside(names, "vqattn.train") | inside(names, "vqattn.hf"), path
