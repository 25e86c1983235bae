"""accel-plugin-wandb against the real thing: offline runs (WANDB_MODE=offline), read back from the run's
``.wandb`` file with a small reader of its record log (plugins/wandb/tests/wandb_records.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from wandb_records import read_run, run_files

from accel.testing import free_port, make_kernel, patched_environ
from accel.testing.conformance import TrackerConformance


@pytest.fixture(autouse=True)
def _fresh_wandb() -> Any:
    """wandb keeps one service and its settings (read from the environment once) per process: start each test
    with a fresh one, as a new training script would."""
    yield
    import sys

    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def offline_env(tmp_path: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }


def runs(tmp_path: Path, project: str) -> list[dict[str, Any]]:
    found = [read_run(f) for f in run_files(tmp_path / "project")]
    return [r for r in found if r["project"] == project]


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            out.update(_flat(value, name))
        else:
            out[name] = str(value)
    return out


class TestWandbConformance(TrackerConformance):
    name = "wandb"
    backend_modules = ("wandb",)

    def environment(self, tmp_path: Path) -> dict[str, str]:
        return offline_env(tmp_path)

    def read_series(self, tmp_path: Path, project: str) -> dict[str, list[tuple[int, float]]]:
        series: dict[str, list[tuple[int, float]]] = {}
        for run in runs(tmp_path, project):
            for row in run["history"]:
                for key, value in row.items():
                    if not key.startswith("_") and isinstance(value, (int, float)):
                        series.setdefault(key, []).append((row["_step"], value))
        return series

    def read_config(self, tmp_path: Path, project: str) -> dict[str, str]:
        (run,) = runs(tmp_path, project)
        return _flat({k: v for k, v in run["config"].items() if not k.startswith("_")})

    def count_runs(self, tmp_path: Path, project: str) -> int:
        return len(runs(tmp_path, project))


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    with patched_environ(offline_env(tmp_path)):
        yield


def test_images_tables_and_init_kwargs_read_back(offline: None, tmp_path: Path) -> None:
    kernel = make_kernel(["wandb"], log_with="wandb", project_dir=tmp_path / "project")
    kernel.init_trackers(
        "media", config={"lr": 0.01}, init_kwargs={"wandb": {"name": "my-run", "tags": ["accel"], "project": "media"}}
    )
    run = kernel.get_tracker("wandb", unwrap=True)
    assert run.name == "my-run" and run.project == "media"
    kernel.log({"loss": 0.5}, step=0)
    kernel.log_images({"sample": np.zeros((8, 8, 3), dtype=np.uint8)}, step=1)
    kernel.log_table("predictions", columns=["text", "label"], data=[["a", 1], ["b", 0]], step=2)
    kernel.end_training()
    (recorded,) = runs(tmp_path, "media")
    rows = {row["_step"]: row for row in recorded["history"]}
    assert rows[0]["loss"] == 0.5
    assert rows[1]["sample/_type"] == "image-file" and (rows[1]["sample/width"], rows[1]["sample/height"]) == (8, 8)
    assert rows[2]["predictions/_type"] == "table-file" and rows[2]["predictions/nrows"] == 2
    assert recorded["config"]["lr"] == 0.01


@pytest.mark.requires_plugins("tensorboard")
def test_bad_credentials_are_warned_once_and_the_others_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode with no API key (and a server address where nothing listens): wandb.init raises; the
    TensorBoard tracker next to it still records every step."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    env: dict[str, str | None] = {
        **offline_env(tmp_path),
        "WANDB_MODE": "online",
        "WANDB_API_KEY": None,
        "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
    }
    with patched_environ(env):
        kernel = make_kernel(
            ["wandb", "tensorboard"], log_with=["wandb", "tensorboard"], project_dir=tmp_path / "project"
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel.init_trackers("creds")
            for step in range(3):
                kernel.log({"loss": float(step)}, step=step)
            kernel.end_training()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "tracker 'wandb' failed in accel_init_trackers" in messages[0], messages
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "project" / "creds"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2]
