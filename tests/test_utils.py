"""accel.utils and the Kernel utilities: set_seed, tqdm, find_executable_batch_size, LocalSGD, the
kwargs handlers (Kernel(kwargs_handlers=...)), Kernel.profile, set_trigger/check_trigger and the ddp plugin's
communication hooks. Single-process tests first; then one `accel launch -n 2` (ddp, gloo) of
tests/scripts/utils_checks.py read by the multi-process tests."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from accel import UsageError
from accel.testing import imported_modules, run_launch

SCRIPTS = Path(__file__).parent / "scripts"


def test_import_accel_utils_imports_no_torch_numpy_or_tqdm() -> None:
    assert imported_modules("accel.utils", ["torch", "numpy", "tqdm"]) == []
    assert imported_modules("accel", ["accel.utils", "numpy", "tqdm"]) == []


# ---- set_seed ---------------------------------------------------------------------------------------------


def draws() -> list[float]:
    return [random.random(), float(numpy.random.rand()), float(torch.rand(1))]


def test_set_seed_seeds_random_numpy_and_torch() -> None:
    from accel.utils import set_seed

    set_seed(7)
    first = draws()
    set_seed(7)
    assert draws() == first
    set_seed(8)
    assert all(a != b for a, b in zip(draws(), first, strict=True))


def test_set_seed_deterministic_turns_on_deterministic_algorithms() -> None:
    from accel.utils import set_seed

    try:
        set_seed(1, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


# ---- find_executable_batch_size ---------------------------------------------------------------------------

OOM_SCRIPT = r"""
import json, resource, sys, torch
from accel.utils import find_executable_batch_size

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

budget = 600 * 2**20  # address space left for the function's allocation
limit = vm_bytes() + budget
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
tried, errors = [], []

@find_executable_batch_size(starting_batch_size=1024)
def train(batch_size, width):
    tried.append(batch_size)
    try:
        block = torch.ones(batch_size, width, 1024)  # batch_size x 4 MiB: a real CPU allocation
    except RuntimeError as exc:
        errors.append(str(exc).splitlines()[0][:200])
        raise
    return float(block[-1, -1, -1]) * batch_size

