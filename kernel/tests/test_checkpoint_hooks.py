"""The state hooks go through pluggy: wrapper implementations of accel_save_state / accel_load_state /
accel_state_items run and see each component's answer (the kernel's own default implementation included, called
last), and pluggy's call monitoring sees the calls."""

from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Component, ItemRecord, Kernel, hookimpl
from accel.checkpoint import MANIFEST, load_weights_only


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ACCEL_CONFIG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


class Watcher(Component):
    """Wraps the three state hooks: records every answer it sees, and changes nothing."""

    role = "observer"

    def __init__(self) -> None:
        self.saved: list[dict[str, ItemRecord]] = []
        self.loaded: list[list[str]] = []
        self.given: list[set[str]] = []

    @hookimpl(wrapper=True)
    def accel_state_items(self, kernel: Kernel) -> Generator[None, Any, Any]:
        answers = yield
        self.given += [set(answer) for answer in answers if answer]
        return answers

    @hookimpl(wrapper=True)
    def accel_save_state(self, kernel: Kernel, items: Any, directory: Path) -> Generator[None, Any, Any]:
        answers = yield
        self.saved += [dict(answer) for answer in answers if answer]
        return answers

    @hookimpl(wrapper=True)
    def accel_load_state(self, kernel: Kernel, records: Any) -> Generator[None, Any, Any]:
        answers = yield
        self.loaded += [sorted(answer) for answer in answers if answer]
        return answers


class Claimer(Component):
    """Writes the model itself (one torch file) and gives a 'counter' item the kernel writes."""

    role = "observer"

    def __init__(self) -> None:
        self.counter = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda s: 1.0)

    @hookimpl
    def accel_state_items(self, kernel: Kernel) -> dict[str, Any]:
        return {"counter": self.counter}

    @hookimpl
    def accel_save_state(self, kernel: Kernel, items: Any, directory: Path) -> dict[str, ItemRecord]:
        torch.save(kernel.unwrap_model(items["model"]).state_dict(), directory / "model.pt")
        return {"model": ItemRecord(plugin="", format="torch-weights-only", files=("model.pt",))}

    @hookimpl
    def accel_load_state(self, kernel: Kernel, items: Any, directory: Path, records: Any) -> list[str]:
        kernel.unwrap_model(items["model"]).load_state_dict(load_weights_only(directory / "model.pt"))
        return list(records)


class Activator:
    def __init__(self, component: Component) -> None:
        self.component = component

    @hookimpl
    def accel_activate(self, settings: Any) -> Component:
        return self.component


def _run(*components: Component) -> tuple[Kernel, nn.Module]:
    torch.manual_seed(0)
    kernel = Kernel(extra_plugins=[(f"p{i}", Activator(c)) for i, c in enumerate(components)])
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    model, _, _ = kernel.prepare(model, opt, dl)
    return kernel, model


def test_a_wrapper_on_the_state_hooks_runs_and_sees_every_answer(tmp_path: Path) -> None:
    watcher, claimer = Watcher(), Claimer()
    kernel, model = _run(claimer, watcher)
    path = Path(kernel.save_state(tmp_path / "ck"))

    # accel_state_items: the plugin's key, then the kernel's own (its default implementation, called last)
    assert watcher.given[0] == {"counter"}
    assert watcher.given[-1] >= {"model", "optimizer", "dataloader", "gradients", "rng", "kernel"}
    # accel_save_state: the claimer's record (the kernel fills in its name), then the kernel's own writer's
    assert list(watcher.saved[0]) == ["model"] and watcher.saved[0]["model"].format == "torch-weights-only"
    kernel_written = watcher.saved[-1]
    assert set(kernel_written) == {"optimizer", "dataloader", "counter", "gradients", "rng", "kernel"}
    assert all(rec.plugin == "accel" and rec.format == "accel.tree" for rec in kernel_written.values())
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["items"]["model"]["plugin"] == "p0" and manifest["items"]["counter"]["plugin"] == "accel"

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    kernel.load_state(path)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    # accel_load_state: the claimer restored 'model', the kernel's default (last) everything it wrote
    assert watcher.loaded[0] == ["model"]
    assert set(watcher.loaded[-1]) == set(kernel_written)


def test_a_wrapper_can_change_what_the_kernel_writes_and_the_kernel_notices(tmp_path: Path) -> None:
    """A wrapper's result is what counts: dropping the kernel writer's record of an item is an error, not a
    checkpoint that silently lacks it."""

    class Dropper(Component):
        role = "observer"

        @hookimpl(wrapper=True)
        def accel_save_state(self) -> Generator[None, Any, Any]:
            answers = yield
            return [{k: v for k, v in answer.items() if k != "optimizer"} for answer in answers]

    kernel, _ = _run(Dropper())
    with pytest.raises(Exception, match=r"nobody wrote checkpoint item\(s\) \['optimizer'\]"):
        kernel.save_state(tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and not any(tmp_path.glob(".ck.tmp-*"))


def test_hook_monitoring_sees_the_state_hook_calls(tmp_path: Path) -> None:
    kernel, _ = _run(Claimer())
    seen: list[tuple[str, list[str]]] = []

    def before(hook_name: str, impls: Any, kwargs: Any) -> None:
        if hook_name in ("accel_state_items", "accel_save_state", "accel_load_state"):
            seen.append((hook_name, [impl.plugin_name for impl in impls]))

    undo = kernel.plugins.pm.add_hookcall_monitoring(before, lambda *a: None)
    try:
        kernel.load_state(kernel.save_state(tmp_path / "ck"))
    finally:
        undo()
    saves = [plugins for name, plugins in seen if name == "accel_save_state"]
    loads = [plugins for name, plugins in seen if name == "accel_load_state"]
    # the kernel's writer is the built-in plugin accel.checkpoint
    assert saves == [["p0:observer"], ["accel.checkpoint"]] and loads == [["p0:observer"], ["accel.checkpoint"]]
    assert ["accel.checkpoint"] in [plugins for name, plugins in seen if name == "accel_state_items"]
