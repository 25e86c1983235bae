"""accel-plugin-ipex for real: torch 2.8.0 + intel-extension-for-pytorch 2.8.0 (``.venv-ipex``, ``make test-ipex``),
on this machine's CPU (no Intel GPU here, so the XPU path is not exercised).

The digits example's CNN trains through accel with the plugin active, in process (``Kernel(plugins=["ipex"])``) and
through ``accel launch --plugin ipex`` (one process, and two with DDP); each run writes a report of what IPEX did
(``ipex_train.py``) and the tests assert on it: IPEX's prepacked modules replaced the Conv/Linear layers, its fused
optimizer step was patched in, bf16 weights carry fp32 master weights, the weights given back are plain fp32, the
loss goes down, and checkpoints round-trip. A run without the plugin is the control.

IPEX prepacks bf16 weights only on a CPU whose oneDNN has bf16 kernels (avx512bw/vl/dq or avx_ne_convert); elsewhere
the plugin turns prepacking off for bf16 and warns. The bf16 tests check whichever of the two this CPU gets
(``PREPACKS_BF16``): prepacked modules, or the model's own modules and the warning. Both get bf16 weights with fp32
master weights and IPEX's optimizer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TRAIN = HERE / "ipex_train.py"
EXAMPLE = REPO / "examples" / "train_digits.py"
ACCEL = str(Path(sys.executable).parent / "accel")
FUSED_ADAM = "intel_extension_for_pytorch.optim._functional.adam_step"
NET_STATE = {
    "features.0.weight": [16, 1, 3, 3],
    "features.0.bias": [16],
    "features.2.weight": [32, 16, 3, 3],
    "features.2.bias": [32],
    "head.2.weight": [64, 512],
    "head.2.bias": [64],
    "head.4.weight": [10, 64],
    "head.4.bias": [10],
}

sys.path.insert(0, str(HERE))
import ipex_train  # noqa: E402
from intel_extension_for_pytorch import _C as ipex_core  # noqa: E402

#: whether IPEX can prepack bf16 weights on this CPU (else the plugin passes weights_prepack=False and warns)
PREPACKS_BF16 = bool(ipex_core.onednn_has_bf16_support())
NO_PREPACK_WARNING = "so bf16 weights are not prepacked"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("ACCEL_", "ACCELERATE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel_home"))


def launch(
    tmp_path: Path, *args: str, script: Path = TRAIN, script_args: tuple[str, ...] | None = None, timeout: float = 300
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess[str]]:
    """``accel launch ARGS script`` in a subprocess; the report it wrote (for ipex_train.py) and the process."""
    out = tmp_path / "report.json"
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    if script_args is None:
        script_args = ("--out", str(out), "--workdir", str(work))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(ACCEL_HOME=str(tmp_path / "accel_home"), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [ACCEL, "launch", *args, str(script), *script_args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return (json.loads(out.read_text()) if out.exists() else None), proc


def assert_trained(report: dict[str, Any]) -> None:
    first, last = report["losses"][0], report["losses"][-1]
    assert last < 0.5 * first, report["losses"]
    assert report["accuracy"] > 0.8, report["accuracy"]


def assert_plain_fp32_weights(report: dict[str, Any]) -> None:
    """What get_state_dict / save_model / checkpoints hold: the model's own names and shapes, fp32 (IPEX's patched
    state_dict unpacks the blocked layouts and joins bf16 weights with their master halves)."""
    assert report["state_dict"] == {k: ["torch.float32", shape] for k, shape in NET_STATE.items()}
    assert report["state_dict_loads"] and report["save_model_equal"]
    assert report["moved_after_save"] and report["load_state_restores_weights"]
    assert report["load_state_restores_optimizer"]


def assert_bf16_modules(report: dict[str, Any], output: str | None = None) -> None:
    """Conv and Linear prepacked by IPEX where this CPU lets it prepack bf16 weights; else the model's own layers,
    and (given the launch's output) the plugin's warning saying so. Either way, bf16 weights."""
    modules = report["modules"]
    if PREPACKS_BF16:
        assert modules.count("_IPEXConv2d") == 2 and modules.count("_IPEXLinear") == 2, modules
    else:
        assert modules.count("Conv2d") == 2 and modules.count("Linear") == 2, modules
        assert not any(m.startswith("_IPEX") for m in modules), modules
    if output is not None:
        assert (NO_PREPACK_WARNING in output) is not PREPACKS_BF16, output[-3000:]
    assert report["param_dtypes"] == ["torch.bfloat16"]


def test_in_process_fp32(tmp_path):
    """Kernel(plugins=["ipex"]): Conv2d layers prepacked, Adam's fused step, fp32 weights, plain state dict."""
    report = ipex_train.run(tmp_path / "r.json", "adam", epochs=2, plugins=["ipex"], workdir=tmp_path)
    assert report["components"] == ["ipex:optimization"]
    assert report["modules"].count("_IPEXConv2d") == 2 and "Conv2d" not in report["modules"]
    assert "intel_extension_for_pytorch.nn.utils._weight_prepack._IPEXConv2d" in report["module_classes"]
    opt = report["optimizer"]
    assert opt["fused"] and opt["has_original_step"] and opt["step"] == FUSED_ADAM, opt
    assert opt["params_attr"] == len(NET_STATE) and opt["param_dtypes"] == ["torch.float32"], opt
    assert_trained(report)
    assert_plain_fp32_weights(report)
    assert report["plain_vs_prepared_max_diff"] < 1e-4  # the exported weights compute what the trained model does


def test_control_without_the_plugin(tmp_path):
    """The same run with the plugin installed but not selected: nothing of IPEX's (so the checks above can fail)."""
    report = ipex_train.run(tmp_path / "r.json", "adam", epochs=0, plugins=None)
    assert report["components"] == []
    assert report["modules"].count("Conv2d") == 2 and not any(m.startswith("_IPEX") for m in report["modules"])
    opt = report["optimizer"]
    assert not opt["fused"] and not opt["has_original_step"] and opt["params_attr"] == 0, opt
    assert opt["step"].startswith("torch.optim"), opt


def test_launch_bf16_with_amp(tmp_path):
    """accel launch --plugin ipex --mixed_precision bf16: accel-plugin-amp's autocast runs the forward, IPEX holds
    bf16 weights (Conv and Linear prepacked) with split fp32 master weights and steps them with fused Adam."""
    report, proc = launch(tmp_path, "--plugin", "ipex", "--mixed_precision", "bf16")
    assert report["components"] == ["amp:precision", "ipex:optimization"]
    assert report["wrappers"] == ["AutocastModule", "Net"]
    assert_bf16_modules(report, proc.stdout + proc.stderr)
    opt = report["optimizer"]
    assert opt["fused"] and opt["step"] == FUSED_ADAM and opt["param_dtypes"] == ["torch.bfloat16"], opt
    assert opt["split_master"] == len(NET_STATE), opt  # every weight keeps its low bf16 half in the optimizer
    assert report["state_dict_finer_than_bf16"]  # bf16 weights alone could not give these values
    assert_trained(report)
    assert_plain_fp32_weights(report)


def test_bf16_without_amp_uses_the_plugins_autocast(tmp_path, monkeypatch):
    """accel-plugin-amp disabled: ipex provides precision:bf16 itself and answers accel_autocast with bf16 autocast."""
    monkeypatch.setenv("ACCEL_DISABLE_PLUGINS", "amp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ipex_train.run(tmp_path / "r.json", "adam", epochs=2, mixed_precision="bf16", plugins=["ipex"])
    assert report["components"] == ["ipex:optimization"]
    assert report["wrappers"] == ["AutocastModule", "Net"]  # the kernel wraps the forward in the plugin's autocast
    ours = [str(w.message) for w in caught if NO_PREPACK_WARNING in str(w.message)]
    assert len(ours) == (0 if PREPACKS_BF16 else 1), ours  # once per Kernel, not once per model
    assert_bf16_modules(report)
    assert report["optimizer"]["split_master"] == len(NET_STATE)
    assert report["state_dict_finer_than_bf16"]
    assert_trained(report)


def test_bf16_adamw_keeps_fp32_master_weights(tmp_path):
    """The example's optimizer, AdamW, has no fused CPU kernel in IPEX: it gets IPEX's non-fused step over full fp32
    master weights, while the model holds bf16 weights."""
    report = ipex_train.run(tmp_path / "r.json", "adamw", epochs=2, mixed_precision="bf16", plugins=["ipex"])
    assert report["components"] == ["amp:precision", "ipex:optimization"]
    opt = report["optimizer"]
    assert opt["type"] == "AdamW" and not opt["fused"] and "master_param_non_fused_step" in opt["step"], opt
    assert opt["fp32_master"] == len(NET_STATE) and opt["param_dtypes"] == ["torch.float32"], opt
    assert_bf16_modules(report)
    assert report["state_dict_finer_than_bf16"]
    assert_trained(report)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_ddp_bf16(tmp_path):
    """accel launch -n 2 --plugin ipex: ddp is the strategy, ipex.optimize runs in each process before DDP wraps
    the model, gradients are all-reduced (the weights end equal on both processes)."""
    report, proc = launch(tmp_path, "-n", "2", "--plugin", "ipex", "--mixed_precision", "bf16")
    assert report["num_processes"] == 2
    assert report["components"] == ["ddp:strategy", "amp:precision", "ipex:optimization"]
    assert report["wrappers"] == ["AutocastModule", "DistributedDataParallel"]
    assert_bf16_modules(report, proc.stdout + proc.stderr)
    assert report["optimizer"]["fused"] and report["optimizer"]["split_master"] == len(NET_STATE)
    assert report["weights_same_on_every_process"]
    assert_trained(report)
    assert_plain_fp32_weights(report)


def test_the_example_trains_with_the_plugin(tmp_path):
    """examples/train_digits.py, unchanged, through accel launch --plugin ipex. IPEX logs its deprecation notice for
    fuse_update_step from inside ipex.optimize only, so its presence shows the call happened in the worker."""
    _, proc = launch(tmp_path, "--plugin", "ipex", script=EXAMPLE, script_args=("--epochs", "2"))
    accuracies = [
        float(line.split("accuracy ")[1].split()[0]) for line in proc.stdout.splitlines() if line.startswith("epoch ")
    ]
    assert len(accuracies) == 2 and accuracies[-1] > 0.8, proc.stdout
    assert "'fuse_update_step' will be deprecated" in proc.stdout + proc.stderr


# ---- what the plugin refuses or handles specially (in process) ---------------------------------------------------


def test_fp16_is_refused():
    from accel import Kernel
    from accel.spi import UsageError

    with pytest.raises(UsageError, match="trains in fp32 or bf16"):
        Kernel(plugins=["ipex"], mixed_precision="fp16")


def test_use_xpu_without_an_xpu_is_refused():
    from accel import Kernel
    from accel.spi import UsageError

    assert not (hasattr(torch, "xpu") and torch.xpu.is_available())  # this machine has no Intel GPU
    with pytest.raises(UsageError, match=r"torch sees no Intel GPU"):
        Kernel(ipex_use_xpu=True, plugins=["ipex"])


def test_a_training_model_without_its_optimizer_is_refused():
    from accel import Kernel
    from accel.spi import UsageError

    kernel = Kernel(plugins=["ipex"])
    with pytest.raises(UsageError, match="prepare it together with its optimizer"):
        kernel.prepare(torch.nn.Linear(4, 2))
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    with pytest.raises(UsageError, match="holds parameters of 2 models"):
        kernel.prepare(a, b, torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))
    kernel.end_training()


def test_a_replaced_module_is_what_unwrap_model_returns():
    """bf16: IPEX swaps a bare nn.Linear for a new _IPEXLinear object (when it prepacks bf16 weights on this CPU);
    that object is what accel wraps, trains and unwraps, and its weights come back as fp32 under the Linear's
    names. Without prepacking the Linear itself is kept, with bf16 weights."""
    from accel import Kernel

    kernel = Kernel(plugins=["ipex"], mixed_precision="bf16")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 10)
    model, opt = kernel.prepare(linear, torch.optim.SGD(linear.parameters(), lr=0.5))
    inner = kernel.unwrap_model(model)
    if PREPACKS_BF16:
        assert type(inner).__name__ == "_IPEXLinear" and inner is not linear
    else:
        assert inner is linear and linear.weight.dtype == torch.bfloat16
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        kernel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    state = kernel.get_state_dict(model)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == {
        "weight": (torch.float32, (10, 64)),
        "bias": (torch.float32, (10,)),
    }
    kernel.end_training()


def test_an_eval_model_without_optimizer_is_optimized_for_inference():
    from accel import Kernel

    sys.path.insert(0, str(REPO / "examples"))
    from train_digits import Net

    kernel = Kernel(plugins=["ipex"])
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        expected = net(x)
    model = kernel.prepare(net)
    assert [type(m).__name__ for m in kernel.unwrap_model(model).modules()].count("_IPEXConv2d") == 2
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
    kernel.end_training()
