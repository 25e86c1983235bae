"""Every hook call goes through pluggy (accel.dispatch): wrappers (``@hookimpl(wrapper=True)``) run on every hook,
including those the kernel calls one implementation at a time (tracking, discovery, checkpoint state), and
``ACCEL_TRACE_PLUGINS=1`` shows every hook call on stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections.abc import Generator
from typing import Any

import pytest
from torch import nn

from accel import Component, Kernel, Settings, hookimpl
from accel.spi import Tracker, requested


class ListTracker(Tracker):
    """A tracker that keeps its rows in a list; ``fail`` makes its accel_log raise."""

    provides = frozenset({"tracker:listing"})

    def __init__(self, fail: bool = False) -> None:
        self.rows: list[dict[str, Any]] = []
        self.fail = fail

    @hookimpl
    def accel_init_trackers(self, project_name: str) -> None:
        self.run = self.rows

    @hookimpl
    def accel_log(self, values: Any, step: Any) -> None:
        if self.fail:
            raise RuntimeError("disk full")
        self.rows.append({**values, "step": step})


class LogWatcher(Component):
    """Wraps accel_log: records the values before and what the tracker wrote after (and any exception)."""

    def __init__(self, tracker: ListTracker) -> None:
        self.tracker = tracker
        self.seen: list[tuple[str, Any]] = []

    @hookimpl(wrapper=True)
    def accel_log(self, values: Any) -> Generator[None, Any, Any]:
        self.seen.append(("before", dict(values)))
        try:
            result = yield
        except RuntimeError as exc:
            self.seen.append(("raised", str(exc)))
            raise
        self.seen.append(("after", list(self.tracker.rows), result))
        return result


def plugin(name: str, **hooks: Any) -> types.ModuleType:
    mod = types.ModuleType(f"accel_{name}")
    mod.__dict__.update({k: hookimpl(v) for k, v in hooks.items()})
    return mod


def activation(comp: Component) -> Any:
    def accel_activate(settings: Settings) -> Component | None:
        return comp if not isinstance(comp, Tracker) or requested(settings, "listing") else None

    return accel_activate


def kernel_with(*components: Component, **kwargs: Any) -> Kernel:
    extra = []
    for i, comp in enumerate(components):
        extra.append(
            (f"c{i}" if not isinstance(comp, Tracker) else "listing", plugin(f"c{i}", accel_activate=activation(comp)))
        )
    return Kernel(cpu=True, extra_plugins=extra, **kwargs)


def test_a_wrapper_on_accel_log_runs_around_the_tracker_and_sees_its_result(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path))
    tracker = ListTracker()
    watcher = LogWatcher(tracker)
    kernel = kernel_with(tracker, watcher, log_with="listing")
    kernel.init_trackers("run")
    kernel.log({"loss": 1.5}, step=3)
    assert tracker.rows == [{"loss": 1.5, "step": 3}]
    assert watcher.seen == [("before", {"loss": 1.5}), ("after", [{"loss": 1.5, "step": 3}], [])]
    kernel.end_training()


def test_a_wrapper_on_accel_log_sees_a_failing_tracker_which_is_still_isolated(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path))
    tracker = ListTracker(fail=True)
    watcher = LogWatcher(tracker)
    kernel = kernel_with(tracker, watcher, log_with="listing")
    kernel.init_trackers("run")
    with pytest.warns(RuntimeWarning, match=r"tracker 'listing' failed in accel_log .* RuntimeError: disk full"):
        kernel.log({"loss": 1.0}, step=1)
    kernel.log({"loss": 2.0}, step=2)  # skipped from now on: the wrapper does not run around it either
    assert watcher.seen == [("before", {"loss": 1.0}), ("raised", "disk full")]
    kernel.end_training()


def test_a_wrapper_on_a_discovery_hook_runs_and_sees_each_plugins_answer(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path))
    seen: list[tuple[str, Any]] = []
    observer = Component()

    def watch_activate(settings: Settings) -> Generator[None, Any, Any]:
        result = yield
        seen.append(("activate", result))
        return result

    def watch_hardware(env: Any) -> Generator[None, Any, Any]:
        result = yield
        return [type(result[0])(name="watched", device_count=1, priority=0)] if result else result

    watcher = types.ModuleType("accel_watcher")
    watcher.accel_activate = hookimpl(wrapper=True)(watch_activate)
    watcher.accel_detect_hardware = hookimpl(wrapper=True)(watch_hardware)
    kernel = Kernel(
        cpu=True,
        extra_plugins=[("watcher", watcher), ("observed", plugin("observed", accel_activate=lambda: observer))],
    )
    assert ("activate", [observer]) in seen  # the answer of the one plugin that answers accel_activate
    assert kernel.components == [observer]
    assert kernel.plugins.detect_hardware().name == "watched"  # a wrapper may change the answer it wraps


class SaveWatcher(Component):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    @hookimpl(wrapper=True)
    def accel_save_state(self, directory: Any) -> Generator[None, Any, Any]:
        result = yield
        self.seen.append((directory.exists(), result))
        return result


def test_a_wrapper_on_accel_save_state_runs(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path))
    watcher = SaveWatcher()
    kernel = kernel_with(watcher)
    model = kernel.prepare(nn.Linear(2, 2))
    kernel.save_state(tmp_path / "ckpt")
    assert watcher.seen and all(exists for exists, _ in watcher.seen), watcher.seen
    assert (tmp_path / "ckpt").is_dir() and model is not None


def test_accel_trace_plugins_prints_every_hook_call(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from accel import Kernel

        kernel = Kernel(cpu=True)
        model = torch.nn.Linear(2, 1)
        model, opt = kernel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        kernel.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        opt.zero_grad()
        kernel.end_training()
    """)
    )
    env = {"PATH": "/usr/bin:/bin", "ACCEL_HOME": str(tmp_path), "ACCEL_PLUGINS": "ddp", "OMP_NUM_THREADS": "1"}
    quiet = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    traced = subprocess.run(
        [sys.executable, str(script)],
        env={**env, "ACCEL_TRACE_PLUGINS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert quiet.returncode == traced.returncode == 0, (quiet.stderr, traced.stderr)
    assert "[hook]" not in quiet.stderr
    for hook in (
        "accel_add_options",
        "accel_activate",
        "accel_setup",
        "accel_device",
        "accel_autocast",
        "accel_transform_model",
        "accel_prepare_training",
        "accel_backward",
        "accel_optimizer_step",
        "accel_zero_grad",
    ):
        assert f"{hook} [hook]" in traced.stderr, (hook, traced.stderr[-3000:])
    assert "finish accel_prepare_training -->" in traced.stderr
