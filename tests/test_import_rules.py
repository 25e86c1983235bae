"""The plugin API layer and the import rules `make lint` enforces (pyproject.toml [tool.importlinter],
tools/import_contracts.py): plugins import from accel only accel.spi, the kernel library never imports accel.commands,
no import cycle among kernel modules (type-only imports counted). The rules are run on a copy of the kernel with a
planted violation, to see that each fails and names the import."""

from __future__ import annotations

import ast
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


def test_plugins_import_from_accel_only_spi() -> None:
    """The source rule, as plain reading of the files (plugin tests too, which lint-imports does not see): a plugin
    imports accel.spi; its tests may also drive a training run (accel.Kernel, the user API) and the test kit
    (accel.testing). plugins/fsdp and plugins/parallel are converted by another branch."""
    found = []
    for path in sorted(ROOT.glob("plugins/*/**/*.py")):
        plugin = path.relative_to(ROOT).parts[1]
        if plugin in ("fsdp", "parallel") or path.relative_to(ROOT).as_posix() in moved_from_tests():
            continue
        in_tests = "tests" in path.relative_to(ROOT).parts
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "accel":
                module = node.module
                names = {a.name for a in node.names}
                ok = module == "accel.spi" or (
                    in_tests
                    and (
                        module.startswith("accel.testing") or (module == "accel" and names <= {"Kernel", "load_model"})
                    )
                )
                if not ok:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {module} import {sorted(names)}")
    assert not found, "plugins import from accel only accel.spi:\n" + "\n".join(found)


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
    for c in CONFIG["contracts"]:
        assert f"{c['name']} {'BROKEN' if c['id'] == broken else 'KEPT'}" in out, out
    assert NAMED[broken] in out, out