result = train(1024)
first = list(tried)
again = train(1024)
print(json.dumps({"result": result, "tried": first, "errors": errors, "again": again, "later": tried[len(first):]}))
"""


def test_find_executable_batch_size_shrinks_after_a_real_cpu_allocation_failure() -> None:
    """The process's address space is limited (RLIMIT_AS), so large batches fail in torch's CPU allocator
    ("DefaultCPUAllocator: can't allocate memory"); the decorator retries with int(0.9 x batch_size), as
    Accelerate, until one fits, and keeps the size found for later calls."""
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    tried = out["tried"]
    assert tried[0] == 1024 and len(tried) > 3
    assert all(b == int(a * 0.9) for a, b in zip(tried, tried[1:], strict=False))
    assert tried[-1] * 4 * 2**20 < 600 * 2**20  # the size that fitted is within the budget
    assert len(out["errors"]) == len(tried) - 1
    assert all("DefaultCPUAllocator: can't allocate memory" in e for e in out["errors"])
    assert out["result"] == float(tried[-1])
    assert out["later"] == [tried[-1]] and out["again"] == float(tried[-1])  # a later call starts there


def test_find_executable_batch_size_rules() -> None:
    from accel.utils import find_executable_batch_size, should_reduce_batch_size

    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda: calls[-1] // 2)
    def halves(batch_size: int, need: int) -> int:
        calls.append(batch_size)
        if batch_size > need:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert halves(3) == 2 and calls == [16, 8, 4, 2]

    @find_executable_batch_size(starting_batch_size=4)
    def never(batch_size: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero."):
        never()

    @find_executable_batch_size(starting_batch_size=4)
    def other(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other()

    @find_executable_batch_size(starting_batch_size=4)
    def takes(batch_size: int, model: str) -> int:
        return batch_size

    with pytest.raises(
        TypeError,
        match=r"Batch size was passed into `takes` as the first argument when called."
        r"Remove this as the decorator already does so: `takes\(model=m\)`",
    ):
        takes(8, "m")
    assert not should_reduce_batch_size(RuntimeError("something else"))


# ---- tqdm -------------------------------------------------------------------------------------------------


def test_tqdm_shows_on_the_main_process_and_refuses_a_positional_flag() -> None:
    from accel.utils import tqdm

    assert tqdm(range(2)).disable is False
    assert tqdm(range(2), disable=True).disable is True
    with pytest.raises(UsageError, match="pass main_process_only=True/False as a keyword"):
        tqdm(True, range(2))


def test_tqdm_without_the_package_is_one_clear_line() -> None:
    code = (
        "import sys; sys.modules['tqdm'] = None; sys.modules['tqdm.auto'] = None\n"
        "from accel.utils import tqdm\n"
        "try:\n    tqdm(range(2))\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "UsageError accel.utils.tqdm needs the tqdm package: pip install tqdm"


# ---- kwargs handlers --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(
    "ignore:kwargs_handlers:UserWarning"
)  # one process: ddp is not active (notice tested below)
def test_kwargs_handlers_set_the_options_plugins_declare(accel_kernel: Any) -> None:
    from accel.utils import (
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )

    profile = ProfileKwargs(record_shapes=True)
    kernel = accel_kernel(
        ["ddp", "amp"],
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                find_unused_parameters=True,
                bucket_cap_mb=5,
                static_graph=True,
                comm_hook=DDPCommunicationHookType.POWER_SGD,
                comm_wrapper="fp16",
                comm_state_option={"matrix_approximation_rank": 2},
            ),
            GradScalerKwargs(init_scale=1024.0, growth_interval=10),
            InitProcessGroupKwargs(timeout=timedelta(seconds=800)),
            profile,
        ],
    )
    s = kernel.settings
    assert (s["ddp_find_unused_parameters"], s["ddp_bucket_cap_mb"], s["ddp_static_graph"]) == (True, 5.0, True)
    assert (s["ddp_comm_hook"], s["ddp_comm_wrapper"]) == ("power_sgd", "fp16")
    assert s["ddp_comm_state_option"] == {"matrix_approximation_rank": 2}
    assert (s["grad_scaler_init_scale"], s["grad_scaler_growth_interval"]) == (1024.0, 10)
    assert s["ddp_timeout"] == 800.0
    assert s.sources["ddp_timeout"] == "argument"
    assert kernel.profile_handler is profile
    assert s["ddp_broadcast_buffers"] is True  # fields left at their defaults set nothing


def test_grad_scaler_and_autocast_handlers_reach_torch(accel_kernel: Any) -> None:
    from accel.utils import AutocastKwargs, GradScalerKwargs

    kernel = accel_kernel(["amp"], mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=512.0)])
    scaler = next(c.scaler for c in kernel.components if getattr(c, "scaler", None) is not None)
    assert scaler.get_scale() == 512.0
    a = torch.randn(4, 4)
    with accel_kernel(["amp"], mixed_precision="bf16").autocast():
        assert torch.mm(a, a).dtype == torch.bfloat16
    with accel_kernel(["amp"], mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)]).autocast():
        assert torch.mm(a, a).dtype == torch.float32


@pytest.mark.parametrize(
    "handlers,arguments,message",
    [
        ("two", {}, "You can only pass one GradScalerKwargs in `kwargs_handlers`."),
        ("dim", {}, "DistributedDataParallelKwargs(dim=...) is not supported: no installed plugin takes that field"),
        ("init_method", {}, "InitProcessGroupKwargs(init_method=...) is not supported"),
        (
            "conflict",
            {"grad_scaler_init_scale": 4.0},
            "GradScalerKwargs(init_scale=2.0) disagrees with Kernel(grad_scaler_init_scale=4.0); give one of them",
        ),
        ("object", {}, "Kernel(kwargs_handlers=...) takes kwargs-handler objects"),
        ("bad_hook", {}, "must be one of no, fp16, bf16, power_sgd, batched_power_sgd, got 'fp8'"),
    ],
)
def test_kwargs_handler_mistakes_are_one_line(
    accel_kernel: Any, handlers: str, arguments: dict[str, Any], message: str
) -> None:
    from accel.utils import DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs

    given = {
        "two": [GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)],
        "dim": [DistributedDataParallelKwargs(dim=1)],
        "init_method": [InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1")],
        "conflict": [GradScalerKwargs(init_scale=2.0)],
        "object": [object()],
        "bad_hook": [DistributedDataParallelKwargs(comm_hook="fp8")],
    }[handlers]
    with pytest.raises(UsageError) as info:
        accel_kernel(["ddp", "amp"], kwargs_handlers=given, **arguments)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_handler_without_its_plugin_installed_is_refused(accel_kernel: Any) -> None:
    from accel.utils import GradScalerKwargs

    with pytest.raises(UsageError, match=r"GradScalerKwargs\(init_scale=...\) is not supported"):
        accel_kernel([], kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    accel_kernel([], kwargs_handlers=[GradScalerKwargs()]).end_training()  # all defaults: nothing to set


@pytest.mark.parametrize("name", ["FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs"])
def test_fp8_recipe_handlers_are_refused_with_the_options_to_use(name: str) -> None:
    import accel.utils

    with pytest.raises(
        UsageError,
        match=rf"{name} is not supported: accel sets fp8 through options: "
        r"Kernel\(mixed_precision='fp8', fp8_recipe=",
    ):
        getattr(accel.utils, name)(backend="te")


def test_handlers_keep_accelerate_names_fields_and_to_kwargs() -> None:
    import accel_ddp
    from accel.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, InitProcessGroupKwargs

    assert DistributedDataParallelKwargs is accel_ddp.DistributedDataParallelKwargs
    assert [m.name for m in DDPCommunicationHookType] == ["NO", "FP16", "BF16", "POWER_SGD", "BATCHED_POWER_SGD"]
    assert DistributedDataParallelKwargs(static_graph=True).to_kwargs() == {"static_graph": True}
    assert InitProcessGroupKwargs().timeout == timedelta(seconds=600)
    assert InitProcessGroupKwargs(backend="gloo").timeout == timedelta(seconds=1800)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        import accel.utils

        accel.utils.Nope  # noqa: B018


# ---- profile, triggers, LocalSGD on one process -----------------------------------------------------------


def test_profile_on_one_process(accel_kernel: Any, tmp_path: Path) -> None:
    from accel.utils import ProfileKwargs

    kernel = accel_kernel([])
    with kernel.profile() as prof:
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
    assert any(e.key == "aten::mm" for e in prof.key_averages())
    with kernel.profile(ProfileKwargs(output_trace_dir=str(tmp_path / "t"), with_flops=True)):
        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
    trace = json.loads((tmp_path / "t" / "profile_0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    with pytest.raises(
        UsageError, match="ProfileKwargs\\(activities=...\\): 'tpu' is not available here; choose from cpu"
    ):
        with kernel.profile(ProfileKwargs(activities=["tpu"])):
            pass


def test_trigger_and_local_sgd_on_one_process(accel_kernel: Any) -> None:
    from accel.utils import LocalSGD

    kernel = accel_kernel([])
    assert kernel.check_trigger() is False
    kernel.set_trigger()
    assert kernel.check_trigger() is True
    assert kernel.check_trigger() is False
    model = kernel.prepare(torch.nn.Linear(2, 2))
    with LocalSGD(kernel, model, local_sgd_steps=2) as sgd:
        sgd.step()
        sgd.step()
    assert sgd.enabled is False and sgd.num_steps == 2  # one process: nothing to average, as Accelerate
    with pytest.raises(UsageError, match="local_sgd_steps=0"):
        LocalSGD(kernel, model, local_sgd_steps=0)


def test_comm_hook_options_are_validated(accel_kernel: Any) -> None:
    with pytest.raises(
        UsageError,
        match=r"Kernel\(ddp_comm_wrapper=...\) must be one of no, fp16, bf16, got "
        r"'power_sgd'",
    ):
        accel_kernel(["ddp"], ddp_comm_wrapper="power_sgd")


# ---- two processes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("utils")
    out = tmp / "out"
    out.mkdir()
    run_launch(
        ["-q", str(SCRIPTS / "utils_checks.py"), str(out)],
        num_processes=2,
        home=tmp / "home",
        registered=["ddp"],
        cwd=tmp,
        timeout=240,
    )
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rec in enumerate(records):
        rec["traces"] = sorted(p.name for p in (out / "traces").iterdir())
        rec["trace_events"] = json.loads((out / "traces" / f"profile_{r}.json").read_text())["traceEvents"]
    return records


@pytest.mark.multiprocess
def test_set_seed_agrees_across_processes_and_device_specific_differs(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["same"] == ranks[1]["same"]
    assert all(a != b for a, b in zip(ranks[0]["specific"], ranks[1]["specific"], strict=True))
    assert ranks[0]["specific"] == ranks[0]["same"]  # rank 0 adds 0


@pytest.mark.multiprocess
def test_tqdm_shows_on_the_local_main_process_only(ranks: list[dict[str, Any]]) -> None:
    assert [r["bar_disabled"] for r in ranks] == [False, True]
    assert [r["bar_everywhere"] for r in ranks] == [False, False]


@pytest.mark.multiprocess
def test_trigger_set_on_one_process_is_seen_by_all_then_reset(ranks: list[dict[str, Any]]) -> None:
    assert [r["triggers"] for r in ranks] == [[False, True, False]] * 2


@pytest.mark.smoke
@pytest.mark.multiprocess
def test_local_sgd_averages_every_n_steps_and_not_in_between(ranks: list[dict[str, Any]]) -> None:
    for a, b in zip(ranks[0]["local_sgd"], ranks[1]["local_sgd"], strict=True):
        if a["step"] % 3 == 0:
            assert a["checksum"] == pytest.approx(b["checksum"], abs=1e-9), a
        else:  # no gradient synchronisation inside LocalSGD: each rank followed its own data
            assert abs(a["checksum"] - b["checksum"]) > 1e-3, a


@pytest.mark.multiprocess
def test_profile_writes_a_trace_per_process_and_calls_its_handler(ranks: list[dict[str, Any]]) -> None:
    for r, rec in enumerate(ranks):
        assert rec["traces"] == ["profile_0.json", "profile_1.json"]
        assert rec["profile"]["on_trace_ready"] == [r]  # one active cycle (repeat=1), handler in its own process
        assert any(e.get("name") == "aten::addmm" for e in rec["trace_events"])


@pytest.mark.smoke
@pytest.mark.multiprocess
def test_ddp_communication_hooks_register_and_train(ranks: list[dict[str, Any]]) -> None:
    """Every hook trains, synchronised, where torch runs it (the same hook on a plain DistributedDataParallel,
    recorded as ``torch_alone``), and is refused in one line where torch fails with it: bf16 compression on gloo
    (torch refuses it at registration), batched PowerSGD on torch 2.13 (a bare AssertionError at the first
    compressed step, which the plugin foresees)."""
    hooks = [r["comm_hooks"] for r in ranks]
    expected = {
        "no": [],
        "fp16": ["fp16_compress_hook"],
        "bf16": ["bf16_compress_hook"],
        "power_sgd": ["powerSGD_hook"],
        "batched_power_sgd": ["batched_powerSGD_hook"],
        "power_sgd+fp16": ["fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook"],
        "power_sgd+bf16": ["bf16_compress_wrapper.<locals>.bf16_compress_wrapper_hook"],
    }
    assert set(hooks[0]) == set(expected)
    for name in ("no", "fp16", "power_sgd", "power_sgd+fp16"):  # these run on gloo with every torch we accept
        assert hooks[0][name]["torch_alone"] is None, hooks[0][name]["torch_alone"]
    for name, registered in expected.items():
        if hooks[0][name]["torch_alone"] is None:
            for rec in hooks:
                assert rec[name]["error"] is None, rec[name]["error"]
                assert rec[name]["hooks"] == registered
                assert len(rec[name]["losses"]) == 5 and rec[name]["after"] != rec[name]["before"]
            assert hooks[0][name]["after"] == hooks[1][name]["after"]  # synchronised through the hook
        else:
            hook, _, wrapper = name.partition("+")
            what = f"ddp_comm_hook={hook}" + (f" with ddp_comm_wrapper={wrapper}" if wrapper else "")
            for rec in hooks:
                error = rec[name]["error"]
                assert error is not None and "\n" not in error, (name, error)
                assert error.startswith(f"UsageError: {what} cannot be used"), error
                assert error.endswith(("; choose another hook", "; use power_sgd")), error
    assert [rec["no"]["ddp"] for rec in hooks] == [[True, True, False]] * 2  # static_graph, bucket view, buffers
    # the plugin's defaults: gradient_as_bucket_view on, torch's for the other two
    assert [rec["fp16"]["ddp"] for rec in hooks] == [[False, True, True]] * 2
    assert hooks[0]["fp16"]["after"] != hooks[0]["no"]["after"]  # fp16 compression changed the gradients
    assert hooks[0]["power_sgd"]["after"] != hooks[0]["no"]["after"]  # PowerSGD from its 2nd step


def test_handler_fields_of_an_inactive_plugin_get_one_notice(accel_kernel: Any) -> None:
    from accel.utils import DistributedDataParallelKwargs, GradScalerKwargs

    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True), GradScalerKwargs(init_scale=4.0)]
    with pytest.warns(UserWarning) as caught:
        accel_kernel(["ddp", "amp"], kwargs_handlers=handlers)  # one process, no mixed precision
    assert [str(w.message) for w in caught] == [
        "kwargs_handlers: DistributedDataParallelKwargs(find_unused_parameters=...), GradScalerKwargs(init_scale=...) "
        "change nothing in this run (no active plugin uses them)"
    ]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scaler is used with fp16: no notice
        accel_kernel(["ddp", "amp"], mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=4.0)])


def test_comm_hook_options_from_a_config_file_and_flags(tmp_path: Path) -> None:
    from accel.config_files import read_config_file, validate_config
    from accel.options import resolve
    from accel.plugins import Plugins

    plugins = Plugins.load(env={"ACCEL_PLUGINS": "ddp"})
    declared = plugins.options()
    path = tmp_path / "config.yaml"
    path.write_text(
        "ddp_comm_hook: power_sgd\nddp_comm_wrapper: fp16\nddp_comm_state_option:\n  matrix_approximation_rank: 2\n"
    )
    config, notes = validate_config(read_config_file(path), declared, ["ddp"], str(path))
    assert notes == []
    values, sources = resolve(declared, config=config, env={})
    assert (values["ddp_comm_hook"], values["ddp_comm_wrapper"]) == ("power_sgd", "fp16")
    assert values["ddp_comm_state_option"] == {"matrix_approximation_rank": 2}
    values, sources = resolve(
        declared, config=config, env={}, flags={"ddp_comm_state_option": '{"start_powerSGD_iter": 3}'}
    )
    assert values["ddp_comm_state_option"] == {"start_powerSGD_iter": 3} and sources["ddp_comm_state_option"] == "flag"
