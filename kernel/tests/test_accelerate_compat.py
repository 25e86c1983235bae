"""Accelerate's arguments and objects on accel: each one works with Accelerate's meaning or is refused in one line
(Kernel arguments, DataLoaderConfiguration, split_batches sharding, gradient_accumulation_steps set between steps,
prepared optimizers and schedulers passing every other attribute to the wrapped object, Megatron-LM configs mapped
or refused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from accel import DataLoaderConfiguration, GradientAccumulationPlugin, hookimpl
from accel.data import BatchSamplerShard
from accel.errors import UsageError
from accel.kernel import PreparedOptimizer
from accel.testing import make_kernel, run_accel

# ---- Kernel arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"even_batches": "no"}, r"^Kernel\(even_batches=...\) expects True or False, got 'no'$"),
        ({"split_batches": 1}, r"^Kernel\(split_batches=...\) expects True or False, got 1$"),
        ({"step_scheduler_with_optimizer": "false"}, r"step_scheduler_with_optimizer=...\) expects True or False"),
        (
            {"device_placement": False},
            r"device_placement=False\) is not supported: .*prepare\(dataloader, "
            r"device_placement=False\)",
        ),
        ({"dispatch_batches": True}, r"dispatch_batches=True is not supported: every process reads its own shard"),
        (
            {"rng_types": ["torch", "generator"]},
            r"rng_types=\['torch', 'generator'\]\) is not supported: .*torch .*"
            r"accel.utils.set_seed",
        ),
        ({"dataloader_config": {"split_batches": True}}, r"expects an accel.DataLoaderConfiguration, got dict"),
        (
            {"split_batches": False, "dataloader_config": DataLoaderConfiguration(split_batches=True)},
            r"Kernel\(split_batches=False\) disagrees with dataloader_config.split_batches=True",
        ),
        (
            {"gradient_accumulation_steps": 2, "gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2)},
            r"not both",
        ),
    ],
)
def test_accelerate_arguments_accel_refuses_say_what_to_use_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        make_kernel(**kwargs)
    assert "\n" not in str(info.value)


class Explains:
    """A plugin module that knows another library's names (as accel-accelerate's ``accelerate-names`` does)."""

    @staticmethod
    @hookimpl
    def accel_explain_name(kind: str, name: str) -> str | None:
        if name == "other_plugin":
            return f"{kind} {name}: use Kernel(plugins=['other'])"
        return None


def test_a_name_a_plugin_explains_gets_its_line_and_others_pythons_error() -> None:
    """``accel_explain_name``: an unknown argument a plugin explains is a UsageError with its line, an unknown
    member (read or assigned) an AttributeError with it; a name no plugin explains keeps Python's error."""
    with pytest.raises(UsageError, match=r"^argument other_plugin: use Kernel\(plugins=\['other'\]\)$"):
        make_kernel(extra=[("explains", Explains)], other_plugin=1)
    with pytest.raises(TypeError, match="unexpected argument 'no_such_thing'"):
        make_kernel(extra=[("explains", Explains)], no_such_thing=1)
    kernel = make_kernel(extra=[("explains", Explains)])
    try:
        with pytest.raises(AttributeError, match=r"^member other_plugin: use"):
            kernel.other_plugin  # noqa: B018
        with pytest.raises(AttributeError, match=r"^member other_plugin: use"):
            kernel.other_plugin = 3
        with pytest.raises(AttributeError, match="'Kernel' object has no attribute 'no_such_thing'"):
            kernel.no_such_thing  # noqa: B018
        kernel.no_such_thing = 3  # a name nobody explains is a plain attribute, as on any object
        assert kernel.no_such_thing == 3
    finally:
        kernel.end_training()
    bare = make_kernel()  # no plugin explains anything: Python's words
    try:
        with pytest.raises(AttributeError, match="'Kernel' object has no attribute 'other_plugin'"):
            bare.other_plugin  # noqa: B018
    finally:
        bare.end_training()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rng_types": ["generator"]},
        {"rng_types": None},
        {"device_placement": True},
        {"dispatch_batches": False},
        {"use_seedable_sampler": True},
        {"use_seedable_sampler": False},
        {"dataloader_config": DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)},
    ],
)
def test_accelerate_arguments_that_change_nothing_here_are_accepted(kwargs: dict[str, Any]) -> None:
    make_kernel(**kwargs).end_training()


