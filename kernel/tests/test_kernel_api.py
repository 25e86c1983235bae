"""The Kernel API on one process with the kernel alone (no plugin, no launcher): fast, in this process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accel.kernel import Kernel
from accel.testing import make_kernel


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Kernel]:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    k = make_kernel()  # no entry-point plugin allowed: the kernel's own answers
    yield k
    k.end_training()


@pytest.fixture
def accumulating(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Kernel]:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    k = make_kernel(gradient_accumulation_steps=4)
    yield k
    k.end_training()


def parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, loader, sched


def test_single_process_without_plugins(kernel: Kernel) -> None:
    assert kernel.components == []
    assert (kernel.num_processes, kernel.process_index, kernel.local_process_index) == (1, 0, 0)
    assert kernel.is_main_process and kernel.is_local_main_process
    assert kernel.device == torch.device("cpu")


def test_prepare_returns_objects_in_order_with_passthrough(kernel: Kernel) -> None:
    model, opt, loader, sched = parts()
    marker, number = object(), 7
    out = kernel.prepare(sched, number, loader, model, marker, opt)
    assert isinstance(out, tuple) and len(out) == 6
    p_sched, p_number, p_loader, p_model, p_marker, p_opt = out
    assert p_number == 7 and p_marker is marker  # other objects pass through unchanged
    assert isinstance(p_model, torch.nn.Module)
    assert kernel.unwrap_model(p_model) is model
    assert isinstance(p_opt, torch.optim.Optimizer) and p_opt.param_groups is opt.param_groups
    assert p_sched.scheduler is sched
    assert len(p_loader) == len(loader) and [len(x) for x, _ in p_loader] == [2] * 8
    # one object in, one object out (not a 1-tuple)
    single = kernel.prepare(torch.nn.Linear(2, 2))
    assert isinstance(single, torch.nn.Linear)
    lone_loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    assert [b[0].tolist() for b in lone_loader] == [[0, 1], [2, 3], [4]]


def test_unwrap_model_returns_the_users_module(kernel: Kernel) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    prepared = kernel.prepare(model)
    assert kernel.unwrap_model(prepared) is model
    assert kernel.unwrap_model(model) is model  # an unprepared module is its own unwrapped self


def test_scheduler_steps_once_per_optimizer_step_under_accumulation(accumulating: Kernel) -> None:
    kernel = accumulating
    model, opt, loader, sched = parts()  # 8 batches, k=4: 2 optimizer steps
    model, opt, loader, sched = kernel.prepare(model, opt, loader, sched)
    lrs, syncs, norms = [], [], []
    before = [p.detach().clone() for p in model.parameters()]
    changes = []
    for x, y in loader:
        with kernel.accumulate(model):
            kernel.backward(torch.nn.functional.mse_loss(model(x), y))
            norms.append(kernel.clip_grad_norm_(model.parameters(), 1e6))
            opt.step()
            sched.step()
            opt.zero_grad()
        syncs.append(kernel.sync_gradients)
        lrs.append(sched.get_last_lr()[0])
        now = [p.detach().clone() for p in model.parameters()]
        changes.append(any(not torch.equal(a, b) for a, b in zip(before, now, strict=True)))
        before = now
    assert syncs == [False, False, False, True] * 2
    # StepLR(step_size=1, gamma=0.5) halves the rate once per optimizer step (after micro-batches 4 and 8)
    assert lrs == pytest.approx([0.1] * 3 + [0.05] * 4 + [0.025])
    assert changes == syncs  # parameters move on sync steps only
    assert [n is None for n in norms] == [not s for s in syncs]


def test_accumulated_gradients_average_the_micro_batches(accumulating: Kernel) -> None:
    """k micro-batches of size b give the gradient of one batch of size k*b (loss divided by k)."""
    kernel = accumulating
    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    ref = torch.nn.Linear(3, 1)
    model = torch.nn.Linear(3, 1)
    model.load_state_dict(ref.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    model = kernel.prepare(model)
    for i in range(4):
        with kernel.accumulate(model):
            kernel.backward(torch.nn.functional.mse_loss(model(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_save_writes_safetensors_for_a_dict_of_tensors(kernel: Kernel, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "b": torch.tensor([1, 2])}  # non-contiguous too
    kernel.save(state, tmp_path / "weights.safetensors")
    loaded = load_file(str(tmp_path / "weights.safetensors"))
    assert set(loaded) == {"w", "b"}
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    # anything else goes through torch.save
    other = {"step": 3, "w": torch.ones(2)}
    kernel.save(other, tmp_path / "other.pt")
    back = torch.load(tmp_path / "other.pt")
    assert back["step"] == 3 and torch.equal(back["w"], torch.ones(2))
    # safe_serialization=False: torch.save even for tensors
    kernel.save(state, tmp_path / "plain.pt", safe_serialization=False)
    assert torch.equal(torch.load(tmp_path / "plain.pt")["b"], state["b"])


def test_autocast_is_a_no_op_without_a_precision_plugin(kernel: Kernel) -> None:
    model = kernel.prepare(torch.nn.Linear(4, 4))
    assert type(model) is torch.nn.Linear  # no autocast wrapper either
    with kernel.autocast() as ctx:
        assert ctx is None
        assert not torch.is_autocast_enabled("cpu")
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32


def test_free_memory_returns_nones_and_forgets_prepared_objects(kernel: Kernel) -> None:
    model, opt, loader, _ = parts()
    model, opt, loader = kernel.prepare(model, opt, loader)
    assert kernel._models and kernel._optimizers and kernel._dataloaders
    model, opt, loader = kernel.free_memory(model, opt, loader)
    assert (model, opt, loader) == (None, None, None)
    assert not kernel._models and not kernel._optimizers and not kernel._dataloaders
    assert kernel.free_memory() == []


def test_collectives_are_identities_on_one_process(kernel: Kernel) -> None:
    t = torch.arange(3)
    assert torch.equal(kernel.gather(t), t)
    assert torch.equal(kernel.reduce(t, "mean"), t)
    assert torch.equal(kernel.pad_across_processes(t), t)
    assert kernel.broadcast({"a": 1}) == {"a": 1}
    with kernel.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    kernel.wait_for_everyone()
    with kernel.main_process_first():
        pass
    assert kernel.on_main_process(lambda: 5)() == 5
    with contextlib.ExitStack():
        loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(7)), batch_size=3))
        gathered = [i for (x,) in loader for i in kernel.gather_for_metrics(x).tolist()]
    assert gathered == list(range(7))


def test_prepare_refuses_a_list_a_dataset_and_gather_of_non_tensors_in_one_line(kernel: Kernel) -> None:
    from accel import UsageError

    model, opt, loader, _ = parts()
    with pytest.raises(UsageError, match=r"argument 1 is a list of objects to prepare; .* kernel.prepare\(\*objects\)"):
        kernel.prepare([model, opt])
    with pytest.raises(
        UsageError, match=r"argument 2 is a Dataset \(TensorDataset\), not a DataLoader; .*DataLoader\("
    ):
        kernel.prepare(model, loader.dataset)
    assert kernel.prepare([1, 2]) == [1, 2]  # a list of nothing to prepare passes through, as other objects do
    for value, name in [({"a": 1}, "int"), ("text", "str"), ([torch.ones(1), object()], "object")]:
        with pytest.raises(UsageError, match=f"takes tensors .*, got {name}; use kernel.gather_object()"):
            kernel.gather(value)
    with pytest.raises(TypeError):  # the exception Accelerate raises, too
        kernel.gather("text")


@pytest.mark.requires_plugins("amp")
def test_a_model_another_kernel_wrapped_is_not_wrapped_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from accel import UsageError

    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    first = make_kernel(registered=["amp"], mixed_precision="bf16")
    prepared = first.prepare(torch.nn.Linear(2, 2))
    assert first.prepare(prepared) is prepared  # this kernel's own: returned as it is
    first.end_training()
    second = make_kernel(registered=["amp"], mixed_precision="bf16")
    with pytest.raises(UsageError, match=r"argument 1 is a model another Kernel prepared already \(a AutocastModule"):
        second.prepare(prepared)
    assert isinstance(second.prepare(second.unwrap_model(prepared)), torch.nn.Module)
    second.end_training()
