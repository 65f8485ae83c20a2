"""Packaging: the library is torch-only; the trainer stack is the ``train`` extra, used only by vqattn.train and
vqattn.analysis; the trainer's configs ship inside the package."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vqattn"
TRAINER_STACK = ("lightning", "lightning_fabric", "pytorch_lightning", "hydra", "omegaconf", "datasets", "matplotlib",
                 "torchmetrics")
# the subpackages of vqattn allowed to import TRAINER_STACK (hf: an extra, whose lm-eval tasks load data with datasets)
TRAINER_PACKAGES = ("train", "analysis", "hf")
HF_STACK = ("transformers", "safetensors", "lm_eval", "accelerate", "peft")


def imported_top_level(path: Path) -> set[str]:
    """Top-level names of the absolute imports anywhere in a module (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def core_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in TRAINER_PACKAGES]


def test_the_core_is_found():
    assert {"model.py", "functional.py", "codebook.py"} <= {p.name for p in core_modules()}


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_modules_do_not_import_the_trainer_stack(path):
    assert imported_top_level(path).isdisjoint(TRAINER_STACK)


# outside vqattn.hf, the functions that import transformers where they run: the tokenizer reads a transformers
# tokenizer directory (data.tokenizer=DIR) and writes one beside a trained BPE, which need the hf extra
HF_READERS = {"tokenizer.py": {"backend_tokenizer", "transformers_tokenizer"}}


def hf_importers(path: Path) -> set[str]:
    """The names of the functions of a module that import the HF stack, "<module>" for an import at the top."""
    tree, found = ast.parse(path.read_text()), set()
    for node in tree.body:
        owners = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else ["<module>"]
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                names = {alias.name.split(".")[0] for alias in inner.names}
            elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                names = {inner.module.split(".")[0]}
            else:
                continue
            if names & set(HF_STACK):
                found |= set(owners)
    return found


def test_only_vqattn_hf_imports_the_hf_stack():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "hf"]
    assert outside and {p.name: hf_importers(p) for p in outside if hf_importers(p)} == HF_READERS


LIBRARY = ["vqattn.functional", "vqattn.layers", "vqattn.model", "vqattn.codebook", "vqattn.feature_maps"]

IMPORT_EACH_FIRST = """
import importlib, json, sys
import torch
trainer_stack = json.loads(sys.argv[1])
failed = []
for module in sys.argv[2:]:
    for name in [m for m in sys.modules if m == "vqattn" or m.startswith("vqattn.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except ImportError as err:
        failed.append(f"{module}: {err}")
    pulled = sorted(m for m in trainer_stack if m in sys.modules)
    if pulled:  # the first module to pull one (they stay imported)
        failed.append(f"{module} imports the trainer stack: {pulled}")
        break
print("\\n".join(failed))
"""


@pytest.mark.slow  # a fresh import of each of ~90 modules: seconds
def test_every_core_module_imports_first_on_its_own_and_imports_no_trainer_package():
    """``from vqattn.ops.window import window_attention`` in a fresh interpreter: no circular import, whichever
    module comes first (each one imported into a process that holds no vqattn module yet); and none of them, the
    library's public modules among them, pulls a trainer package in (sys.modules checked after each: the first to
    pull one is named). One process for both: most of it is imports."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in core_modules()]
    assert set(LIBRARY) <= set(modules)
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST, json.dumps(TRAINER_STACK), *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", proc.stdout


WITHOUT_TRITON = """
import importlib.abc, sys


class NoTriton(importlib.abc.MetaPathFinder):  # as on a machine where triton does not install
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError(f"No module named {name!r}")


sys.meta_path.insert(0, NoTriton())
import importlib
import torch
for module in sys.argv[1:]:
    importlib.import_module(module)
from vqattn.layers import ATTENTIONS, build_attention
from vqattn.ops.utils import triton
assert triton is None
for name in ATTENTIONS:
    x = torch.randn(2, 40, 32, requires_grad=True)
    out = build_attention(name, dim=32, num_heads=2)(x)
    (out.output.square().sum() + out.aux_loss).backward()
    assert torch.isfinite(x.grad).all(), name
print("ok")
"""


def test_the_core_imports_and_runs_without_triton():
    """The op library needs torch alone: with triton absent (macOS, Windows, a bare CPU machine), every core module
    imports and every registered layer runs forward and backward on its PyTorch forms."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in core_modules()]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_core_depends_on_torch_alone_and_extras_hold_the_trainer():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.4"]  # 2.4: nn.RMSNorm
    train = {req.split(">")[0].split("<")[0].split("=")[0] for req in project["optional-dependencies"]["train"]}
    assert {"lightning", "torchmetrics", "datasets", "hydra-core", "matplotlib", "numpy"} <= train
    assert set(project["optional-dependencies"]["dev"]) >= {"vqattn[train]"}
    assert project["scripts"]["vqattn-train"] == "vqattn.train.entry:main"  # it imports the trainer itself


def test_every_config_file_ships_as_package_data():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["vqattn.train.conf"]
    conf = PACKAGE / "train" / "conf"
    shipped = {p for pattern in patterns for p in conf.glob(pattern)}
    assert set(conf.rglob("*.yaml")) == shipped
