"""Plugin discovery does its checks once: the component classes of every plugin are checked in one scratch manager
(each class unregistered after its check, so one class's hooks never show in another's verdict), and each
distribution's metadata is read once. Every process of a launch (the launcher and each worker's ``Kernel()``) runs
this discovery, so its cost is paid once per process before training starts."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types
from collections import Counter
from typing import Any

import pytest

import accel.plugins as plugins_module
from accel import Component, hookimpl
from accel.plugins import Plugins, scan_entry_points


class Logs(Component):
    @hookimpl
    def accel_log(self, kernel: Any, values: Any, step: Any) -> None:
        return None


class Typo(Component):
    @hookimpl
    def accel_prepare_trainin(self, kernel: Any) -> None:
        return None


def plugin(name: str, *classes: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.accel_components = [f"accel_checked_components:{c}" for c in classes]  # type: ignore[attr-defined]
    mod.accel_activate = hookimpl(lambda settings: None)  # type: ignore[attr-defined]
    return mod


def test_component_classes_are_checked_in_one_scratch_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = types.ModuleType("accel_checked_components")
    holder.Logs, holder.Typo = Logs, Typo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accel_checked_components", holder)
    made: list[object] = []

    class Counted(plugins_module.PluginManager):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(plugins_module, "PluginManager", Counted)
    # the same class listed by two plugins, and a failing class checked before a good one
    extra = [("bad", plugin("bad", "Typo")), ("one", plugin("one", "Logs")), ("two", plugin("two", "Logs", "Typo"))]
    loaded = Plugins.load(env={"ACCEL_PLUGINS": ""}, extra=extra)
    assert len(made) == 2  # the plugins' manager and one scratch manager for the three plugins' classes
    scratch = made[1]
    assert scratch.get_plugins() == set(), "a checked class stays registered in the scratch manager"  # type: ignore[attr-defined]
    records = loaded.records
    assert records["bad"].status == "failed" and "Typo implements unknown hook 'accel_prepare_trainin'" in str(
        records["bad"].reason
    )
    assert records["one"].status == "loaded", records["one"]
    assert "accel_log" in records["one"].hooks
    assert records["two"].status == "failed" and "Typo implements unknown hook" in str(records["two"].reason)


def test_each_distribution_metadata_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: Counter[str] = Counter()
    original = md.Distribution.metadata

    def counted(self: md.Distribution) -> Any:
        meta = original.fget(self)  # type: ignore[attr-defined]
        reads[str(meta["Name"])] += 1
        return meta

    monkeypatch.setattr(md.Distribution, "metadata", property(counted))
    records = scan_entry_points()
    assert all(n == 1 for n in reads.values()), reads
    assert {r.distribution for r in records} <= set(reads)
    for rec in records:
        assert rec.version == md.version(rec.distribution)
