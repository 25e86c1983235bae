"""One process started with plain ``python`` (no launcher): the plugin is chosen with ``Kernel(plugins=["fsdp"])``
and configured with Kernel arguments. Checks that save_state before the first optimizer step changes nothing (torch's
state-dict helpers would take a zero-learning-rate step) and that loading such a checkpoint leaves the optimizer
empty. Prints ``OK`` at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from accel import Kernel

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import Net, finish  # noqa: E402


def run(directory: Path, save_first: bool) -> dict[str, torch.Tensor]:
    kernel = Kernel(cpu=True, plugins=["fsdp"], fsdp_reshard_after_forward=False, fsdp_auto_wrap_policy="NO_WRAP")
    assert [c.name for c in kernel.components] == ["fsdp"] and kernel.num_processes == 1
    assert kernel.settings["fsdp_reshard_after_forward"] is False
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = kernel.prepare(model, optimizer)
    if save_first:
        kernel.save_state(directory)
        assert not optimizer.state, "saving must not create optimizer state"
        kernel.load_state(directory)
        assert not optimizer.state, "loading a checkpoint of a fresh optimizer leaves it fresh"
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        loss = model(torch.randn(8, 8, generator=gen)).pow(2).mean()
        kernel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert int(next(iter(optimizer.state.values()))["step"]) == 2
    state = kernel.get_state_dict(model)
    kernel.end_training()
    return state


def main() -> None:
    directory = Path(sys.argv[1])
    plain = run(directory / "unused", save_first=False)
    saved = run(directory / "fresh", save_first=True)
    assert plain.keys() == saved.keys() and all(torch.equal(plain[k], saved[k]) for k in plain)
    print("OK")
    finish()


if __name__ == "__main__":
    main()
