"""The Kernel API on one process with the kernel alone (no plugin active)."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel.data import PreparedDataLoader
from accel.kernel import PreparedOptimizer, PreparedScheduler
from accel.logging import get_logger


@pytest.fixture(autouse=True)
def kernel_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No installed plugin, no user config, no launcher variables leak into these tests."""
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel_home"))
    monkeypatch.setenv("ACCEL_PLUGINS", "")
    for name in ("ACCEL_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def make_data(n: int = 40, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen)
    y = torch.randn(n, 1, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def test_kernel_alone_has_no_component() -> None:
    kernel = Kernel()
    assert kernel.components == []
    assert (kernel.num_processes, kernel.process_index, kernel.local_process_index) == (1, 0, 0)
    assert kernel.is_main_process and kernel.is_local_main_process
    assert kernel.device == torch.device("cpu")


@pytest.mark.smoke
def test_prepare_returns_objects_in_order_with_passthrough() -> None:
    kernel = Kernel()
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    dl = make_data()
    other = {"not": "prepared"}
    out = kernel.prepare(dl, other, sched, model, 7, opt)
    assert len(out) == 6
    p_dl, p_other, p_sched, p_model, p_seven, p_opt = out
    assert isinstance(p_dl, PreparedDataLoader) and p_dl.dataset is dl.dataset
    assert p_other is other and p_seven == 7
    assert isinstance(p_sched, PreparedScheduler) and p_sched.scheduler is sched
    assert isinstance(p_opt, PreparedOptimizer) and p_opt.optimizer is opt
    assert isinstance(p_model, nn.Module)
    # One object comes back as itself, not as a 1-tuple.
    single = kernel.prepare(nn.Linear(2, 2))
    assert isinstance(single, nn.Linear)


def test_unwrap_model_returns_the_users_module() -> None:
    kernel = Kernel()
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    prepared = kernel.prepare(model)
    assert kernel.unwrap_model(prepared) is model
    assert kernel.unwrap_model(model) is model


def run_accumulation(k: int, n_batches: int, max_norm: float | None = None) -> dict:
    """Train a linear model under ``accumulate`` and record, per micro-batch, what the kernel did."""
    torch.manual_seed(0)
    kernel = Kernel(gradient_accumulation_steps=k)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    dl = make_data(n=4 * n_batches, batch_size=4)
    model, opt, dl, sched = kernel.prepare(model, opt, dl, sched)
    record: dict = {
        "sync": [],
        "param_changed": [],
        "norms": [],
        "grad_norm_after": [],
        "grad_before": [],
        "grad_after": [],
        "lrs": [],
    }
    for x, y in dl:
        with kernel.accumulate(model):
            before = model.weight.detach().clone()
            loss = nn.functional.mse_loss(model(x), y) * 100  # large gradients so clipping bites
            kernel.backward(loss)
            record["sync"].append(kernel.sync_gradients)
            if max_norm is not None:
                record["grad_before"].append(model.weight.grad.clone())
                norm = kernel.clip_grad_norm_(model.parameters(), max_norm)
                record["norms"].append(None if norm is None else float(norm))
                record["grad_after"].append(model.weight.grad.clone())
                total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                record["grad_norm_after"].append(float(total))
            opt.step()
            sched.step()
            opt.zero_grad()
            record["param_changed"].append(not torch.equal(before, model.weight.detach()))
            record["lrs"].append(opt.param_groups[0]["lr"])
    record["last_epoch"] = sched.last_epoch
    return record


@pytest.mark.smoke
def test_accumulate_syncs_every_k_steps_and_at_the_end_of_the_epoch() -> None:
    rec = run_accumulation(k=4, n_batches=10)
    expected = [False, False, False, True, False, False, False, True, False, True]
    assert rec["sync"] == expected
    # The optimizer acts only on sync steps: parameters change exactly there.
    assert rec["param_changed"] == expected


def test_scheduler_steps_once_per_optimizer_step() -> None:
    rec = run_accumulation(k=4, n_batches=10)
    assert rec["last_epoch"] == 3  # 3 optimizer steps over 10 micro-batches
    assert rec["lrs"] == pytest.approx([0.1] * 3 + [0.05] * 4 + [0.1 / 3] * 2 + [0.025])


@pytest.mark.smoke
def test_accumulated_gradient_is_the_mean_over_micro_batches() -> None:
    torch.manual_seed(0)
    kernel = Kernel(gradient_accumulation_steps=4)
    model = nn.Linear(3, 1)
    ref = nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = make_data(n=16, batch_size=4)
    model, opt, dl = kernel.prepare(model, opt, dl)
    for x, y in dl:
        with kernel.accumulate(model):
            kernel.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    # Reference: one step of plain SGD over the 16 samples as one batch.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = dl.dataset.tensors
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(model.bias, ref.bias, atol=1e-6, rtol=0)


@pytest.mark.smoke
def test_clip_grad_norm_only_on_sync_steps() -> None:
    rec = run_accumulation(k=4, n_batches=8, max_norm=0.5)
    for sync, norm, before, after, total in zip(
        rec["sync"], rec["norms"], rec["grad_before"], rec["grad_after"], rec["grad_norm_after"], strict=True
    ):
        if sync:
            assert norm is not None and norm > 0.5  # the norm before clipping, which was large
            assert total == pytest.approx(0.5, rel=1e-4)
        else:
            assert norm is None
            assert torch.equal(before, after)  # partial gradients are left alone


def test_clip_grad_value_only_on_sync_steps() -> None:
    torch.manual_seed(0)
    kernel = Kernel(gradient_accumulation_steps=2)
    model = nn.Linear(3, 1)
    dl = make_data(n=16, batch_size=4)
    model, dl = kernel.prepare(model, dl)
    for x, y in dl:
        with kernel.accumulate(model):
            kernel.backward(nn.functional.mse_loss(model(x), y) * 100)
            before = model.weight.grad.clone()
            kernel.clip_grad_value_(model.parameters(), 0.01)
            if kernel.sync_gradients:
                assert model.weight.grad.abs().max() <= 0.01 + 1e-9
            else:
                assert torch.equal(before, model.weight.grad)
            if kernel.sync_gradients:
                model.zero_grad()


def test_split_between_processes_on_one_process_is_the_identity() -> None:
    kernel = Kernel()
    for inputs in ([1, 2, 3], ("a", "b"), torch.arange(5), {"x": [1, 2], "y": torch.arange(2)}):
        with kernel.split_between_processes(inputs) as part:
            assert part is inputs
        with kernel.split_between_processes(inputs, apply_padding=True) as part:
            assert part is inputs


def test_collectives_on_one_process() -> None:
    kernel = Kernel()
    t = torch.arange(6).reshape(3, 2)
    assert torch.equal(kernel.gather(t), t)
    assert torch.equal(kernel.reduce(t, "sum"), t)
    assert torch.equal(kernel.reduce(t.float(), "mean"), t.float())
    assert torch.equal(kernel.pad_across_processes(t), t)
    assert torch.equal(kernel.broadcast(t), t)
    assert kernel.gather_object(["a"]) == ["a"]
    kernel.wait_for_everyone()


def test_gather_for_metrics_on_one_process_returns_every_item_once() -> None:
    kernel = Kernel()
    dl = kernel.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    seen = torch.cat([kernel.gather_for_metrics(x) for (x,) in dl])
    assert seen.tolist() == list(range(10))


def test_save_writes_safetensors_for_a_dict_of_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    kernel = Kernel()
    model = kernel.prepare(nn.Linear(3, 2))
    path = tmp_path / "model.safetensors"
    kernel.save(kernel.get_state_dict(model), path)
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        assert fh.read(1) == b"{"  # a safetensors JSON header, not a pickle/zip
    assert header_len > 0
    loaded = load_file(str(path))
    assert set(loaded) == {"weight", "bias"}
    torch.testing.assert_close(loaded["weight"], model.weight.detach())
    # Anything else goes through torch.save.
    other = tmp_path / "other.pt"
    kernel.save({"step": 3, "weights": torch.ones(2)}, other)
    assert torch.load(other)["step"] == 3


def test_main_process_first_and_on_main_process(capsys: pytest.CaptureFixture[str]) -> None:
    kernel = Kernel()
    order = []
    with kernel.main_process_first():
        order.append("inside")
    assert order == ["inside"]

    @kernel.on_main_process
    def main_only(x: int) -> int:
        return x * 2

    @kernel.on_local_main_process
    def local_main_only() -> str:
        return "ran"

    assert main_only(21) == 42
    assert local_main_only() == "ran"
    assert main_only.__name__ == "main_only"
    kernel.print("hello from", "the kernel")
    assert capsys.readouterr().out == "hello from the kernel\n"


def test_get_logger_main_process_only(caplog: pytest.LogCaptureFixture) -> None:
    Kernel()
    logger = get_logger("accel.test.single")
    with caplog.at_level(logging.INFO, logger="accel.test.single"):
        logger.info("main only %d", 1)
        logger.info("everywhere", main_process_only=False)
        logger.debug("too low")
    messages = [r.getMessage() for r in caplog.records if r.name == "accel.test.single"]
    assert messages == ["main only 1", "everywhere"]


def test_get_logger_level_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_LOG_LEVEL", "debug")
    logger = get_logger("accel.test.level")
    assert logger.logger.level == logging.DEBUG


def test_free_memory_drops_the_kernels_references() -> None:
    kernel = Kernel()
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = make_data()
    model, opt, dl = kernel.prepare(model, opt, dl)
    ref_model, ref_opt = weakref.ref(model), weakref.ref(opt)
    out = kernel.free_memory(model, opt, dl)
    assert out == [None, None, None]
    model, opt, dl = out
    assert ref_model() is None and ref_opt() is None  # the kernel kept nothing alive


def test_autocast_is_a_no_op_without_a_precision_plugin() -> None:
    kernel = Kernel()
    a = torch.randn(4, 4)
    with kernel.autocast():
        assert not torch.is_autocast_enabled("cpu")
        out = a @ a
    assert out.dtype == torch.float32
    model = kernel.prepare(nn.Linear(4, 2))
    assert model(a).dtype == torch.float32


@pytest.mark.smoke
def test_training_converges_on_one_process() -> None:
    torch.manual_seed(0)
    kernel = Kernel()
    x = torch.randn(64, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model, opt, dl = kernel.prepare(model, opt, dl)
    for _ in range(20):
        for xb, yb in dl:
            kernel.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
    assert nn.functional.mse_loss(model(x), y).item() < 1e-3
    assert os.environ.get("WORLD_SIZE") is None
