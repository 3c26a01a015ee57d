"""The package's layout: the root is the public face, folders depend on no root module
but the private bases, every public name imports."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_multilevel

PACKAGE = Path(dcp_multilevel.__file__).parent

#: What the package root holds: the public face and the private bases every folder uses.
ROOT_MODULES = {
    "__init__",
    "__main__",
    "abc",
    "errors",
    "_version",
    "_dist",
    "_registry",
    "_phases",
}
#: The root modules a folder may import.
IMPORTABLE_FROM_ROOT = {"errors", "_version", "_dist", "_registry", "_phases"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _root_imports(source: str, package: str) -> list[str]:
    """The imports in ``source`` (a module of ``package``) of the package's root:
    its public face, or a root module a folder may not import; ``line: module``."""
    bad = []

    def check(line: int, module: str, names: list[str]) -> None:
        parts = module.split(".")
        if parts[0] != "dcp_multilevel":
            return
        if len(parts) == 1:  # the root itself: only its private bases, by name
            bad.extend(f"{line}: {module}.{n}" for n in names if n not in IMPORTABLE_FROM_ROOT)
        elif (PACKAGE / f"{parts[1]}.py").exists() and parts[1] not in IMPORTABLE_FROM_ROOT:
            bad.append(f"{line}: {module}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(node.lineno, alias.name, ["*"] if alias.name == "dcp_multilevel" else [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            check(node.lineno, module, [alias.name for alias in node.names])
    return bad


def test_the_root_holds_only_the_public_face_and_the_private_bases():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES


def test_no_folder_imports_a_root_module_but_the_private_bases():
    bad = []
    for path in _modules():
        if path.parent == PACKAGE:
            continue
        package = ".".join(("dcp_multilevel", *path.relative_to(PACKAGE).parent.parts))
        rel = path.relative_to(PACKAGE)
        bad += [f"{rel}:{b}" for b in _root_imports(path.read_text(), package)]
    assert bad == []


def test_the_import_check_sees_a_folder_importing_the_root():
    # The check above must be able to fail: each spelling of an import of the
    # root's face, or of a root module other than the private bases, is reported.
    source = (
        "from .. import _dist\n"
        "from ..errors import ConfigError\n"
        "from .. import MultiLevelWriter\n"
        "from dcp_multilevel import Level\n"
        "import dcp_multilevel\n"
        "from . import __main__\n"
        "from .._dist import rank\n"
        "import dcp_multilevel.__main__\n"
        "from ..levels.options import Level\n"
    )
    assert _root_imports(source, "dcp_multilevel.plugin") == [
        "3: dcp_multilevel.MultiLevelWriter",
        "4: dcp_multilevel.Level",
        "5: dcp_multilevel.*",
        "8: dcp_multilevel.__main__",
    ]
    # From a folder two deep, ``..`` is the folder above, ``...`` the root.
    assert _root_imports("from .. import __main__\n", "dcp_multilevel.a.b") == []
    assert _root_imports("from ... import __main__\n", "dcp_multilevel.a.b") == [
        "1: dcp_multilevel.__main__"
    ]


def test_every_public_name_imports_from_the_package():
    # In a fresh interpreter: nothing this test process imported before helps.
    names = ", ".join(dcp_multilevel.__all__)
    code = f"from dcp_multilevel import {names}; print('ok')"
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr
    for name in dcp_multilevel.__all__:
        assert getattr(dcp_multilevel, name) is not None
    plugin = importlib.import_module("dcp_multilevel.plugin")
    assert plugin.__all__ == ["BalancedSavePlanner", "MultiLevelReader", "MultiLevelWriter"]


def test_no_code_is_folded_past_the_formatter():
    """A module is one idea whatever its length: nothing is folded with ``# fmt: skip``
    (or ``# fmt: off``) to look shorter."""
    repo = PACKAGE.parent
    folded = [
        f"{p.relative_to(repo)}:{n}"
        for folder in ("dcp_multilevel", "tests", "benchmarks", "examples")
        for p in sorted((repo / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if line.rstrip().endswith(("# fmt: skip", "# fmt: off"))
    ]
    assert folded == []


@pytest.mark.parametrize(
    ("name", "module"),
    [("ManifestError", "dcp_multilevel.errors"), ("SavePolicy", "dcp_multilevel.schedule")],
)
def test_a_name_0_1_0_exported_at_the_root_still_imports_with_a_warning(name, module):
    with pytest.warns(DeprecationWarning) as caught:
        moved = getattr(dcp_multilevel, name)
    assert moved is getattr(importlib.import_module(module), name)
    assert str(caught[0].message) == (
        f"dcp_multilevel.{name} moved to {module}.{name}; import it from there (the old name "
        "goes in the next major release)"
    )
    assert name not in dcp_multilevel.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        dcp_multilevel.Nope  # noqa: B018
