"""Packaging: the library is torch-only; the trainer stack is the ``train`` extra."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER_STACK = ("lightning", "lightning_fabric", "pytorch_lightning", "hydra", "omegaconf", "datasets", "matplotlib",
                 "torchmetrics")


@pytest.mark.parametrize("module", ["vqattn.functional", "vqattn.layers", "vqattn.model", "vqattn.codebook",
                                    "vqattn.feature_maps"])
def test_library_imports_no_trainer_package(module):
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in {TRAINER_STACK!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()}"


def test_core_depends_on_torch_alone_and_extras_hold_the_trainer():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.4"]  # 2.4: nn.RMSNorm
    train = {req.split(">")[0].split("<")[0].split("=")[0] for req in project["optional-dependencies"]["train"]}
    assert {"lightning", "torchmetrics", "datasets", "hydra-core", "matplotlib", "numpy"} <= train
    assert set(project["optional-dependencies"]["dev"]) >= {"vqattn[train]"}
