"""A resumed epoch that the script skips itself, as Accelerate's scripts do (diffusers': ``if step < resume_step:
continue``). By default ``load_state`` restores each dataloader's position, so a script that also skips would lose
those batches: the dataloader refuses in one line. With ``script_skips_batches=True`` (accel-accelerate's
default), ``load_state`` restarts the epoch in the same order and with the same random draws, and the script's own
skip resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accel import Kernel, UsageError


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG", "WORLD_SIZE", "ACCEL_SCRIPT_SKIPS_BATCHES"):
        monkeypatch.delenv(name, raising=False)


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample is augmented with torch's global generator, so a resumed run is exact only if its draws are."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / 24 + 0.1 * torch.rand(4)
        return x, x.sum(0, keepdim=True)


def training(**kernel_args: Any) -> tuple[Kernel, nn.Module, Any, DataLoader[Any]]:
    torch.manual_seed(0)
    kernel = Kernel(**kernel_args)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    return kernel, model, optimizer, loader


def epochs(
    kernel: Kernel,
    model: nn.Module,
    optimizer: Any,
    loader: Any,
    first: int = 0,
    skip: int = 0,
    save_at: tuple[int, int, Path] | None = None,
) -> list[float]:
    losses = []
    for epoch in range(first, 2):
        for step, (x, y) in enumerate(loader):
            if epoch == first and step < skip:
                continue  # the script's own skip
            loss = nn.functional.mse_loss(model(x), y)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            if save_at is not None and (epoch, step) == save_at[:2]:
                kernel.save_state(save_at[2])
    return losses


def test_a_script_skipping_a_restored_epoch_again_is_stopped(tmp_path: Path) -> None:
    kernel, model, optimizer, loader = training()
    epochs(kernel, model, optimizer, loader, save_at=(0, 2, tmp_path / "ckpt"))
    kernel, model, optimizer, loader = training()
    kernel.load_state(tmp_path / "ckpt")
    with pytest.raises(
        UsageError,
        match=r"restored this dataloader to batch 3 of its epoch, and the script skipped the batch after it too \(batch 4 never reached the model\)",
    ):
        epochs(kernel, model, optimizer, loader, skip=3)


def test_a_restored_epoch_without_the_scripts_skip_trains_on(tmp_path: Path) -> None:
    kernel, model, optimizer, loader = training()
    whole = epochs(kernel, model, optimizer, loader, save_at=(0, 2, tmp_path / "ckpt"))
    kernel, model, optimizer, loader = training()
    kernel.load_state(tmp_path / "ckpt")
    assert epochs(kernel, model, optimizer, loader) == whole[3:]


def test_script_skips_batches_resumes_the_scripts_skip_exactly(tmp_path: Path) -> None:
    kernel, model, optimizer, loader = training(script_skips_batches=True)
    whole = epochs(kernel, model, optimizer, loader, save_at=(0, 2, tmp_path / "ckpt"))
    kernel, model, optimizer, loader = training(script_skips_batches=True)
    kernel.load_state(tmp_path / "ckpt")
    assert epochs(kernel, model, optimizer, loader, skip=3) == whole[3:]  # same batches, same augmentation draws
