"""Plugin discovery does its checks once: the component classes of every plugin are checked in one scratch manager
(each class unregistered after its check, so one class's hooks never show in another's verdict), and each
distribution's metadata is read once. Every process of a launch (the launcher and each worker's ``Kernel()``) runs
this discovery, so its cost is paid once per process before training starts."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import accel.plugins as plugins_module
from accel import Component, hookimpl
from accel.plugins import Plugins


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


#: counts, in a fresh interpreter (earlier tests of a session may have swapped importlib.metadata's classes), the
#: reads of each distribution's METADATA while plugin discovery scans the entry points
COUNT_READS = """
import importlib.metadata as md, json
from collections import Counter
from pathlib import Path
reads = Counter()
original = md.Distribution.metadata
def counted(self):
    meta = original.fget(self)
    reads[str(meta["Name"])] += 1
    return meta
md.Distribution.metadata = property(counted)
from accel.plugins import scan_entry_points
records = scan_entry_points()
print(json.dumps({"reads": reads, "records": [[r.distribution, r.version] for r in records]}))
"""


def _distribution(root: Path, name: str, version: str, entry_points: str) -> None:
    """A distribution on disk the way pip leaves it (a dist-info folder), with entry points of group ``accel``."""
    info = root / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[accel]\n{entry_points}\n")


def test_each_distribution_metadata_is_read_once(tmp_path: Path) -> None:
    # two distributions of our own (one with two entry points), so the count has plugins to read in every venv,
    # including the one with no plugin installed
    _distribution(tmp_path, "accel_probe_one", "0.3.1", "probe_a = accel_probe_one:A\nprobe_b = accel_probe_one:B")
    _distribution(tmp_path, "accel_probe_two", "1.0.0", "probe_c = accel_probe_two:C")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", COUNT_READS], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    reads, records = Counter(found["reads"]), found["records"]
    assert {"accel_probe_one", "accel_probe_two"} <= {dist for dist, _ in records}, records
    assert all(n == 1 for n in reads.values()), reads
    assert {dist for dist, _ in records} <= set(reads)
    probes = {"accel_probe_one": "0.3.1", "accel_probe_two": "1.0.0"}
    for dist, version in records:
        assert version == probes.get(dist) or version == md.version(dist)
