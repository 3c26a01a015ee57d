"""The package's layout: the root is the public face, folders depend on no root module
but the private bases, every public name imports."""

from __future__ import annotations

import ast
import importlib
import re
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
        if len(parts) == 1:  # the root itself: only its private bases and folders, by name
            bad.extend(
                f"{line}: {module}.{n}"
                for n in names
                if n not in IMPORTABLE_FROM_ROOT and not (PACKAGE / n).is_dir()
            )
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


@pytest.mark.parametrize(("old", "new"), [("Drainer", "Lanes"), ("run_drain", "run_one")])
def test_a_levels_name_0_1_0_exported_still_imports_with_a_warning(old, new):
    levels = importlib.import_module("dcp_multilevel.levels")
    with pytest.warns(DeprecationWarning) as caught:
        renamed = getattr(levels, old)
    assert renamed is getattr(importlib.import_module("dcp_multilevel.levels.lanes"), new)
    assert str(caught[0].message) == (
        f"dcp_multilevel.levels.{old} is renamed dcp_multilevel.levels.{new}; use the new "
        "name (the old one goes in the next major release)"
    )


#: A save and a load without levels, in a fresh interpreter: which of the package's
#: modules it loaded, and the threads left.
_SINGLE_LOCATION = """
import sys, tempfile, threading, warnings
import torch
import torch.distributed.checkpoint as dcp
from dcp_multilevel import MultiLevelReader, MultiLevelWriter
warnings.simplefilter("ignore")
path = tempfile.mkdtemp()
state = {"w": torch.arange(8.0)}
dcp.save(state, storage_writer=MultiLevelWriter(path))
dcp.load(state, storage_reader=MultiLevelReader(path))
print(",".join(sorted(m for m in sys.modules if m.startswith("dcp_multilevel."))))
print(",".join(t.name for t in threading.enumerate() if t.name.startswith("dcp-ml")))
"""


def test_a_save_and_load_without_levels_load_none_of_the_levels_machinery():
    r = subprocess.run(
        [sys.executable, "-c", _SINGLE_LOCATION],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    modules, threads = r.stdout.splitlines()
    levels = [m for m in modules.split(",") if m.startswith("dcp_multilevel.levels")]
    assert levels == ["dcp_multilevel.levels", "dcp_multilevel.levels.config"]
    assert threads == ""


def test_every_folder_is_a_package():
    """A folder without ``__init__.py`` imports as an empty namespace package and hides
    a stale import until a name is used."""
    folders = {p.parent for p in _modules()}
    assert (
        sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists())
        == []
    )


def test_every_module_the_docs_name_exists():
    """``folder/module.py`` in the docs names a file that exists: a module of the package
    (``levels/runtime.py``) or of the repository (``examples/node_loss.py``)."""
    repo = PACKAGE.parent
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    named = {
        (page.name, m)
        for page in pages
        for m in re.findall(r"`(?:dcp_multilevel/)?([a-z_]+/[a-z_]+\.py)`", page.read_text())
    }
    missing = sorted(
        f"{page}: {m}"
        for page, m in named
        if not (PACKAGE / m).exists() and not (repo / m).exists()
    )
    assert missing == []
