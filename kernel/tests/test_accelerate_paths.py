"""Accelerate's module paths under accel (accel.utils.operations and accel.utils.dataclasses; accel.accelerator,
accel.state, accel.data_loader and accel.test_utils as deprecated aliases) on one process with the kernel alone. Their behaviour
on 2 processes is what tests/compat/test_upstream_ports.py runs: Accelerate's own test_ops, test_sync and
test_distributed_data_loop scripts."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch

import accel
import accel.active
import accel.kernel
from accel import Kernel, PartialState, UsageError
from accel.testing import make_kernel


@pytest.fixture
def kernel() -> Iterator[Kernel]:
    k = make_kernel()
    yield k
    k.end_training()


def test_accelerates_module_paths_under_accel_are_deprecated_aliases_of_accels_objects() -> None:
    """The paths renaming ``accelerate`` to ``accel`` produces for Accelerate's modules: each name is accel's own
    object, with a DeprecationWarning naming where to import it (``from accel import X``)."""
    import accel.accelerator
    import accel.data_loader
    import accel.state
    import accel.test_utils
    import accel.test_utils.testing
    from accel.data import GradientState, skip_first_batches
    from accel.testing.regression import RegressionDataset, RegressionModel, assert_exception

    for module, name, expected, replacement in (
        (accel.accelerator, "Kernel", accel.Kernel, "accel.Kernel"),
        (accel.accelerator, "DataLoaderConfiguration", accel.DataLoaderConfiguration, "accel.DataLoaderConfiguration"),
        (
            accel.accelerator,
            "GradientAccumulationPlugin",
            accel.GradientAccumulationPlugin,
            "accel.GradientAccumulationPlugin",
        ),
        (accel.state, "PartialState", accel.PartialState, "accel.PartialState"),
        (accel.state, "GradientState", GradientState, "accel.GradientState"),
        (accel.data_loader, "skip_first_batches", skip_first_batches, "accel.skip_first_batches"),
        (accel.test_utils, "RegressionDataset", RegressionDataset, "accel.testing.regression.RegressionDataset"),
        (accel.test_utils, "RegressionModel", RegressionModel, "accel.testing.regression.RegressionModel"),
        (accel.test_utils.testing, "assert_exception", assert_exception, "accel.testing.regression.assert_exception"),
    ):
        with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{name} is deprecated .*use {replacement} "):
            assert getattr(module, name) is expected
    assert accel.GradientState is GradientState and accel.skip_first_batches is skip_first_batches
    with pytest.raises(AttributeError, match="module 'accel.state' has no attribute 'AcceleratorState'"):
        accel.state.AcceleratorState  # noqa: B018


def test_the_utils_module_paths_are_accels_own() -> None:
    import accel.utils
    import accel.utils.dataclasses
    import accel.utils.operations

    assert accel.utils.dataclasses.DistributedType is accel.utils.DistributedType
    assert accel.utils.dataclasses.DataLoaderConfiguration is accel.DataLoaderConfiguration
    assert accel.utils.operations.gather is accel.utils.gather
    assert accel.utils.operations.DistributedOperationException is accel.DistributedOperationError


def test_distributed_type_has_accelerates_members_equal_to_their_names() -> None:
    from accel.utils import DistributedType

    assert DistributedType.NO == "NO" and DistributedType.MULTI_CPU == "MULTI_CPU"
    assert DistributedType.MULTI_GPU != DistributedType.XLA
    accelerate_1_15 = "DEEPSPEED FSDP MEGATRON_LM MULTI_CPU MULTI_GPU MULTI_HPU MULTI_MLU MULTI_MUSA MULTI_NEURON "
    accelerate_1_15 += "MULTI_NPU MULTI_SDAA MULTI_XPU NO XLA"  # sorted(accelerate.utils.DistributedType.__members__)
    assert sorted(DistributedType.__members__) == accelerate_1_15.split()


def test_state_is_a_read_only_view_of_its_kernel(kernel: Kernel) -> None:
    from accel.utils import DistributedType

    state = kernel.state
    assert state == kernel.state == PartialState.of(kernel)
    assert state.distributed_type == DistributedType.NO
    assert (state.process_index, state.num_processes, state.device) == (0, 1, kernel.device)
    assert state.is_main_process and state.is_local_main_process and not state.use_distributed
    assert "Distributed environment: NO" in repr(state)
    with pytest.raises(UsageError, match=r"^kernel.state.distributed_type is read-only: .*only state.debug"):
        state.distributed_type = DistributedType.FSDP
    with pytest.raises(UsageError, match="kernel.state is this Kernel's read-only view"):
        kernel.state = make_kernel().state
    kernel.state = state  # its own view: nothing changes (Accelerate's state is a plain attribute)
    state.debug = True  # one process: nothing to check, so debug stays off
    assert not state.debug and not kernel.debug
    with pytest.raises(UsageError, match="kernel.debug expects True or False"):
        state.debug = "yes"
    with pytest.raises(AttributeError, match="no attribute 'deepspeed_plugin'"):
        _ = state.deepspeed_plugin


def test_partial_state_views_the_latest_kernel_or_makes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import accel.utils.operations as ops

    monkeypatch.setattr(accel.active, "ACTIVE", [])
    with pytest.raises(UsageError, match=r"^accel.utils.operations.gather\(\) runs on the process's Kernel"):
        ops.gather(torch.ones(2))
    state = PartialState()  # no Kernel yet: makes one
    made = accel.kernel.active_kernel()
    assert made is not None and state == made.state
    assert PartialState() == state  # and views it from then on
    t = torch.arange(3.0)
    assert torch.equal(ops.gather(t), t) and ops.gather_object(["a"]) == ["a"]
    assert torch.equal(ops.reduce(t), t) and torch.equal(ops.broadcast(t), t)
    assert torch.equal(ops.pad_across_processes(t), t) and torch.equal(ops.copy_tensor_to_devices(t), t)
    state.destroy_process_group()  # kernel.end_training()
    assert accel.kernel.active_kernel() is None


def test_pickled_kernel_has_the_same_state(kernel: Kernel) -> None:
    assert pickle.loads(pickle.dumps(kernel)).state.__dict__ == kernel.state.__dict__


def test_gradient_state_reset_is_a_no_op(kernel: Kernel) -> None:
    from accel import GradientState

    GradientState._reset_state()  # Accelerate's tests call it between Accelerators; accel's is one per Kernel
    assert kernel.gradient_state.sync_gradients


def test_regression_helpers_are_accelerates() -> None:
    from accel.testing.regression import RegressionDataset, RegressionModel, assert_exception

    a = RegressionDataset(length=4, seed=42)
    assert len(a) == 4 and set(a[0]) == {"x", "y"}
    # Accelerate 1.15's RegressionDataset(length=4, seed=42).x and .y
    assert a.x.tolist() == pytest.approx(
        [0.304717093706131, -1.039984107017517, 0.7504512071609497, 0.9405646920204163]
    )
    assert a.y.tolist() == pytest.approx([3.41433048248291, 0.7898138165473938, 4.513686180114746, 4.8495049476623535])
    assert abs(float(a.y[0]) - (2 * float(a.x[0]) + 3)) < 0.5
    model = RegressionModel(a=2, b=3)
    assert model(torch.tensor([1.0])).item() == 5.0
    with assert_exception(ValueError, "bad"):
        raise ValueError("bad input")
    with pytest.raises(AssertionError, match="ran without one"), assert_exception(ValueError):
        pass
    with pytest.raises(AssertionError, match="Expected ValueError, got KeyError"), assert_exception(ValueError):
        raise KeyError("x")


def test_prepared_batch_sampler_answers_even_batches(kernel: Kernel) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    assert loader.batch_sampler.even_batches is True and loader.batch_sampler.batch_size == 2
    again = pickle.loads(pickle.dumps(loader.batch_sampler))
    assert again.even_batches is True
