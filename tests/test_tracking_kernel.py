"""The Kernel's tracker API: fan-out to every active tracker, isolation of a failing one, main-process-only,
``log_with`` checks and install hints. Uses small recording trackers registered directly (no entry points)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from accel import Tracker, UsageError, hookimpl
from accel.spi import as_scalar, flatten
from accel.testing import isolated_env, make_kernel, run_launch
from accel.testing.conformance import BrokenTrackerPlugin
from accel.testing.shadow import hide_plugins


class Recorder(Tracker):
    def __init__(self, name: str) -> None:
        self.tracker_name = name
        self.provides = frozenset({f"tracker:{name}"})
        self.calls: list[tuple[str, Any]] = []

    @hookimpl
    def accel_init_trackers(self, project_name: str, config: Any, init_kwargs: Any) -> None:
        self.run = {"project": project_name}
        self.calls.append(("init", (project_name, config, init_kwargs.get(self.tracker_name, {}))))

    @hookimpl
    def accel_log(self, values: Any, step: Any, log_kwargs: Any) -> None:
        self.calls.append(("log", (dict(values), step, log_kwargs.get(self.tracker_name, {}))))

    @hookimpl
    def accel_end_training(self) -> None:
        self.calls.append(("end", None))


class RecorderPlugin:
    """A plugin module stand-in: activates its Recorder when log_with asks for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.component = Recorder(name)

    @hookimpl
    def accel_activate(self, settings: Any) -> Tracker | None:
        wanted = settings.get("log_with") or []
        return self.component if self.name in wanted or "all" in wanted else None


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))


def _messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_every_call_reaches_every_tracker() -> None:
    a, b = RecorderPlugin("rec_a"), RecorderPlugin("rec_b")
    kernel = make_kernel([], [("rec_a", a), ("rec_b", b)], log_with=["rec_a", "rec_b"])
    assert [c.name for c in kernel.trackers] == ["rec_a", "rec_b"]
    kernel.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"rec_a": {"x": 1}})
    kernel.log({"loss": 0.5}, step=3, log_kwargs={"rec_b": {"commit": False}})
    kernel.end_training()
    assert a.component.calls == [
        ("init", ("proj", {"lr": 0.1}, {"x": 1})),
        ("log", ({"loss": 0.5}, 3, {})),
        ("end", None),
    ]
    assert b.component.calls == [
        ("init", ("proj", {"lr": 0.1}, {})),
        ("log", ({"loss": 0.5}, 3, {"commit": False})),
        ("end", None),
    ]
    assert kernel.get_tracker("rec_a") is a.component
    assert kernel.get_tracker("rec_a", unwrap=True) == {"project": "proj"}


def test_log_with_all_takes_every_installed_tracker() -> None:
    rec = RecorderPlugin("rec")
    kernel = make_kernel(["tensorboard"], [("rec", rec)], log_with="all")
    try:
        assert sorted(c.name for c in kernel.trackers) == ["rec", "tensorboard"]
    finally:
        kernel.end_training()
    kernel = make_kernel(["tensorboard"], [("rec", rec)])
    assert kernel.trackers == []
    kernel.end_training()


