"""accel-plugin-xla with the real torch_xla 2.9.0 (torch 2.9.0) on PJRT's CPU device: run with `make test-xla`.

What is shown: a training script runs through `accel launch --plugin xla` (torch_xla.launch) and in-process with
`Kernel(plugins=["xla"])`, its loss goes down, the model and the batches really are XLA tensors; save_state/load_state
restore exactly (and a resumed run continues exactly like an uninterrupted one); bf16 and downcast_bf16; the XLA
collectives on one device; the strategy conformance suite of accel.testing on one process. Two XLA processes on the
CPU do not connect on this stack: see README.md (and `test_two_cpu_devices_do_not_rendezvous`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel.testing.conformance import StrategyConformance

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACCEL = str(Path(sys.executable).parent / "accel")


def launch(args: list[str], tmp_path: Path, timeout: float = 280, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "ACCEL_HOME": str(tmp_path / "home"), "PJRT_DEVICE": "CPU", **env}
    return subprocess.run(
        [ACCEL, "launch", "-q", *args], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, state in enumerate(optimizer.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = v.detach().cpu().clone()
    return out


# ---- through accel launch -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_launch_trains_on_the_xla_device_and_loss_decreases(tmp_path: Path) -> None:
    proc = launch(["--plugin", "xla", str(SCRIPTS / "train_xla.py"), "--epochs", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = json_lines(proc.stdout)
    assert [e["epoch"] for e in epochs] == [0, 1, 2], proc.stdout
    for e in epochs:
        assert e["strategy"] == ["xla"] and e["processes"] == 1
        assert e["device"].startswith("xla:") and e["param_device"] == "xla" and e["batch_devices"] == ["xla"]
        assert e["optimizer_has_model_params"], "the optimizer must update the XLA parameters, not the CPU ones"
        assert e["total"] == 297
    losses = [e["loss"] for e in epochs]
    assert losses[0] > losses[1] > losses[2] and losses[2] < 0.6 * losses[0], losses
    assert epochs[-1]["accuracy"] > 0.85, epochs


@pytest.mark.slow
def test_launch_runs_the_digits_example_unchanged(tmp_path: Path) -> None:
    proc = launch(["--plugin", "xla", str(ROOT / "examples" / "train_digits.py"), "--epochs", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"epoch (\d): accuracy ([0-9.]+) on 297 test images \(1 process\)", proc.stdout)
    assert [int(e) for e, _ in found] == [0, 1], proc.stdout
    assert float(found[-1][1]) >= 0.8, proc.stdout


def test_launch_dry_run_shows_the_spawn_command(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not run in a dry run')\n")
    proc = launch(["--plugin", "xla", "--dry-run", str(script), "--lr", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("launcher: xla"))
    assert line.endswith(f"{sys.executable} -m accel_xla.spawn {script} --lr 1"), line
    assert "xla (strategy)" in proc.stdout


def test_main_training_function_is_called(tmp_path: Path) -> None:
    script = tmp_path / "fn.py"
    script.write_text(
        "import json, sys\n"
        "def train():\n"
        "    from accel import Kernel\n"
        "    k = Kernel()\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'device': str(k.device), 'name': __name__}))\n"
        "    k.end_training()\n"
    )
    proc = launch(["--plugin", "xla", "--main_training_function", "train", str(script), "a", "--b"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = json_lines(proc.stdout)
    assert out["argv"] == ["a", "--b"] and out["device"].startswith("xla:") and out["name"] != "__main__"


@pytest.mark.slow
def test_two_cpu_devices_do_not_rendezvous(tmp_path: Path) -> None:
    """The limit documented in README.md: PJRT's CPU runtime starts one process whatever CPU_NUM_DEVICES says, runs
    one thread per device, and the threads' all-reduces never meet; XLA aborts after its 10 s termination timeout.
    If this test starts failing because it trains, the limit is gone: update README.md and add a 2-device test."""
    proc = launch(["--plugin", "xla", str(SCRIPTS / "train_xla.py"), "--epochs", "1"], tmp_path, CPU_NUM_DEVICES="2")
    assert proc.returncode != 0, proc.stdout
    assert "Expected 2 threads to join the rendezvous, but only 1 of them arrived on time" in proc.stderr
    assert "BrokenProcessPool" in proc.stderr


@pytest.mark.slow
def test_torchrun_world_that_xla_does_not_see_is_refused(tmp_path: Path) -> None:
    """torchrun + PJRT CPU gives every process an XLA world of 1 (README.md): refused, not trained separately."""
    script = tmp_path / "k.py"
    script.write_text(
        "from accel import Kernel, UsageError\n"
        "try:\n    Kernel(plugins=['xla'])\nexcept UsageError as exc:\n    print('refused:', exc)\n"
    )
    env = {**os.environ, "ACCEL_HOME": str(tmp_path / "home"), "PJRT_DEVICE": "CPU"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2, proc.stdout
    assert all("2 processes were started (WORLD_SIZE=2) but the XLA runtime sees a world of 1" in r for r in refused)


# ---- in this process ------------------------------------------------------------------------------------------


def test_kernel_in_process_places_everything_on_xla_and_learns() -> None:
    kernel = Kernel(plugins=["xla"])
    try:
        assert [c.name for c in kernel.components if c.role == "strategy"] == ["xla"]
        assert kernel.device.type == "xla" and kernel.num_processes == 1 and kernel.is_main_process
        model = net()
        cpu_params = list(model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(data(), batch_size=16, shuffle=True)
        model, optimizer, loader = kernel.prepare(model, optimizer, loader)
        params = list(kernel.unwrap_model(model).parameters())
        assert all(p.device.type == "xla" for p in params)
        assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in params]
        assert all(p.device.type == "cpu" for p in cpu_params)  # .to(xla) made new parameters: repointed above
        epoch_losses = []
        for _ in range(4):
            losses, ends = [], []
            for x, y in loader:
                assert x.device.type == "xla" and y.device.type == "xla"
                ends.append(kernel.gradient_state.end_of_dataloader)
                loss = nn.functional.cross_entropy(model(x), y)
                kernel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
            assert ends == [False] * (len(loader) - 1) + [True], ends  # bookkeeping follows the loop, not the prefetch
            epoch_losses.append(sum(losses) / len(losses))
        assert epoch_losses[-1] < 0.7 * epoch_losses[0], epoch_losses
    finally:
        kernel.end_training()


def test_gather_for_metrics_counts_each_sample_once() -> None:
    kernel = Kernel(plugins=["xla"])
    try:
        loader = kernel.prepare(DataLoader(data(50), batch_size=16))
        seen = []
        for _, y in loader:
            seen.append(kernel.gather_for_metrics(y).cpu())
        assert sum(len(s) for s in seen) == 50
        assert torch.equal(torch.cat(seen), data(50).tensors[1])
    finally:
        kernel.end_training()


def test_collectives_on_one_device() -> None:
    kernel = Kernel(plugins=["xla"])
    try:
        col = kernel.collectives
        assert type(col).__name__ == "XLACollectives"
        t = torch.arange(6.0, device=kernel.device).reshape(2, 3)
        (gathered,) = col.all_gather(t)
        assert gathered.device.type == "xla" and torch.equal(gathered.cpu(), t.cpu())
        (scalar,) = col.all_gather(torch.tensor(3.0, device=kernel.device))
        assert scalar.shape == () and float(scalar) == 3.0
        r = torch.tensor([2.0, -1.0], device=kernel.device)
        assert col.all_reduce(r, "sum") is r and r.cpu().tolist() == [2.0, -1.0]
        assert col.all_reduce(r, "max").cpu().tolist() == [2.0, -1.0]
        b = torch.tensor([7.0], device=kernel.device)
        assert col.broadcast(b, 0).cpu().tolist() == [7.0]
        assert col.all_gather_object({"a": 1}) == [{"a": 1}]
        assert col.broadcast_object(["x"], 0) == ["x"]
        col.barrier()
        assert torch.equal(kernel.gather(t).cpu(), t.cpu())
        assert kernel.reduce(torch.tensor([1.0, 2.0], device=kernel.device), "mean").cpu().tolist() == [1.0, 2.0]
        assert kernel.broadcast(torch.tensor([4.0], device=kernel.device)).cpu().tolist() == [4.0]
        assert kernel.gather_object(["a", "b"]) == ["a", "b"]
    finally:
        kernel.end_training()


def _train(
    kernel: Kernel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    steps: int,
    it: Iterator | None = None,
) -> tuple[list[float], Iterator]:
    """``steps`` micro-batches with gradient accumulation, going on with iterator ``it`` (new passes as needed)."""
    losses = []
    it = iter(loader) if it is None else it
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        with kernel.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            kernel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, it


def _setup(tmp_path: Path) -> tuple[Kernel, nn.Module, torch.optim.Optimizer, DataLoader]:
    kernel = Kernel(plugins=["xla"], project_dir=str(tmp_path / "project"), gradient_accumulation_steps=2)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data(), batch_size=8, shuffle=True)
    model, optimizer, loader = kernel.prepare(model, optimizer, loader)
    return kernel, model, optimizer, loader


def test_save_load_round_trip_restores_exactly(tmp_path: Path) -> None:
    torch.manual_seed(1)
    kernel, model, optimizer, loader = _setup(tmp_path)
    try:
        it = iter(loader)
        for _ in range(5):  # stop in the middle of an accumulation cycle and of the epoch
            x, y = next(it)
            with kernel.accumulate(model):
                kernel.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        assert not kernel.sync_gradients
        saved = kernel.save_state(tmp_path / "ckpt")
        params = cpu_state(kernel.unwrap_model(model))
        moments = optimizer_tensors(optimizer)
        grads = {n: p.grad.cpu().clone() for n, p in kernel.unwrap_model(model).named_parameters()}
        assert moments and all(g.abs().sum() > 0 for g in grads.values())
        manifest = json.loads((saved / "accel_manifest.json").read_text())
        writers = {key: item["plugin"] for key, item in manifest["items"].items()}
        assert writers["model"] == "accel", "the model is written by the kernel (portable safetensors)"
        assert writers["optimizer"] == writers["gradients"] == writers["xla_rng"] == "xla"
        assert {
            "optimizer.json",
            "optimizer.safetensors",
            "gradients_rank0.json",
            "xla_rng_rank0.json",
            "model.safetensors",
        } <= set(os.listdir(saved))

        _train(kernel, model, optimizer, loader, 7, it)  # move everything away from the saved state
        assert not torch.equal(cpu_state(kernel.unwrap_model(model))["0.weight"], params["0.weight"])

        kernel.load_state(saved)
        after = cpu_state(kernel.unwrap_model(model))
        assert set(after) == set(params) and all(torch.equal(after[k], params[k]) for k in params)
        restored = optimizer_tensors(optimizer)
        assert set(restored) == set(moments) and all(torch.equal(restored[k], moments[k]) for k in moments)
        for n, p in kernel.unwrap_model(model).named_parameters():
            assert p.device.type == "xla" and p.grad.device.type == "xla" and torch.equal(p.grad.cpu(), grads[n])
        assert all(v.device.type == "xla" for s in optimizer.state.values() for v in s.values() if v.ndim)
    finally:
        kernel.end_training()


@pytest.mark.parametrize("mid_pass", [True, False], ids=["saved-mid-pass", "saved-after-abandoned-pass"])
def test_resumed_run_continues_exactly(tmp_path: Path, mid_pass: bool) -> None:
    """Save in the middle of an accumulation cycle (and of the epoch, with the loop's iterator still open, or after
    the loop was left), keep training; a second Kernel loads the checkpoint and trains the same steps: same losses
    and same final weights (dropout on the XLA device, shuffled data, AdamW, 12 batches per epoch)."""
    torch.manual_seed(3)
    kernel, model, optimizer, loader = _setup(tmp_path)
    try:
        _, it = _train(kernel, model, optimizer, loader, 5)
        if not mid_pass:
            del it  # the loop was left: the next pass starts the epoch again
            it = None
        checkpoint = kernel.save_state()
        expected, _ = _train(kernel, model, optimizer, loader, 25, it)
        final = cpu_state(kernel.unwrap_model(model))
    finally:
        kernel.end_training()
    torch.manual_seed(99)  # a fresh process would start from other random states
    kernel, model, optimizer, loader = _setup(tmp_path)
    try:
        assert kernel.latest_checkpoint() == checkpoint
        kernel.load_state()
        assert loader.state_dict()["position"] == (5 if mid_pass else 0)
        got, _ = _train(kernel, model, optimizer, loader, 25)
        assert got == expected
        resumed = cpu_state(kernel.unwrap_model(model))
        assert all(torch.equal(resumed[k], final[k]) for k in final)
    finally:
        kernel.end_training()


def test_bf16_autocast_on_xla() -> None:
    kernel = Kernel(plugins=["xla"], mixed_precision="bf16")
    try:
        strategy = next(c for c in kernel.components if c.role == "strategy")
        assert strategy.name == "xla" and "precision:bf16" in strategy.provides
        a = torch.randn(4, 8, device=kernel.device)
        with kernel.autocast():
            assert (a @ a.T).dtype == torch.bfloat16
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(data(), batch_size=16, shuffle=True)
        model, optimizer, loader = kernel.prepare(model, optimizer, loader)
        inner = kernel.unwrap_model(model)
        assert next(inner.parameters()).dtype == torch.float32
        seen: list[torch.dtype] = []
        hook = inner[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        losses = []
        for _ in range(3):
            for x, y in loader:
                out = model(x)
                assert out.dtype == torch.float32  # the kernel hands back fp32 outputs
                loss = nn.functional.cross_entropy(out, y)
                kernel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
        hook.remove()
        assert set(seen) == {torch.bfloat16}, "the Linear layers did not compute in bf16"
        assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6
    finally:
        kernel.end_training()


def test_downcast_bf16_stores_parameters_in_bf16() -> None:
    kernel = Kernel(plugins=["xla"], mixed_precision="bf16", downcast_bf16=True)
    try:
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data(), batch_size=16))
        params = list(kernel.unwrap_model(model).parameters())
        assert all(p.dtype == torch.bfloat16 and p.device.type == "xla" for p in params)
        assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in params]
        before = params[0].detach().cpu().clone()
        for x, y in loader:
            kernel.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        assert not torch.equal(params[0].detach().cpu(), before)
    finally:
        kernel.end_training()


def test_clip_grad_norm_on_xla() -> None:
    kernel = Kernel(plugins=["xla"])
    try:
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = kernel.prepare(model, optimizer, DataLoader(data(), batch_size=32))
        x, y = next(iter(loader))
        kernel.backward(nn.functional.cross_entropy(model(x), y) * 100)
        params = list(kernel.unwrap_model(model).parameters())
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.cpu()) for p in params]))
        norm = kernel.clip_grad_norm_(params, 0.5)
        assert norm.device.type == "xla" and torch.allclose(norm.cpu(), expected, rtol=1e-4), (norm, expected)
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.cpu()) for p in params]))
        assert expected > 0.5 and abs(float(clipped) - 0.5) < 1e-3
        optimizer.step()
    finally:
        kernel.end_training()


def test_fp16_is_refused_with_one_line() -> None:
    from accel.spi import UsageError

    with pytest.raises(UsageError, match="mixed_precision=fp16 is not supported on XLA"):
        Kernel(plugins=["xla"], mixed_precision="fp16")


# ---- the conformance suite of accel.testing -------------------------------------------------------------------


class TestXLAConformance(StrategyConformance):
    """Listed as active, selected by --plugin xla, trains to the full-batch reference weights with accumulation and
    working collectives: on one process (PJRT's CPU runtime runs one)."""

    name = "xla"
    backend_modules = ("torch_xla",)
    num_processes = 1
    real_launch_counts = (1,)  # torch_xla.launch starts one process per local XLA device (PJRT's CPU runtime: one)
