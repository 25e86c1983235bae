"""The script's save and load hooks (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``,
Accelerate's signatures): what they write is part of the checkpoint, a model they save or load themselves is left
to them, and a handle removes them. The diffusers training scripts that use them run in compat/accelerate/tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel import CheckpointError, Kernel
from accel.checkpoint import MANIFEST


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ACCEL_CONFIG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def run() -> tuple[Kernel, nn.Module, torch.optim.Optimizer]:
    kernel = Kernel()
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = kernel.prepare(model, optimizer)
    return kernel, model, optimizer


def save_own_weights(models: list[Any], weights: list[Any], output_dir: str) -> None:
    """What diffusers' ``save_model_hook`` does: save each model its own way, then pop its weights."""
    for model in models:
        os.makedirs(os.path.join(output_dir, "mine"))
        torch.save(model.state_dict(), os.path.join(output_dir, "mine", "weights.pt"))
        weights.pop()


def load_own_weights(models: list[Any], input_dir: str) -> None:
    while models:
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "mine", "weights.pt")))


def test_the_hooks_files_are_kept_and_their_model_left_to_them(tmp_path: Path) -> None:
    kernel, model, _ = run()
    kernel.register_save_state_pre_hook(save_own_weights)
    kernel.register_load_state_pre_hook(load_own_weights)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    directory = kernel.save_state(tmp_path / "ckpt")
    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    assert "mine/weights.pt" in manifest["files"]  # listed, so load_state accepts the directory
    assert not [key for key, item in manifest["items"].items() if item["extra"]["kind"] == "model"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    kernel.load_state(directory)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_a_model_no_hook_loads_is_asked_for(tmp_path: Path) -> None:
    kernel, _, _ = run()
    handle = kernel.register_save_state_pre_hook(save_own_weights)
    directory = kernel.save_state(tmp_path / "ckpt")
    handle.remove()
    with pytest.raises(CheckpointError, match="has no 'model'"):
        kernel.load_state(directory)


def test_a_hook_that_keeps_the_weights_changes_nothing_accel_saves(tmp_path: Path) -> None:
    kernel, model, _ = run()
    seen: list[tuple[int, int, str]] = []
    kernel.register_save_state_pre_hook(lambda models, weights, out: seen.append((len(models), len(weights), out)))
    directory = Path(kernel.save_state(tmp_path / "ckpt"))
    assert seen and seen[0][:2] == (1, 1) and Path(seen[0][2]).parent == directory.parent  # the temporary directory
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["items"]["model"]["extra"]["kind"] == "model"
    kernel.load_state(directory)


def test_a_removed_hook_is_not_called(tmp_path: Path) -> None:
    kernel, _, _ = run()
    calls: list[str] = []
    handle = kernel.register_load_state_pre_hook(lambda models, path: calls.append(path))
    directory = kernel.save_state(tmp_path / "ckpt")
    kernel.load_state(directory)
    handle.remove()
    kernel.load_state(directory)
    assert calls == [os.fspath(directory)]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_models_state_is_taken_once_and_written_as_the_hooks_saw_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """With a save hook that keeps the weights, each model's state dict is taken once per save (a sharding strategy
    gathers to take it), and what accel writes is that state dict, as Accelerate writes the ``weights`` its hooks
    saw."""
    kernel, model, _ = run()
    taken: list[int] = []
    original = Kernel.get_state_dict

    def counted(self: Kernel, m: nn.Module) -> dict[str, Any]:
        taken.append(id(m))
        return original(self, m)

    monkeypatch.setattr(Kernel, "get_state_dict", counted)
    seen: list[dict[str, Any]] = []

    def mark(models: list[Any], weights: list[Any], output_dir: str) -> None:
        weights[0]["weight"] = torch.full_like(weights[0]["weight"], 7.0)  # what the hook saw is what is written
        seen.append(weights[0])

    kernel.register_save_state_pre_hook(mark)
    directory = kernel.save_state(tmp_path / "ckpt", asynchronous=asynchronous)
    kernel.wait_for_save()
    assert len(taken) == 1 and len(seen) == 1
    kernel.register_save_state_pre_hook(lambda models, weights, output_dir: None)  # a second save: taken again
    kernel.load_state(directory)
    assert torch.equal(model.weight.detach(), torch.full_like(model.weight, 7.0))
    kernel.end_training()
