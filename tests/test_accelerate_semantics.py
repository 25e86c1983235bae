"""Accelerate's utilities, data-loader state and process control as accel has them, on real processes (gloo on
127.0.0.1, free ports).

What Accelerate 1.15 gives was measured on 2 CPU processes (torch 2.13.0, ``torchrun --nproc_per_node 2`` of a probe
script using ``Accelerator(cpu=True)``) and is written here as ``ACCELERATE_*``; where accel differs on purpose the
test says so (docs/migrating-from-accelerate.md, "What behaves differently").
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import accel
from accel import Component, DataLoaderConfiguration, Kernel, UsageError, hookimpl

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACCEL = Path(sys.executable).with_name("accel")
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT = 240

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import clean_env, free_port  # noqa: E402

#: Accelerate 1.15's split_between_processes of 5 elements on 2 processes (process 0, process 1); the input's last
#: element pads. A process without a share (1 element) gets an empty one, with padding the last element.
ACCELERATE_SPLIT = {
    "list_padFalse": (["list", [0, 1, 2]], ["list", [3, 4]]),
    "list_padTrue": (["list", [0, 1, 2]], ["list", [3, 4, 4]]),
    "tuple_padFalse": (["tuple", [0, 1, 2]], ["tuple", [3, 4]]),
    # Accelerate: TypeError: can only concatenate tuple (not "list") to tuple. accel pads a tuple as a list.
    "tuple_padTrue": (["tuple", [0, 1, 2]], ["tuple", [3, 4, 4]]),
    "tensor_padFalse": (["Tensor", [0, 1, 2]], ["Tensor", [3, 4]]),
    "tensor_padTrue": (["Tensor", [0, 1, 2]], ["Tensor", [3, 4, 4]]),
    "tensor2d_padFalse": (["Tensor", [[0, 1], [2, 3], [4, 5]]], ["Tensor", [[6, 7], [8, 9]]]),
    "tensor2d_padTrue": (["Tensor", [[0, 1], [2, 3], [4, 5]]], ["Tensor", [[6, 7], [8, 9], [8, 9]]]),
    "dict_padFalse": (
        {"a": ["list", [0, 1, 2]], "b": ["Tensor", [0, 1, 2]]},
        {"a": ["list", [3, 4]], "b": ["Tensor", [3, 4]]},
    ),
    "dict_padTrue": (
        {"a": ["list", [0, 1, 2]], "b": ["Tensor", [0, 1, 2]]},
        {"a": ["list", [3, 4, 4]], "b": ["Tensor", [3, 4, 4]]},
    ),
    "dataset_padFalse": (
        ["Dataset", {"x": [0, 1, 2], "y": ["a", "b", "c"]}],
        ["Dataset", {"x": [3, 4], "y": ["d", "e"]}],
    ),
    "dataset_padTrue": (
        ["Dataset", {"x": [0, 1, 2], "y": ["a", "b", "c"]}],
        ["Dataset", {"x": [3, 4, 4], "y": ["d", "e", "e"]}],
    ),
    "one_padFalse": (["list", [7]], ["list", []]),
    "one_padTrue": (["list", [7]], ["list", [7]]),
    "dataset_one_padFalse": (["Dataset", {"x": [7]}], ["Dataset", {"x": []}]),
    "dataset_one_padTrue": (["Dataset", {"x": [7]}], ["Dataset", {"x": [7]}]),
}

#: Accelerator 1.15's public attributes a script can assign: properties with a setter, then the instance
#: attributes ``Accelerator(cpu=True).__init__`` sets (``vars(accelerator)``, public names).
ACCELERATE_SETTABLE = (
    "even_batches",
    "gradient_accumulation_steps",
    "sync_gradients",
    "ao_recipe_handler",
    "autocast_handler",
    "dataloader_config",
    "ddp_handler",
    "delayed_fp8_autocast",
    "device_placement",
    "flag_tensor",
    "fp8_enabled",
    "fp8_recipe_handler",
    "gradient_state",
    "has_fp8_handler",
    "has_lomo_optimizer",
    "init_handler",
    "log_with",
    "msamp_recipe_handler",
    "native_amp",
    "profile_handler",
    "project_configuration",
    "rng_types",
    "scaler",
    "scaler_handler",
    "state",
    "step",
    "step_scheduler_with_optimizer",
    "te_recipe_handler",
    "trackers",
)


def launch(args: list[str], tmp: Path, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, env=clean_env(tmp / "home"), cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def accel_launch(tmp: Path, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    return launch(
        [str(ACCEL), "launch", "-q", "-n", "2", "--main_process_port", str(free_port()), *args], tmp, expect_ok
    )


def ranks(out: Path, n: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


# ---- one launch of 2 processes, many checks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("semantics")
    (tmp / "out").mkdir()
    # the timeout bounds the run: a process left waiting in an all-reduce (join_uneven_inputs) fails the test
    accel_launch(tmp, str(SCRIPTS / "semantics_checks.py"), str(tmp / "out"))
    return ranks(tmp / "out")


@pytest.mark.multiprocess
def test_split_between_processes_takes_every_input_accelerate_takes(checks: list[dict[str, Any]]) -> None:
    for name, expected in ACCELERATE_SPLIT.items():
        assert (checks[0]["split"][name], checks[1]["split"][name]) == expected, name
    for r in (0, 1):
        split = checks[r]["split"]
        # Accelerate replaces the dict's values with the shares; accel leaves the input as it was
        for pad in (False, True):
            assert split[f"dict_pad{pad}_input_after"] == {
                "a": ["list", [0, 1, 2, 3, 4]],
                "b": ["Tensor", list(range(5))],
            }
        assert split["refused_mismatch"].startswith("UsageError: split_between_processes: the dict's values have")
        assert split["refused_int"].startswith("UsageError: split_between_processes got int, which it does not split")


@pytest.mark.multiprocess
def test_synchronize_rng_states_gives_every_process_the_main_process_state(checks: list[dict[str, Any]]) -> None:
    rng0, rng1 = checks[0]["rng"], checks[1]["rng"]
    assert rng0["before"] != rng1["before"]  # seeded differently
    assert rng0["after"] == rng1["after"]  # "torch": process 0's CPU generator everywhere
    assert rng0["generator"] == rng1["generator"] == torch.rand(1, generator=torch.Generator().manual_seed(100)).item()
    for r in (0, 1):  # Accelerate fails on these with AssertionError; accel says it in one line
        refused = checks[r]["rng"]["refused"]
        assert "needs the generator" in refused[0]
        assert "rng_types ['cuda'] name a device this run does not use (it runs on cpu)" in refused[1]
        assert "unknown rng_types ['bogus']" in refused[2]


@pytest.mark.multiprocess
def test_gradient_state_active_dataloader(checks: list[dict[str, Any]]) -> None:
    for r in (0, 1):
        assert checks[r]["active"] == {
            "before": "None",
            "in_before": False,
            "inside_is_loader": True,
            "in_inside": True,
            "after": "None",
        }


@pytest.mark.multiprocess
def test_trigger_sync_in_backward_syncs_forwards_run_under_no_sync(checks: list[dict[str, Any]]) -> None:
    local0, local1 = checks[0]["trigger"]["local"], checks[1]["trigger"]["local"]
    mean = [(a + b) / 2 for a, b in zip(local0, local1, strict=True)]
    assert local0 != local1
    assert checks[0]["trigger"]["grads"] == checks[1]["trigger"]["grads"] == pytest.approx(mean)
    # the control: the same steps without the context leave each process with its own gradients
    assert checks[0]["no_trigger"]["grads"] == local0 and checks[1]["no_trigger"]["grads"] == local1


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["join_argument", "join_kernel"])
def test_join_uneven_inputs_never_hands_out_an_empty_batch(checks: list[dict[str, Any]], case: str) -> None:
    """5 samples in batches of 2 with uneven batches: process 1 has one batch, process 0 two. The model raises on an
    empty batch; under join_uneven_inputs process 1 stops after its batch and torch's Join answers the all-reduce
    of process 0's second backward (the launch's timeout proves nothing waited forever)."""
    one, two = checks[0][case], checks[1][case]
    assert one["seen"] == [[[0.0, 1.0], [2.0, 3.0]], [[8.0, 9.0]]]
    assert two["seen"] == [[[4.0, 5.0], [6.0, 7.0]]]
    assert one["end_of_dataloader"] == [False, True] and two["end_of_dataloader"] == [True]
    assert one["params"] == two["params"]  # the joined process took part in every all-reduce
    # outside the context the kernel's own batching is back: even (2 batches each) or uneven with an empty one
    assert (one["after"], two["after"]) == (([2, 2], [2, 2]) if case == "join_argument" else ([2, 1], [2, 0]))


@pytest.mark.multiprocess
def test_pickled_kernel_is_the_same_kernel_in_its_process(checks: list[dict[str, Any]]) -> None:
    assert checks[0]["attributes"]["pickle_is_same_kernel"] and checks[1]["attributes"]["pickle_is_same_kernel"]


# ---- one process -----------------------------------------------------------------------------------------------


def test_every_attribute_accelerate_lets_a_script_assign() -> None:
    """Each public attribute Accelerator lets a script assign: the Kernel accepts the value it holds (and refuses
    another it cannot honour in one line); one Kernel does not have raises the line that reading it raises, instead
    of adding an attribute nothing reads."""
    from accel_accelerate import names  # the tables of Accelerate's names (accel-accelerate's plugin)

    kernel = Kernel()
    table = names.accelerate_names()["members"]
    for name in ACCELERATE_SETTABLE:
        entry = table[name]
        if entry["status"] == "same":
            value = getattr(kernel, name)
            setattr(kernel, name, value)
            assert getattr(kernel, name) == value, name
        else:
            with pytest.raises(AttributeError) as info:
                setattr(kernel, name, None)
            assert str(info.value) == names.member_message(name), name
    kernel.gradient_accumulation_steps = 3
    kernel.even_batches = False
    assert kernel.gradient_accumulation_steps == 3 and kernel.dataloader_config.even_batches is False
    kernel.dataloader_config = DataLoaderConfiguration(split_batches=True, even_batches=True, non_blocking=True)
    assert kernel.split_batches and kernel.even_batches and kernel.non_blocking
    for name, value, line in (
        (
            "dataloader_config",
            {"split_batches": True},
            "kernel.dataloader_config expects an accel.DataLoaderConfiguration",
        ),
        ("device_placement", False, "kernel.device_placement = False is not supported"),
        ("rng_types", ["torch", "cuda"], "kernel.rng_types = ['torch', 'cuda'] is not supported"),
        ("log_with", "jsonl", "kernel.log_with = 'jsonl': trackers are chosen when the Kernel is created"),
        ("trackers", [object()], "kernel.trackers cannot be replaced"),
    ):
        with pytest.raises(UsageError) as refused:
            setattr(kernel, name, value)
        assert str(refused.value).startswith(line), name
    kernel.end_training()


def test_a_pickled_kernel_in_another_process_knows_the_run_and_refuses_the_rest(tmp_path: Path) -> None:
    kernel = Kernel()
    data = pickle.dumps(kernel)
    assert pickle.loads(data) is kernel
    code = (
        "import pickle, sys\n"
        "k = pickle.loads(sys.stdin.buffer.read())\n"
        "print(repr(k), k.is_main_process, k.num_processes, k.device, k.even_batches)\n"
        "try:\n    k.wait_for_everyone()\nexcept AttributeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
    lines = proc.stdout.decode().splitlines()
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert lines[0] == "Kernel(detached copy, process 0/1, device=cpu) True 1 cpu True"
    assert lines[1].startswith("kernel.wait_for_everyone: this Kernel was unpickled in another process than the one")
    kernel.end_training()


def test_split_between_processes_on_one_process_refuses_nothing_accelerate_takes() -> None:
    kernel = Kernel()
    with kernel.split_between_processes((1, 2)) as part:
        assert part == (1, 2)
    kernel.end_training()


def test_synchronize_rng_states_is_accelerates_free_function_too() -> None:
    import accel.utils

    assert accel.synchronize_rng_states is accel.utils.synchronize_rng_states
    state = torch.get_rng_state()
    accel.synchronize_rng_states(["torch"])  # no Kernel, one process: nothing to synchronise
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(UsageError, match=r"unknown rng_types \['numpy'\]"):
        accel.synchronize_rng_states(["numpy"])


class Strategy(Component):
    role = "strategy"


class Claims:
    """A plugin whose strategy takes part in every run, asked for by the settings (requested) or not."""

    def __init__(self, requested: bool) -> None:
        self.requested = requested

    @hookimpl
    def accel_activate(self, settings: Any) -> Component:
        strategy = Strategy()
        strategy.requested = self.requested
        return strategy


def test_a_requested_component_wins_the_role_over_one_that_only_defaults_into_it() -> None:
    """The contract behind Kernel(parallelism_config=...) under any launcher: a plugin marks the component the
    settings ask for (Component.requested) and it wins over a strategy that takes part by default."""
    kernel = Kernel(extra_plugins=[("default", Claims(False)), ("asked", Claims(True))])
    assert [(c.name, c.role) for c in kernel.components] == [("asked", "strategy")]
    kernel.end_training()
    with pytest.raises(
        accel.PluginError, match="plugins '(one|two)' .* and '(one|two)' .* both want to be the strategy"
    ):
        Kernel(extra_plugins=[("one", Claims(True)), ("two", Claims(True))])


# ---- parallelism_config on any launcher, and its checkpoint elsewhere ---------------------------------------------


@pytest.fixture(scope="module")
def mesh_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kernel(parallelism_config={"dp_shard_size": 2}) under `accel launch -n 2` (no --plugin): 2 AdamW steps, then
    save_state."""
    tmp = tmp_path_factory.mktemp("mesh")
    accel_launch(tmp, str(SCRIPTS / "semantics_mesh.py"), "save", str(tmp / "out"))
    return tmp / "out"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parallelism_config_selects_the_parallel_strategy_under_accel_launch(mesh_saved: Path) -> None:
    assert [r["components"] for r in ranks(mesh_saved)] == [["parallel:strategy"]] * 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parallelism_config_selects_the_parallel_strategy_under_torchrun(tmp_path: Path) -> None:
    launch(
        [
            str(TORCHRUN),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPTS / "semantics_mesh.py"),
            "save",
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    assert [r["components"] for r in ranks(tmp_path / "out")] == [["parallel:strategy"]] * 2


def assert_loaded_bitwise(saved: Path, loaded: Path) -> None:
    a, b = load_file(str(saved)), load_file(str(loaded))
    assert a.keys() == b.keys() and any(k.endswith("exp_avg") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_mesh_checkpoint_loads_into_one_plain_process(mesh_saved: Path, tmp_path: Path) -> None:
    script = str(SCRIPTS / "semantics_mesh.py")
    launch([sys.executable, script, "load", str(mesh_saved / "ckpt"), str(tmp_path / "out")], tmp_path)
    assert ranks(tmp_path / "out", 1)[0]["components"] == []
    assert_loaded_bitwise(mesh_saved / "saved.safetensors", tmp_path / "out" / "loaded0.safetensors")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_mesh_checkpoint_loads_into_a_ddp_run(mesh_saved: Path, tmp_path: Path) -> None:
    accel_launch(tmp_path, str(SCRIPTS / "semantics_mesh.py"), "load", str(mesh_saved / "ckpt"), str(tmp_path / "out"))
    assert [r["components"] for r in ranks(tmp_path / "out")] == [["ddp:strategy"]] * 2
    for r in (0, 1):
        assert_loaded_bitwise(mesh_saved / "saved.safetensors", tmp_path / "out" / f"loaded{r}.safetensors")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp_larger_than_the_key_value_heads_is_refused_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    proc = accel_launch(tmp_path, str(SCRIPTS / "semantics_mesh.py"), "heads", str(tmp_path), expect_ok=False)
    assert proc.returncode != 0
    line = (
        "parallelism_config tp_size=2 does not divide the 1 key/value heads of LlamaForCausalLM: each "
        "tensor-parallel process takes whole heads; use a tp_size that divides 1"
    )
    assert line in proc.stdout + proc.stderr
    assert "shape" not in (proc.stdout + proc.stderr).lower().replace(line.lower(), "")