def test_a_misspelt_argument_is_still_a_type_error_with_a_suggestion() -> None:
    with pytest.raises(TypeError, match="mixed_precison.*did you mean `mixed_precision`"):
        make_kernel(mixed_precison="no")


def test_dataloader_configuration_fields_are_accelerates() -> None:
    import dataclasses

    names = [f.name for f in dataclasses.fields(DataLoaderConfiguration)]
    assert names == [
        "split_batches",
        "dispatch_batches",
        "even_batches",
        "use_seedable_sampler",
        "data_seed",
        "non_blocking",
        "use_stateful_dataloader",
    ]
    kernel = make_kernel(dataloader_config=DataLoaderConfiguration(even_batches=False, data_seed=7, non_blocking=True))
    assert (kernel.even_batches, kernel.non_blocking, kernel.split_batches, kernel.dispatch_batches) == (
        False,
        True,
        False,
        False,
    )
    assert kernel.dataloader_config.data_seed == 7 and kernel.use_stateful_dataloader
    kernel.end_training()


def test_data_seed_sets_the_shuffling_seed() -> None:
    def order(seed: int) -> list[int]:
        kernel = make_kernel(dataloader_config=DataLoaderConfiguration(data_seed=seed))
        loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
        out = [int(v) for (batch,) in loader for v in batch]
        kernel.end_training()
        return out

    torch.manual_seed(0)
    first = order(5)
    torch.manual_seed(1)  # the global generator no longer decides
    assert order(5) == first == torch.randperm(12, generator=torch.Generator().manual_seed(5)).tolist()
    assert order(6) != first


# ---- split_batches -----------------------------------------------------------------------------------------------


def shards(n_samples: int, batch_size: int, even: bool, drop_last: bool = False) -> list[list[list[int]]]:
    sampler = BatchSampler(SequentialSampler(range(n_samples)), batch_size, drop_last)
    return [list(BatchSamplerShard(sampler, 2, r, even, split_batches=True)) for r in range(2)]


def test_split_batches_gives_each_process_its_slice_of_every_batch() -> None:
    # Accelerate's docstring: [[0, 1, 2, 3], [4, 5, 6, 7]] -> process 0 [0, 1], [4, 5]; process 1 [2, 3], [6, 7]
    assert shards(8, 4, even=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # a short last batch is completed from the first batch, or left short (the process past its end gets nothing)
    assert shards(10, 4, even=True) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert shards(9, 4, even=False) == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7]]]
    assert shards(10, 4, even=True, drop_last=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(
        UsageError,
        match=r"split_batches=True needs a batch size that divides by the number of "
        r"processes \(2\); this dataloader's batch size is 3",
    ):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(6)), 3, False), 2, 0, True, split_batches=True)


