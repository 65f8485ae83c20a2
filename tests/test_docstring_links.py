"""Every cross-reference in the package's docstrings (``:func:``, ``:class:``, ``:mod:``, ``:data:``, ``:meth:``,
``:attr:``) names something that exists where it points: a moved function otherwise leaves a link to the wrong
module behind. Targets resolve as Sphinx's Python domain does: absolute (``vqattn.x.y``), relative to the module
(``.utils.name``, ``..common.x``), a bare name in the module, or a method of one of the module's classes."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

ROLE = re.compile(r":(func|class|mod|data|meth|attr):`~?([^`{}]+)`")
PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vqattn"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lookup(dotted: str):
    """The object at a dotted path (the longest importable module, then attributes), or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


def resolves(target: str, module: str, is_package: bool) -> bool:
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        base = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(dots - 1):
            base = base.rsplit(".", 1)[0]
        return lookup(f"{base}.{target.lstrip('.')}") is not None
    if lookup(target) is not None or lookup(f"{module}.{target}") is not None:
        return True
    package = module if is_package else module.rsplit(".", 1)[0]
    if lookup(f"{package}.{target}") is not None:
        return True
    classes = [c for _, c in inspect.getmembers(importlib.import_module(module), inspect.isclass)]
    return "." not in target and any(hasattr(c, target) for c in classes)


def links():
    for path in sorted(PACKAGE.rglob("*.py")):
        for role, target in ROLE.findall(path.read_text()):
            yield path, role, target.strip()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_docstring_link_resolves(path):
    pytest.importorskip("triton")  # the kernels' modules define their jit helpers only with triton installed
    module = module_name(path)
    broken = [f":{role}:`{target}`" for p, role, target in links() if p == path
              and not resolves(target, module, path.name == "__init__.py")]
    assert not broken, f"{path.relative_to(PACKAGE.parent)}: {broken}"


def test_a_wrong_module_is_caught():
    assert not resolves("~vqattn.ops.triton.window_codes.tf32_parts".lstrip("~"), "vqattn.ops.triton.nearest", False)
    assert resolves("vqattn.ops.triton.utils.tf32_parts", "vqattn.ops.triton.nearest", False)
    assert resolves(".utils.THREE_PROGRAMS_REGISTERS", "vqattn.ops.triton.window_codes", False)
