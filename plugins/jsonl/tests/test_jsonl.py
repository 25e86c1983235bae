"""Tests of accel-plugin-jsonl: accel's tracker conformance suite, plus what is special to this tracker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accel.testing.conformance import TrackerConformance


def events(tmp_path: Path, project: str) -> list[dict[str, Any]]:
    path = tmp_path / "project" / "jsonl" / f"{project}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}/{key}" if prefix else key
        out.update(flat(value, name) if isinstance(value, dict) else {name: str(value)})
    return out


class TestJsonlConformance(TrackerConformance):
    """Runs every test of accel's tracker conformance suite against this plugin."""

    name = "jsonl"

    def read_series(self, tmp_path: Path, project: str) -> dict[str, list[tuple[int, float]]]:
        series: dict[str, list[tuple[int, float]]] = {}
        for event in events(tmp_path, project):
            if event["event"] == "log":
                for key, value in event["values"].items():
                    series.setdefault(key, []).append((event["step"], value))
        return series

    def read_config(self, tmp_path: Path, project: str) -> dict[str, str]:
        return flat(events(tmp_path, project)[0]["config"])

    def count_runs(self, tmp_path: Path, project: str) -> int:
        path = tmp_path / "project" / "jsonl" / f"{project}.jsonl"
        return sum(e["event"] == "init" for e in events(tmp_path, project)) if path.exists() else 0


def test_a_run_is_init_logs_end(accel_kernel: Any, tmp_path: Path) -> None:
    kernel = accel_kernel(["jsonl"], log_with="jsonl", project_dir=tmp_path / "project")
    kernel.init_trackers("demo", config={"lr": 0.1})
    kernel.log({"loss": 1.0, "note": "hi"}, step=0)
    kernel.log_table("predictions", columns=["x", "y"], data=[[1, 2]], step=0)
    kernel.end_training()
    assert [e["event"] for e in events(tmp_path, "demo")] == ["init", "log", "table", "end"]
    assert events(tmp_path, "demo")[1]["values"] == {"loss": 1.0, "note": "hi"}
