"""`accel test`: a real short run on N processes through `accel launch`, with a clear verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import EXTENSIONS

from accel.testing.shadow import hide_plugins


def accel_test(
    args: list[str], tmp_path: Path, keep: tuple[str, ...] = ("ddp",), **extra: str
) -> subprocess.CompletedProcess[str]:
    """`accel test` with only the kernel and the ``keep`` plugins visible (other installed plugins hidden); DeepSpeed's
    CPU op is the one the other tests built (``clitools.EXTENSIONS``), not built a second time in ~/.cache.

    mlflow is hidden too: with the mlflow tracker plugin hidden, nothing of the run uses it, but ``import deepspeed``
    imports it when it can (for its autotuner, which ``accel test`` does not run): ~1.5 s of CPU per DeepSpeed
    process, a third of what each process of the DeepSpeed cases imports beyond torch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    shadow = hide_plugins(tmp_path / "shadow", keep=keep)
    (shadow / "mlflow").mkdir()
    (shadow / "mlflow" / "__init__.py").write_text('raise ImportError("mlflow is hidden by this test")\n')
    env.update(ACCEL_HOME=str(tmp_path), PYTHONPATH=str(shadow), TORCH_EXTENSIONS_DIR=EXTENSIONS, **extra)
    return subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", "test", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def ddp_two_processes(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """`accel test -n 2` with ddp alone: one launch shared by the plain check and the ddp case of the strategy
    table (the same command; a launch of 3 processes costs ~10 s of CPU)."""
    return accel_test(["-n", "2"], tmp_path_factory.mktemp("ddp_two_processes"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accel_test_two_cpu_processes_succeeds(ddp_two_processes: subprocess.CompletedProcess[str]) -> None:
    result = ddp_two_processes
    assert result.returncode == 0, result.stdout + result.stderr
    assert "accel test: success: 5 checks passed on each of 2 process(es)" in result.stdout
    assert "plugins: ddp:strategy" in result.stdout
    for process in (0, 1):
        assert f"[process {process}] ok   training" in result.stdout
        assert f"[process {process}] ok   gather_for_metrics" in result.stdout


def test_accel_test_uses_the_config_file(tmp_path: Path) -> None:
    """The default config asks for fp16; no precision plugin is installed, so the launch is refused clearly."""
    (tmp_path / "default_config.yaml").write_text("mixed_precision: fp16\nnum_processes: 1\n")
    result = accel_test([], tmp_path)
    assert result.returncode == 2
    assert "needs a plugin that provides 'precision:fp16'" in result.stderr
    assert "accel test: FAILED: `accel launch` refused these settings" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accel_test_reports_processes_that_die_before_reporting(tmp_path: Path) -> None:
    """A process-group backend this torch build does not have: the workers fail in Kernel() setup."""
    result = accel_test(["-n", "2", "--ddp_backend", "mpi"], tmp_path)
    assert result.returncode == 1
    assert "accel test: FAILED: the processes exited with code" in result.stderr
    assert "before reporting" in result.stderr


def _installed(*names: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in names)


# (strategy plugin, flags, processes that receive the full parameters from get_state_dict). fp16 runs where the
# CPU runs it: with DDP (autocast + GradScaler); FSDP and DeepSpeed refuse fp16 on the CPU before starting.
STRATEGIES = [
    ("ddp", [], 2),
    ("ddp", ["--mixed_precision", "bf16"], 2),
    ("ddp", ["--mixed_precision", "fp16"], 2),
    ("fsdp", [], 1),
    ("fsdp", ["--mixed_precision", "bf16"], 1),
    ("deepspeed", ["--zero_stage", "1"], 1),
    ("deepspeed", ["--zero_stage", "2"], 1),
    ("deepspeed", ["--zero_stage", "3"], 1),
    ("deepspeed", ["--zero_stage", "2", "--mixed_precision", "bf16"], 1),
    ("deepspeed", ["--zero_stage", "3", "--mixed_precision", "bf16"], 1),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # the first DeepSpeed run of a clean workspace builds its CPU op (the suite's first here)
@pytest.mark.parametrize(
    "plugin, flags, holders", STRATEGIES, ids=["-".join([p, *f[1::2]]) or p for p, f, _ in STRATEGIES]
)
def test_accel_test_passes_for_every_strategy_and_precision(
    request: pytest.FixtureRequest, tmp_path: Path, plugin: str, flags: list[str], holders: int
) -> None:
    """Before: `accel test --plugin fsdp -n 2` always failed (the self-check flattened FSDP2's sharded parameters:
    "This operation would remove or reshape sharded dimension 0"). The check now reads the full parameters through
    `kernel.get_state_dict` and compares the model's output on every process."""
    if not _installed(f"accel_{plugin}", *(["deepspeed"] if plugin == "deepspeed" else [])):
        pytest.skip(f"accel-plugin-{plugin} is not installed")
    if plugin == "ddp" and not flags:  # ddp is the default strategy and "no" precision needs no amp: the same run
        result = request.getfixturevalue("ddp_two_processes")
    else:
        result = accel_test(["-n", "2", "--plugin", plugin, *flags], tmp_path, keep=(plugin, "amp"))
    assert result.returncode == 0, result.stdout + result.stderr
    precision = flags[flags.index("--mixed_precision") + 1] if "--mixed_precision" in flags else "no"
    assert f"5 checks passed on each of 2 process(es) (device cpu, mixed precision {precision}" in result.stdout
    assert f"plugins: {plugin}:strategy" in result.stdout
    for process in (0, 1):
        assert (
            f"[process {process}] ok   training: " in result.stdout
            and f"full parameters from get_state_dict on {holders} of 2 process(es) agree" in result.stdout
        )
