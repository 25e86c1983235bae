"""The plugin API layer and the import rules `make lint` enforces (pyproject.toml [tool.importlinter],
tools/import_contracts.py): plugins import from accel only accel.spi, the kernel library never imports accel.commands,
no import cycle among kernel modules (type-only imports counted). The rules are run on a copy of the kernel with a
planted violation, to see that each fails and names the import."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
PLUGIN_PACKAGES = sorted(p.name for p in ROOT.glob("plugins/*/src/accel_*") if not p.name.endswith(".egg-info"))


def contract(contract_id: str) -> dict[str, object]:
    return next(c for c in CONFIG["contracts"] if c["id"] == contract_id)


def test_spi_imports_without_torch_and_every_name_resolves() -> None:
    code = (
        "import sys\n"
        "import accel.spi as spi\n"
        "assert 'torch' not in sys.modules, 'import accel.spi imported torch'\n"
        "missing = [n for n in spi.__all__ if not hasattr(spi, n)]\n"
        "assert not missing, missing\n"
        "assert sorted(spi.__all__) == spi.__dir__()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_plugin_package_is_checked() -> None:
    assert sorted(set(CONFIG["root_packages"]) - {"accel"}) == PLUGIN_PACKAGES
    assert sorted(contract("plugin-api")["importers"]) == PLUGIN_PACKAGES  # type: ignore[arg-type]


def moved_from_tests() -> set[str]:
    """The modules tools/relayout.py moved from tests/ into plugins/<name>/tests: they test the plugin through the
    kernel's internals, as they did in tests/, so the plugin-author rule below is not theirs."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import relayout
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return {f"{dest}/{name}" for dest, names in relayout.MOVES.items() for name in names}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def accel_imports(path: Path) -> list[tuple[int, str, str]]:
    """The imports of accel in ``path``: (line, what lint-imports sees imported, the statement as written). ``from
    accel import X`` imports ``accel.X`` when X is a module (``spi``) and the package ``accel`` otherwise; both are
    given as ``accel.X``, which lies inside ``accel.spi`` only for ``spi``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "accel"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "accel":
                continue
            names = [a.name for a in node.names]
            written = f"from {node.module} import {', '.join(names)}"
            targets = [f"accel.{n}" for n in names] if node.module == "accel" else [node.module]
            found += [(node.lineno, target, written) for target in targets]
    return found


#: What a plugin's tests may import of accel besides the plugin API: the test kit and the user API (``import accel``,
#: ``from accel import Kernel``/``load_model``) a test drives a training run with.
TEST_ALLOWED = ("accel.spi", "accel.testing")
USER_API = {"accel", "accel.Kernel", "accel.load_model"}


def plugin_violations(plugin: Path, root: Path = ROOT, exempt: frozenset[str] = frozenset()) -> list[str]:
    """Every import of accel under ``plugin`` (a folder ``plugins/<name>``) that breaks the rule: its code
    imports accel.spi and its submodules only (lint-imports' ``plugin-api`` contract, read from the source, so a
    plugin missing from pyproject.toml's contract is still checked); its tests and their scripts may also import
    ``TEST_ALLOWED`` and ``USER_API``. ``exempt``: files (relative to ``root``) the rule does not apply to."""
    found = []
    for path in sorted(plugin.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.as_posix() in exempt:
            continue
        in_tests = "tests" in rel.parts
        allowed = TEST_ALLOWED if in_tests else ("accel.spi",)
        for line, imported, written in accel_imports(path):
            if not any(_within(imported, a) for a in allowed) and not (in_tests and imported in USER_API):
                found.append(f"{rel}:{line} {written}")
    return found


PLUGIN_FOLDERS = sorted(
    p.name for p in (ROOT / "plugins").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
)


def test_every_plugin_folder_is_a_plugin_package() -> None:
    """The folders the rule below walks are the plugins lint-imports checks (none missed by either)."""
    assert PLUGIN_FOLDERS and [f"accel_{name}" for name in PLUGIN_FOLDERS] == PLUGIN_PACKAGES


@pytest.mark.parametrize("plugin", PLUGIN_FOLDERS)
def test_plugins_import_from_accel_only_spi(plugin: str) -> None:
    """The source rule, as plain reading of the files (plugin tests too, which lint-imports does not see)."""
    found = plugin_violations(ROOT / "plugins" / plugin, exempt=frozenset(moved_from_tests()))
    assert not found, "plugins import from accel only accel.spi:\n" + "\n".join(found)


def test_the_rule_finds_a_planted_violation_in_a_new_plugin(tmp_path: Path) -> None:
    """A plugin folder nobody listed is walked like the others, and each kind of forbidden import is named."""
    plugin = tmp_path / "plugins" / "planted"
    (plugin / "src" / "accel_planted").mkdir(parents=True)
    (plugin / "tests").mkdir()
    (plugin / "src" / "accel_planted" / "__init__.py").write_text(
        "from accel.spi import hookimpl\nfrom accel.spi.sharded import ShardConfig\nfrom . import strategy\n"
        "from accel.kernel import Kernel\nimport accel.plugins\nfrom accel import spi, Kernel\n"
    )
    (plugin / "tests" / "test_planted.py").write_text(
        "import accel\nfrom accel import Kernel, load_model\nfrom accel.testing import make_kernel\n"
        "from accel.spi import Component\nfrom accel.options import resolve\nfrom accel import Settings\n"
    )
    assert plugin_violations(plugin, root=tmp_path) == [
        "plugins/planted/src/accel_planted/__init__.py:4 from accel.kernel import Kernel",
        "plugins/planted/src/accel_planted/__init__.py:5 import accel.plugins",
        "plugins/planted/src/accel_planted/__init__.py:6 from accel import spi, Kernel",
        "plugins/planted/tests/test_planted.py:5 from accel.options import resolve",
        "plugins/planted/tests/test_planted.py:6 from accel import Settings",
    ]


def ini(config: dict[str, object]) -> str:
    """``config`` ([tool.importlinter] of pyproject.toml) in import-linter's INI format."""

    def value(v: object) -> str:
        return (
            "".join(f"\n    {x}" for x in v)
            if isinstance(v, list)
            else str(v).lower()
            if isinstance(v, bool)
            else str(v)
        )

    lines = ["[importlinter]"]
    lines += [f"{k} = {value(v)}" for k, v in config.items() if k != "contracts"]
    for c in config["contracts"]:  # type: ignore[attr-defined]
        lines += ["", f"[importlinter:contract:{c['id']}]"]
        lines += [f"{k} = {value(v)}" for k, v in c.items() if k != "id" and v != []]
    return "\n".join(lines) + "\n"


PLANTS = {
    # a plugin that imports a kernel module outside the plugin API
    "plugin-api": {
        "accel_planted/__init__.py": "from accel.spi import hookimpl\nfrom accel.kernel import Kernel\n",
    },
    # two kernel modules that import each other, for annotations only
    "kernel-acyclic": {
        "accel/planted_a.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from accel.planted_b import B\n",
        "accel/planted_b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from accel.planted_a import A\n",
    },
}
NAMED = {
    "plugin-api": "accel_planted -> accel.kernel (l.2)",
    "kernel-acyclic": "accel.planted_a -> accel.planted_b (l.4)",
}


@pytest.mark.parametrize("broken", sorted(PLANTS))
def test_rules_fail_on_a_planted_violation_naming_the_import(tmp_path: Path, broken: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kernel" / "src" / "accel", src / "accel", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "accel_planted").mkdir()
    (src / "accel_planted" / "__init__.py").write_text("from accel.spi import hookimpl\n")
    for name, text in PLANTS[broken].items():
        (src / name).write_text(text)
    config = {**CONFIG, "root_packages": ["accel", "accel_planted"]}
    config["contracts"] = [
        {**c, "importers": ["accel_planted"], "ignore_imports": []} if c["id"] == "plugin-api" else c
        for c in CONFIG["contracts"]
    ]
    (tmp_path / "importlinter.ini").write_text(ini(config))
    result = subprocess.run(
        [LINT_IMPORTS, "--config", str(tmp_path / "importlinter.ini"), "--no-cache"],
        cwd=ROOT,  # tools.import_contracts is imported from here
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    for c in CONFIG["contracts"]:  # import-linter leaves out the space after a name longer than its column
        assert re.search(rf"{re.escape(c['name'])} ?{'BROKEN' if c['id'] == broken else 'KEPT'}\n", out), out
    assert NAMED[broken] in out, out
