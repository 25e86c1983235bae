"""accel-plugin-parallel: configuration the Accelerate way (launch flags, the ``parallelism_config`` YAML section,
``Kernel(parallelism_config=...)``), the refusals (one line each) and the mesh that ``--dry-run`` shows."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel import Kernel, UsageError
from accel_parallel import MeshPlan

ACCEL = str(Path(sys.executable).parent / "accel")


def accel(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "PARALLELISM_"))}
    env.update(ACCEL_HOME=str(tmp / "home"))
    (tmp / "train.py").write_text("print('hello')\n")
    return subprocess.run([ACCEL, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_mesh_coordinates_groups_and_data_shards() -> None:
    plan = MeshPlan((1, 2, 1, 2))  # dp_replicate, dp_shard, cp, tp: tp innermost, as init_device_mesh lays ranks
    assert plan.world == 4 and plan.dp_size == 2
    assert plan.groups("tp") == [[0, 1], [2, 3]] and plan.groups("dp_shard") == [[0, 2], [1, 3]]
    assert [plan.dp_index(r) for r in range(4)] == [0, 0, 1, 1]  # one tp group reads one data shard
    hsdp = MeshPlan((2, 2, 1, 1))
    assert [hsdp.dp_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert hsdp.groups("dp_replicate") == [[0, 2], [1, 3]]
    cp = MeshPlan((1, 2, 2, 2))
    assert cp.dp_size == 2 and [cp.dp_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.describe()[0] == "mesh: dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (4 processes)"


def test_dry_run_shows_the_mesh_from_accelerates_flags(tmp_path: Path) -> None:
    proc = accel(
        tmp_path,
        "launch",
        "--dry-run",
        "-n",
        "4",
        "--use_parallelism_config",
        "--parallelism_config_dp_shard_size",
        "2",
        "--parallelism_config_tp_size",
        "2",
        "train.py",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mesh: dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (4 processes)" in out
    assert "  dp_shard groups: [0,2] [1,3]" in out and "  tp groups: [0,1] [2,3]" in out
    assert "  data shards (2): 0:[0,1] 1:[2,3]" in out
    assert "launcher: parallel (torchrun)" in out and "--nproc_per_node=4" in out


def test_parallelism_config_section_of_an_accelerate_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 4\n"
        "use_cpu: true\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 1\n"
        "  parallelism_config_cp_size: 1\n"
    )
    proc = accel(tmp_path, "launch", "--config_file", str(config), "--plugin", "parallel", "--dry-run", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert "parallelism_config_dp_replicate_size = 2 (file" in proc.stdout
    assert "mesh: dp_replicate=2 x dp_shard=2 x cp=1 x tp=1 (4 processes)" in proc.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["-n", "2", "--plugin", "parallel", "--parallelism_config_tp_size", "4"],
            "accel launch: parallelism_config sizes dp_replicate=1 x dp_shard=1 x cp=1 x tp=4 = 4, but the run has 2 "
            "process(es)",
        ),
        (
            ["-n", "2", "--cpu", "--plugin", "parallel", "--parallelism_config_cp_size", "2"],
            "does not have a sharding strategy registered",
        ),
        (["-n", "2", "--plugin", "parallel", "--parallelism_config_sp_size", "2"], "sequence parallelism"),
        (["-n", "2", "--parallelism_config_tp_size", "2"], "add --plugin parallel"),
        (["-n", "2", "--use_fsdp", "--parallelism_config_tp_size", "2"], "but fsdp is selected"),
        (
            ["-n", "2", "--plugin", "parallel", "--parallelism_config_tp_plan", '{"fc1": "diagonal"}'],
            "unknown tensor-parallel style(s) diagonal",
        ),
    ],
)
@pytest.mark.requires_plugins("fsdp")
def test_bad_parallelism_settings_are_one_line_at_launch(tmp_path: Path, args: list[str], expected: str) -> None:
    assert expected in one_error_line(accel(tmp_path, "launch", *args, "train.py"))


@dataclasses.dataclass
class ParallelismConfig:
    """Shaped like Accelerate 1.15's ``accelerate.ParallelismConfig`` (its dataclass fields)."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: object = None
    cp_handler: object = None
    sp_handler: object = None


@pytest.mark.parametrize(
    "config",
    [
        ParallelismConfig(dp_shard_size=2, tp_size=2),
        {"dp_shard_size": 2, "tp_size": 2},
        {"parallelism_config_tp_size": 4},
    ],
)
def test_kernel_parallelism_config_product_must_match_the_world(
    config: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WORLD_SIZE", "RANK", "ACCEL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match=r"Kernel\(\): parallelism_config sizes .* = 4, but the run has 1 process"):
        Kernel(parallelism_config=config)


def test_kernel_parallelism_config_unknown_field_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match="unknown field"):
        Kernel(parallelism_config={"ep_size": 2})  # expert parallel: not a field


def doc_blocks(kind: str) -> list[str]:
    text = (Path(__file__).parents[3] / "docs" / "parallelism.md").read_text()
    return [block.split("```", 1)[0] for block in text.split(f"```{kind}\n")[1:]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_documented_example_runs_with_its_launch_command(tmp_path: Path) -> None:
    script = doc_blocks("python")[0]
    assert script.startswith("# train_parallel.py\n")
    (tmp_path / "train_parallel.py").write_text(script)
    command = doc_blocks("bash")[0].strip().split()
    assert command[:2] == ["accel", "launch"]
    proc = accel(tmp_path, *command[1:2], "-q", *command[2:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "evaluated 64 sequences on 2 data shards" in proc.stdout, proc.stdout
    assert (tmp_path / "ckpt" / "model" / ".metadata").is_file()