def test_split_batches_on_one_process_keeps_the_batches() -> None:
    kernel = make_kernel(split_batches=True)
    loader = kernel.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    assert [b.tolist() for (b,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(loader) == 3
    kernel.end_training()


# ---- gradient_accumulation_steps set between steps ---------------------------------------------------------------


def test_gradient_accumulation_steps_can_be_set_between_steps() -> None:
    kernel = make_kernel(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = kernel.prepare(torch.nn.Linear(2, 1))
    syncs = []
    for step in range(10):
        if step == 4:
            kernel.gradient_accumulation_steps = 3
        with kernel.accumulate(model):
            syncs.append(kernel.sync_gradients)
    assert syncs == [False, True, False, True, False, True, False, False, True, False]
    assert kernel.gradient_accumulation_steps == 3
    loss = torch.tensor(6.0, requires_grad=True)
    assert float(kernel.scale_for_accumulation(loss)) == 2.0  # the loss is divided by the new value
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(UsageError, match="gradient_accumulation_steps expects a whole number >= 1"):
            kernel.gradient_accumulation_steps = bad  # type: ignore[assignment]
    kernel.end_training()


# ---- prepared optimizers and schedulers pass attributes through --------------------------------------------------


def test_schedule_free_optimizer_train_and_eval_through_the_prepared_optimizer() -> None:
    """schedulefree.AdamWScheduleFree needs optimizer.train() before training and optimizer.eval() before
    evaluation; through the prepared optimizer the run equals the same optimizer driven directly."""
    schedulefree = pytest.importorskip("schedulefree")

    def train(prepare: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2)
        kernel = make_kernel()
        if prepare:
            model, opt = kernel.prepare(model, opt)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 3, generator=gen), torch.randn(16, 1, generator=gen)
        model.train()
        opt.train()
        for i in range(0, 16, 4):
            kernel.backward(torch.nn.functional.mse_loss(model(x[i : i + 4]), y[i : i + 4]))
            opt.step()
            opt.zero_grad()
        trained = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.eval()  # swaps in the averaged weights
        evaluated = torch.cat([p.detach().flatten() for p in model.parameters()])
        kernel.end_training()
        return trained, evaluated, opt

    trained, evaluated, prepared = train(prepare=True)
    ref_trained, ref_evaluated, _ = train(prepare=False)
    assert isinstance(prepared, PreparedOptimizer)
    assert torch.equal(trained, ref_trained) and torch.equal(evaluated, ref_evaluated)
    assert not torch.equal(trained, evaluated)  # eval() really changed the weights
    assert prepared.param_groups[0]["train_mode"] is False  # read through


def test_prepared_optimizer_reads_writes_and_calls_go_to_the_wrapped_optimizer() -> None:
    kernel = make_kernel()
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = kernel.prepare(inner)
    opt.custom_flag = 3
    assert inner.custom_flag == 3 and opt.custom_flag == 3 and "custom_flag" not in vars(opt)
    del opt.custom_flag
    assert not hasattr(inner, "custom_flag")
    calls = []
    handle = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert calls == [inner]  # the hook was registered on the wrapped optimizer, which stepped
    handle.remove()
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = opt.no_such_thing
    # a scheduler built on the prepared optimizer still works (torch wraps the optimizer's step)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    kernel.end_training()


def test_prepared_scheduler_reads_and_writes_go_to_the_wrapped_scheduler() -> None:
    kernel = make_kernel()
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt, sched = kernel.prepare(opt, inner)
    sched.gamma = 0.1
    sched.base_lrs = [1.0]
    assert inner.gamma == 0.1 and inner.base_lrs == [1.0] and "gamma" not in vars(sched)
    opt.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.01])
    kernel.end_training()


# ---- Megatron-LM -------------------------------------------------------------------------------------------------


@pytest.mark.requires_plugins("ddp")  # MULTI_CPU selects it; without it the launch is refused for that instead
def test_a_megatron_section_with_another_strategy_is_refused_in_one_line(tmp_path: Path) -> None:
    """megatron_lm_config runs on accel-plugin-parallel (plugins/parallel/tests/test_pipeline.py); with MULTI_CPU (ddp) it is refused."""
    config = tmp_path / "megatron.yaml"
    config.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n"
    )
    (tmp_path / "train.py").write_text("print('hello')\n")
    proc = run_accel(
        ["launch", "--dry-run", "--config_file", str(config), str(tmp_path / "train.py")], home=tmp_path / "home"
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel: error")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "megatron_lm_config (megatron_lm_tp_degree) is set, but ddp is selected" in lines[0]


def test_an_empty_megatron_section_is_not_a_request(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_CPU\nmegatron_lm_config: {}\n")
    proc = run_accel(["config", "show", "--config_file", str(config)], home=tmp_path / "home")
    assert proc.returncode == 0, proc.stderr
