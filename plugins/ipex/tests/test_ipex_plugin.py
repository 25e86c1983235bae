"""accel-plugin-ipex in the main (torch 2.13) venv, where no intel-extension-for-pytorch can run.

The real IPEX 2.8.0 wheel is installed with ``pip install --no-deps --target`` into a cached directory (``.cache/``
in the repository, ~50 MB, fast from pip's cache) and put on ``PYTHONPATH``: importing it there prints IPEX's error
and crashes, so these tests show that the plugin never imports it, that ``accel plugins``/``accel env`` report the
mismatch and exit 0, and that asking for the plugin is one line, exit 2. It runs in ``make test`` (pyproject.toml's
``testpaths`` name it); training with IPEX is tested for real by the other modules here (``make test-ipex``:
torch 2.8.0 + IPEX 2.8.0 in ``.venv-ipex``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from accel.testing import isolated_env, run_tree
from accel.testing.shadow import hide_plugins
from accel_ipex import compatibility_problem

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
IPEX_WHEEL = "intel-extension-for-pytorch==2.8.0"
CACHE = REPO / ".cache" / "ipex-2.8.0-nodeps"
PROBE = str(REPO / "tests" / "scripts" / "cli_probe.py")  # the CLI probe the main suite uses
TORCH = md.version("torch")
IPEX_PLUGIN_VERSION = md.version("accel-plugin-ipex")  # the installed plugin, whatever release
MISMATCH = f"intel-extension-for-pytorch 2.8.0 needs torch 2.8.*, found {TORCH}: install torch==2.8.*"


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment for an ``accel`` subprocess (accel.testing.isolated_env): no accel, Accelerate or
    launcher variables, every config lookup place inside ``home``, and ``PYTHONPATH`` only what ``extra`` gives."""
    env = isolated_env(home / "accel_home", extra={"HOME": str(home / "user"), "PYTHONUNBUFFERED": "1", **extra})
    (home / "accel_home").mkdir(parents=True, exist_ok=True)
    env.pop("XDG_CACHE_HOME", None)
    env["PYTHONPATH"] = extra.get("PYTHONPATH", "")
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``accel ARGS``, waiting for every process it starts (accel.testing.run_tree)."""
    return run_tree([str(Path(sys.executable).parent / "accel"), *args], env=env, timeout=240)


def real_ipex_wheel() -> Path:
    """IPEX 2.8.0 (no dependencies) in ``.cache/``; installed once, then reused (written aside and renamed into
    place, so an interrupted install is never taken for a complete one)."""
    if (CACHE / "intel_extension_for_pytorch-2.8.0.dist-info").is_dir():
        return CACHE
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ipex-", dir=CACHE.parent))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(tmp),
            IPEX_WHEEL,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"pip could not install {IPEX_WHEEL}: {proc.stdout}{proc.stderr}")
    try:
        tmp.rename(CACHE)
    except OSError:  # another run put it there first
        shutil.rmtree(tmp, ignore_errors=True)
    return CACHE


@pytest.fixture(scope="module")
def shown(tmp_path_factory) -> Path:
    """Every published plugin but ddp and ipex hidden, so the tests see the same plugins in any venv."""
    return hide_plugins(tmp_path_factory.mktemp("hidden"), keep=("ddp", "ipex"))


@pytest.fixture(scope="module")
def wheel() -> Path:
    return real_ipex_wheel()


@pytest.fixture
def env(tmp_path: Path, shown: Path, wheel: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=os.pathsep.join([str(shown), str(wheel)]), COLUMNS="250")


def one_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, result
    err_lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "Traceback" not in result.stderr, result
    assert "ERROR! Intel" not in result.stdout + result.stderr, result  # IPEX was never imported
    line = err_lines[0]
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ---- the compatibility rule (no packages needed) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "ipex, torch, expected",
    [
        ("2.8.0", "2.8.0", None),
        ("2.8.0+cpu", "2.8.0+cu128", None),
        ("2.8.10+xpu", "2.8.0+xpu", None),
        (
            "2.8.0",
            "2.13.0+cpu",
            "intel-extension-for-pytorch 2.8.0 needs torch 2.8.*, found 2.13.0+cpu: install "
            "torch==2.8.* or uninstall intel-extension-for-pytorch (its last release is 2.8: none "
            "supports torch 2.13)",
        ),
        (
            "2.8.0",
            "2.7.1",
            "intel-extension-for-pytorch 2.8.0 needs torch 2.8.*, found 2.7.1: install torch==2.8.* or "
            "install intel-extension-for-pytorch==2.7.*",
        ),
        (None, "2.13.0", "intel-extension-for-pytorch is not installed"),
        ("2.8.0", None, "intel-extension-for-pytorch 2.8.0 is installed but torch is not"),
    ],
)
def test_ipex_needs_the_same_torch_major_minor(ipex, torch, expected):
    problem = compatibility_problem(ipex, torch)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected) and "\n" not in problem


# ---- discovery in this venv (the plugin installed by `make setup`, IPEX absent) ----------------------------------


def test_entry_point_and_no_heavy_import(tmp_path):
    (ep,) = [e for e in md.entry_points(group="accel") if e.name == "ipex"]
    assert ep.value == "accel_ipex" and ep.dist.metadata["Name"] == "accel-plugin-ipex"
    requires = md.requires("accel-plugin-ipex") or []
    assert not [r for r in requires if r.startswith("intel-extension-for-pytorch") and "extra ==" not in r]
    code = (
        "import sys, accel_ipex, accel_ipex.optimizer; print(accel_ipex.accel_unavailable_reason()); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'intel_extension_for_pytorch')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    reason, modules = proc.stdout.splitlines()
    assert modules == "[]"
    assert reason.startswith("intel-extension-for-pytorch is not installed")  # this venv must never get IPEX


def test_without_ipex_installed_plugins_shows_it_unavailable(tmp_path, shown):
    result = run(["plugins", "--json"], clean_env(tmp_path, PYTHONPATH=str(shown)))
    assert result.returncode == 0, result
    row = {r["name"]: r for r in json.loads(result.stdout)}["ipex"]
    assert row["status"] == "unavailable"
    assert row["reason"].startswith("intel-extension-for-pytorch is not installed: install torch==2.8.*")
    assert "accel_prepare_training" in row["hooks"]  # the component's hooks, read without torch


# ---- the real IPEX 2.8.0 wheel next to torch 2.13 ----------------------------------------------------------------


def test_the_real_wheel_crashes_on_import_here(env):
    """What the plugin must avoid: importing IPEX 2.8.0 with this torch prints its error and dies."""
    proc = subprocess.run(
        [sys.executable, "-c", "import intel_extension_for_pytorch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "needs to work with PyTorch 2.8.*" in proc.stdout + proc.stderr


def test_plugins_json_and_table_show_the_mismatch(env):
    result = run(["plugins", "--json"], env)
    assert result.returncode == 0, result
    row = {r["name"]: r for r in json.loads(result.stdout)}["ipex"]
    assert row["status"] == "unavailable" and row["reason"].startswith(MISMATCH), row
    assert row["distribution"] == "accel-plugin-ipex"
    table = run(["plugins"], env)
    assert table.returncode == 0, table
    assert "unavailable: intel-extension-for-pytorch 2.8.0 needs torch 2.8.*" in " ".join(table.stdout.split())
    assert "ERROR! Intel" not in result.stdout + result.stderr + table.stdout + table.stderr


def test_env_shows_the_mismatch(env):
    result = run(["env"], env)
    assert result.returncode == 0, result
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("- `Plugin ipex`")]
    assert line.startswith(f"- `Plugin ipex`: accel-plugin-ipex {IPEX_PLUGIN_VERSION}: unavailable (" + MISMATCH), line
    assert "ERROR! Intel" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args, extra_env, config, where",
    [
        (
            ["--plugin", "ipex"],
            {},
            None,
            f"plugin 'ipex' (accel-plugin-ipex {IPEX_PLUGIN_VERSION}) cannot be used here: ",
        ),
        (["--ipex"], {}, None, "--use_ipex needs plugin 'ipex'"),
        ([], {"ACCELERATE_USE_IPEX": "true"}, None, "environment variable ACCELERATE_USE_IPEX needs plugin 'ipex'"),
        ([], {}, "ipex_config:\n  ipex: true\n", "config key `ipex_config.ipex` needs plugin 'ipex'"),
    ],
    ids=["plugin", "flag", "env", "config"],
)
def test_asking_for_it_is_one_line_exit_2(env, tmp_path, args, extra_env, config, where):
    if config is not None:
        (tmp_path / "cfg.yaml").write_text(config)
        args = ["--config_file", str(tmp_path / "cfg.yaml")]
    marker = tmp_path / "started"
    one_error(run(["launch", *args, PROBE, "--touch", str(marker)], {**env, **extra_env}), where, MISMATCH)
    assert not marker.exists()


def test_accelerate_config_with_ipex_off_still_runs(env, tmp_path):
    (tmp_path / "cfg.yaml").write_text(
        "distributed_type: 'NO'\nipex_config:\n  ipex: false\n  use_xpu: false\n"
        "mixed_precision: 'no'\nnum_processes: 1\n"
    )
    result = run(["launch", "--config_file", str(tmp_path / "cfg.yaml"), PROBE], env)
    assert result.returncode == 0, result
    assert "PROBE rank=0 world=1" in result.stdout and "'ipex'" not in result.stdout


@pytest.mark.parametrize("kwargs", ["plugins=['ipex']", "use_ipex=True"])
def test_kernel_refuses_it_with_the_reason(env, kwargs):
    code = (
        f"from accel import Kernel, UsageError\ntry:\n    Kernel({kwargs})\nexcept UsageError as exc:\n"
        "    print('USAGE', exc)\nelse:\n    print('NO ERROR')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert line.startswith("USAGE ") and MISMATCH in line, line
    assert "ERROR! Intel" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("provides, refused", [({"distributed", "sharding"}, True), ({"distributed"}, False)])
def test_strategies_are_refused_by_their_sharding_declaration_not_their_name(provides, refused):
    """The component refuses a strategy that declares ``sharding`` (whatever its name) and accepts one that does not
    (it then goes on to import IPEX, which fails here for another reason)."""
    from types import SimpleNamespace

    from accel import Component, UsageError
    from accel.options import Settings, resolve
    from accel.plugins import Plugins
    from accel_ipex.optimizer import IpexOptimizer

    plugins = Plugins.load(env={"ACCEL_PLUGINS": "ipex"})
    values, sources = resolve(plugins.options(), kwargs={}, env={})
    component = IpexOptimizer(Settings(values, sources, world_size=1, phase="run", env={}))
    strategy = Component()
    strategy.name, strategy.role, strategy.provides = "anyname", "strategy", frozenset(provides)
    with pytest.raises(UsageError) as info:
        component.accel_setup(SimpleNamespace(components=[strategy, component]))
    assert ("cannot be combined with the 'anyname' strategy" in str(info.value)) == refused, info.value