def test_a_raising_tracker_is_warned_once_and_skipped() -> None:
    rec, broken = RecorderPlugin("rec"), BrokenTrackerPlugin()
    kernel = make_kernel([], [("broken", broken), ("rec", rec)], log_with=["broken", "rec"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel.init_trackers("proj")
        for step in range(3):
            kernel.log({"loss": 1.0 / (step + 1)}, step=step)
        kernel.end_training()
    messages = _messages(caught)
    assert len(messages) == 1, messages
    assert "tracker 'broken' failed in accel_init_trackers" in messages[0]
    assert "ConnectionError: the tracking server is gone" in messages[0]
    assert caught[0].filename == __file__, "the warning should point at the caller's line"
    assert broken.component.calls == 1
    assert [c[0] for c in rec.component.calls] == ["init", "log", "log", "log", "end"]


def test_log_before_init_warns_once_and_logs_nothing() -> None:
    rec = RecorderPlugin("rec")
    kernel = make_kernel([], [("rec", rec)], log_with=["rec"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel.log({"loss": 1.0})
        kernel.log({"loss": 2.0})
        kernel.end_training()
    assert len(_messages(caught)) == 1 and "before kernel.init_trackers()" in _messages(caught)[0]
    assert rec.component.calls == []  # not even end: no run was started


def test_media_need_a_tracker_that_supports_them() -> None:
    rec = RecorderPlugin("rec")
    kernel = make_kernel([], [("rec", rec)], log_with=["rec"])
    kernel.init_trackers("proj")
    with pytest.raises(UsageError, match="row 1 has 1 values for 2 columns"):
        kernel.log_table("t", columns=["a", "b"], data=[[1, 2], [3]])
    with pytest.raises(UsageError, match="either columns and data, or dataframe"):
        kernel.log_table("t", columns=["a"], dataframe=object())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel.log_images({"img": [[0, 1], [1, 0]]})
        kernel.log_images({"img": [[0, 1], [1, 0]]})
        kernel.log_table("t", columns=["a"], data=[[1]])
    kernel.end_training()
    assert len(_messages(caught)) == 2, _messages(caught)
    assert "none of the active trackers (rec) can log this" in _messages(caught)[0]


def test_get_tracker_of_an_inactive_name_is_a_usage_error() -> None:
    kernel = make_kernel([], [], log_with=[])
    with pytest.raises(UsageError, match=r"no active tracker named 'wandb' \(active trackers: none\)"):
        kernel.get_tracker("wandb")
    with pytest.raises(UsageError, match="non-empty string"):
        kernel.init_trackers("")
    with pytest.raises(UsageError, match="entry for 'wandb' must be a dict"):
        kernel.init_trackers("p", init_kwargs={"wandb": "offline"})
    kernel.end_training()


def test_tracker_that_is_not_installed_names_the_distribution(tmp_path: Path) -> None:
    """accel-plugin-mlflow hidden by an empty distribution of the same name (kernel/src/accel/testing/shadow.py), so for the
    subprocess it is not installed."""
    hidden = hide_plugins(tmp_path / "hidden", keep=["ddp", "tensorboard", "wandb", "jsonl"])
    code = (
        "from accel import Kernel, UsageError\n"
        "try:\n    Kernel(log_with='mlflow')\nexcept UsageError as exc:\n    print(exc)\n"
    )
    env = isolated_env(tmp_path / "home", extra={"PYTHONPATH": str(hidden)})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout == (
        "log_with='mlflow' needs a plugin that provides 'tracker:mlflow', and none is active; "
        "install one: `pip install accel-plugin-mlflow`\n"
    ), out.stderr


def test_disabled_or_misspelt_tracker_is_one_clear_error() -> None:
    with pytest.raises(UsageError, match="plugin 'wandb' is installed but disabled: not in ACCEL_PLUGINS"):
        make_kernel([], log_with=["wandb"])
    # the name a user passes, not the capability `tracker:tensorboard`
    with pytest.raises(UsageError, match=r"^log_with='tensorbord' names no tracker; did you mean `tensorboard`\?"):
        make_kernel(["tensorboard"], log_with=["tensorbord"])


def test_helpers_flatten_and_scalars() -> None:
    import numpy as np
    import torch

    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": torch.tensor(2.5)}) == {
        "a/b": 1,
        "a/c": "[1, 2]",
        "d": "None",
        "e": 2.5,
    }
    assert [as_scalar(v) for v in (3, 2.5, True, np.float32(1.5), np.int64(4), torch.tensor([7]), "x", [1])] == [
        3,
        2.5,
        1,
        1.5,
        4,
        7,
        None,
        None,
    ]


RECORDING_SCRIPT = """
    import json, os, sys
    from accel import Kernel, Tracker, hookimpl

    class FileTracker(Tracker):
        def __init__(self, name, main_only):
            self.label, self.main_process_only = name, main_only
            self.provides = frozenset({"tracker:" + name})

        def write(self, kernel, what):
            path = os.path.join(sys.argv[1], f"{self.label}-process{kernel.process_index}.jsonl")
            with open(path, "a") as fh:
                fh.write(json.dumps(what) + "\\n")

        @hookimpl
        def accel_init_trackers(self, kernel, project_name):
            self.write(kernel, "init")

        @hookimpl
        def accel_log(self, kernel, values, step):
            self.write(kernel, [values, step])

        @hookimpl
        def accel_end_training(self, kernel):
            self.write(kernel, "end")

    class Plugin:
        def __init__(self, name, main_only):
            self.component = FileTracker(name, main_only)

        @hookimpl
        def accel_activate(self):
            return self.component

    kernel = Kernel(log_with=["main_only", "everywhere"],
                    extra_plugins=[("main_only", Plugin("main_only", True)), ("everywhere", Plugin("everywhere", False))])
    kernel.init_trackers("p")
    kernel.log({"rank": kernel.process_index}, step=1)
    if len(sys.argv) > 2:
        raise SystemExit(0)  # no end_training: the kernel must still finish the trackers at exit
    kernel.end_training()
"""


def _read(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trackers_are_finished_at_exit_without_end_training(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(RECORDING_SCRIPT))
    env = isolated_env(tmp_path / "home", registered=[])
    subprocess.run([sys.executable, str(script), str(tmp_path), "no-end"], env=env, check=True, timeout=120)
    assert _read(tmp_path / "main_only-process0.jsonl") == ["init", [{"rank": 0}, 1], "end"]


@pytest.mark.multiprocess
def test_main_process_only_unless_the_tracker_says_otherwise(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(RECORDING_SCRIPT))
    run_launch([str(script), str(tmp_path)], num_processes=2, registered=["ddp"], home=tmp_path / "home")
    assert _read(tmp_path / "main_only-process0.jsonl") == ["init", [{"rank": 0}, 1], "end"]
    assert not (tmp_path / "main_only-process1.jsonl").exists()
    assert _read(tmp_path / "everywhere-process0.jsonl") == ["init", [{"rank": 0}, 1], "end"]
    assert _read(tmp_path / "everywhere-process1.jsonl") == ["init", [{"rank": 1}, 1], "end"]
