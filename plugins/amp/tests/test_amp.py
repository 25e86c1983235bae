"""accel-plugin-amp: fp16 (autocast + GradScaler, on CPU too), bf16, fp8 (torchao), precedence of the settings,
strategies that realise precision natively, the grad scaler in checkpoints."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel import Component, Kernel, UsageError, hookimpl

BIN = Path(sys.executable).parent
PRECISION_ENV = (
    "ACCEL_MIXED_PRECISION",
    "MIXED_PRECISION",
    "ACCELERATE_MIXED_PRECISION",
    "ACCEL_CONFIG",
    "ACCEL_PLUGINS",
    "ACCEL_DISABLE_PLUGINS",
    "ACCEL_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_BACKEND",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel_home"))
    for var in PRECISION_ENV:
        monkeypatch.delenv(var, raising=False)


def amp_of(kernel: Kernel) -> Any:
    found = [c for c in kernel.components if c.role == "precision"]
    assert len(found) == 1, kernel.components
    return found[0]


def state_items(kernel: Kernel) -> dict[str, Any]:
    """The checkpoint items plugins give (not the kernel's own: its default accel_state_items answers them)."""
    from accel.checkpoint import collect_items

    return {key: item.obj for key, item in collect_items(kernel).items() if item.kind == "plugin"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def dtype_seen(model: nn.Module, layer: nn.Module, x: torch.Tensor) -> tuple[torch.dtype, torch.dtype, bool]:
    """(dtype a layer computed in, dtype of the model's output, whether autocast was on in the layer)."""
    seen: dict[str, Any] = {}

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["dtype"] = out.dtype
        seen["autocast"] = torch.is_autocast_enabled("cpu")

    handle = layer.register_forward_hook(hook)
    try:
        out = model(x)
    finally:
        handle.remove()
    return seen["dtype"], out.dtype, seen["autocast"]


# ---- fp16 --------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_fp16_on_cpu_autocasts_and_scales() -> None:
    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="fp16")
    net = Net()
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    amp = amp_of(kernel)
    assert isinstance(amp.scaler, torch.amp.GradScaler) and amp.scaler.is_enabled()
    x = torch.randn(8, 16)
    inner, out, autocast = dtype_seen(model, net.fc1, x)
    assert (inner, out, autocast) == (torch.float16, torch.float32, True)
    # the user's module behind it: no autocast, fp32 weights and outputs
    assert kernel.unwrap_model(model) is net
    assert dtype_seen(net, net.fc1, x) == (torch.float32, torch.float32, False)
    assert all(v.dtype == torch.float32 for v in kernel.unwrap_model(model).state_dict().values())

    before = [p.detach().clone() for p in net.parameters()]
    kernel.backward(model(x).square().mean())
    assert net.fc1.weight.grad.abs().max() > 100  # gradients are scaled (by 65536) until unscaled
    opt.step()
    opt.zero_grad()
    assert not opt.step_was_skipped
    assert all(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
    assert amp.scaler.get_scale() == 65536.0


def fp16_run(**kernel_args: Any) -> tuple[Kernel, nn.Module, Any, Any, Net]:
    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="fp16", **kernel_args)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = kernel.prepare(net, opt, sched)
    return kernel, model, opt, sched, net


@pytest.mark.smoke
def test_fp16_overflow_skips_step_keeps_parameters_lowers_scale_and_holds_scheduler() -> None:
    kernel, model, opt, sched, net = fp16_run()
    scaler = amp_of(kernel).scaler
    x = torch.randn(8, 16)
    kernel.backward(model(x).square().mean())
    net.fc1.weight.grad[0, 0] = float("inf")  # an overflow in one gradient
    before = copy.deepcopy(net.state_dict())
    lr = sched.get_last_lr()
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.step_was_skipped and kernel.optimizer_step_was_skipped
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert scaler.get_scale() == 32768.0
    assert sched.get_last_lr() == lr and sched.last_epoch == 0

    # the next step is a normal one again
    kernel.backward(model(x).square().mean())
    opt.step()
    sched.step()
    opt.zero_grad()
    assert not opt.step_was_skipped and not kernel.optimizer_step_was_skipped
    assert not torch.equal(before["fc1.weight"], net.fc1.weight)
    assert sched.last_epoch == 1 and sched.get_last_lr() == [lr[0] * 0.5]
    assert scaler.get_scale() == 32768.0


def test_fp16_nan_loss_is_skipped_too() -> None:
    kernel, model, opt, sched, net = fp16_run()
    before = copy.deepcopy(net.state_dict())
    kernel.backward(model(torch.randn(4, 16)).mean() * float("nan"))
    opt.step()
    assert opt.step_was_skipped
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_fp16_fused_optimizer_skip_is_detected() -> None:
    """Fused Adam skips inf steps by itself (GradScaler always calls its step): still reported as skipped."""
    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="fp16")
    net = Net()
    model, opt = kernel.prepare(net, torch.optim.Adam(net.parameters(), lr=0.1, fused=True))
    kernel.backward(model(torch.randn(4, 16)).mean())
    net.fc2.bias.grad[0] = float("inf")
    before = copy.deepcopy(net.state_dict())
    opt.step()
    assert opt.step_was_skipped
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    opt.zero_grad()
    kernel.backward(model(torch.randn(4, 16)).mean())
    opt.step()
    assert not opt.step_was_skipped and not torch.equal(before["fc2.bias"], net.fc2.bias)


def test_fp16_unscale_once_before_clipping() -> None:
    """Gradients are unscaled exactly once per step (explicit unscale, then clip, then step): the clipped norm is
    the true one, not 65536 times it."""
    kernel, model, opt, sched, net = fp16_run()
    reference = copy.deepcopy(net)
    x = torch.randn(8, 16)
    reference(x).square().mean().backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    kernel.backward(model(x).square().mean())
    kernel.unscale_gradients()
    norm = kernel.clip_grad_norm_(model.parameters(), max_norm=1e9)
    assert norm == pytest.approx(float(true_norm), rel=0.02)
    opt.step()  # must not unscale a second time
    assert not opt.step_was_skipped
    assert amp_of(kernel).scaler.get_scale() == 65536.0


def test_fp16_gradient_accumulation_divides_the_loss() -> None:
    kernel, model, opt, sched, net = fp16_run(gradient_accumulation_steps=2)
    reference = copy.deepcopy(net)
    xs = [torch.randn(4, 16), torch.randn(4, 16)]
    for x in xs:
        reference(x).mean().backward()
    for x in xs:
        with kernel.accumulate(model):
            kernel.backward(model(x).mean())
            kernel.unscale_gradients() if kernel.sync_gradients else None
    expected = reference.fc2.bias.grad / 2
    assert torch.allclose(net.fc2.bias.grad, expected, rtol=0.01, atol=1e-3)


def test_fp16_backward_keywords_reach_the_scaled_backward() -> None:
    kernel, model, opt, sched, net = fp16_run()
    assert not kernel._hot.plain_backward  # the grad scaler answers accel_backward
    loss = model(torch.randn(4, 16)).mean()
    kernel.backward(loss, retain_graph=True)
    once = net.fc2.bias.grad.clone()
    kernel.backward(loss)  # the graph was kept for a second (scaled) backward
    torch.testing.assert_close(net.fc2.bias.grad, 2 * once)
    net.zero_grad(set_to_none=True)
    kernel.backward(model(torch.randn(4, 16)).mean(), inputs=[net.fc2.bias])
    assert net.fc2.bias.grad is not None and net.fc1.weight.grad is None


def test_fp16_two_optimizers_share_one_scaler_update() -> None:
    """The scale is updated once both optimizers stepped: an overflow in one model does not change how the other
    one's gradients are unscaled."""
    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="fp16")
    a, b = Net(), Net()
    ref_b = copy.deepcopy(b)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ma, mb, opt_a, opt_b = kernel.prepare(a, b, opt_a, opt_b)
    x = torch.randn(8, 16)
    kernel.backward(ma(x).mean() + mb(x).mean())
    ref_b(x).mean().backward()
    a.fc1.weight.grad[0, 0] = float("inf")
    start_b = b.fc2.weight.detach().clone()
    opt_a.step()
    opt_b.step()
    assert opt_a.step_was_skipped and not opt_b.step_was_skipped
    assert torch.allclose(b.fc2.weight - start_b, -0.1 * ref_b.fc2.weight.grad, rtol=0.02, atol=1e-4)
    assert amp_of(kernel).scaler.get_scale() == 32768.0


def test_grad_scaler_options_reach_the_scaler() -> None:
    kernel = Kernel(
        mixed_precision="fp16",
        grad_scaler_init_scale=1024.0,
        grad_scaler_growth_interval=1,
        grad_scaler_growth_factor=4.0,
    )
    net = Net()
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    kernel.backward(model(torch.randn(2, 16)).mean())
    opt.step()
    assert amp_of(kernel).scaler.get_scale() == 4096.0  # grew after one clean step


def test_grad_scaler_state_round_trip_through_state_items() -> None:
    kernel, model, opt, sched, net = fp16_run(grad_scaler_growth_interval=3)
    kernel.backward(model(torch.randn(4, 16)).mean())
    net.fc1.bias.grad[0] = float("inf")
    opt.step()
    opt.zero_grad()
    kernel.backward(model(torch.randn(4, 16)).mean())
    opt.step()
    items = state_items(kernel)
    assert set(items) == {"grad_scaler"}
    saved = items["grad_scaler"].state_dict()
    assert saved["scale"] == 32768.0 and saved["_growth_tracker"] == 1 and saved["growth_interval"] == 3

    other = Kernel(mixed_precision="fp16")
    net2 = Net()
    other.prepare(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
    target = state_items(other)["grad_scaler"]
    assert target.get_scale() == 65536.0
    target.load_state_dict(saved)
    assert target.state_dict() == saved


@pytest.mark.smoke
def test_grad_scaler_saved_and_restored_by_save_state(tmp_path: Path) -> None:
    kernel, model, opt, sched, net = fp16_run()
    kernel.backward(model(torch.randn(4, 16)).mean())
    net.fc1.bias.grad[0] = float("inf")
    opt.step()
    assert amp_of(kernel).scaler.get_scale() == 32768.0
    kernel.save_state(tmp_path / "ckpt")

    other, model2, opt2, sched2, net2 = fp16_run()
    assert amp_of(other).scaler.get_scale() == 65536.0
    other.load_state(tmp_path / "ckpt")
    assert amp_of(other).scaler.get_scale() == 32768.0
    assert amp_of(other).scaler.state_dict() == amp_of(kernel).scaler.state_dict()
    # the restored scaler keeps working: a clean step is applied, an overflow lowers the scale again
    x = torch.randn(4, 16)
    other.backward(model2(x).mean())
    opt2.step()
    opt2.zero_grad()
    assert not opt2.step_was_skipped
    other.backward(model2(x).mean() * float("inf"))
    opt2.step()
    assert opt2.step_was_skipped and amp_of(other).scaler.get_scale() == 16384.0


def test_saved_weights_are_fp32_after_mixed_precision_training(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for mode in ("fp16", "bf16"):
        kernel = Kernel(mixed_precision=mode)
        net = Net()
        model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        kernel.backward(model(torch.randn(4, 16)).mean())
        opt.step()
        kernel.save_model(model, tmp_path / mode)
        saved = load_file(tmp_path / mode / "model.safetensors")
        assert sorted(saved) == sorted(net.state_dict())
        assert all(v.dtype == torch.float32 for v in saved.values())


# ---- bf16 --------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_bf16_autocast_without_scaler_and_fp32_weights() -> None:
    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="bf16")
    net = Net()
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    amp = amp_of(kernel)
    assert amp.scaler is None and state_items(kernel) == {}
    x = torch.randn(8, 16)
    assert dtype_seen(model, net.fc1, x) == (torch.bfloat16, torch.float32, True)
    with kernel.autocast():
        assert net(x).dtype == torch.bfloat16
    assert dtype_seen(kernel.unwrap_model(model), net.fc1, x) == (torch.float32, torch.float32, False)
    loss = model(x).square().mean()
    kernel.backward(loss)
    assert net.fc1.weight.grad.dtype == torch.float32 and net.fc1.weight.grad.abs().max() < 100  # not scaled
    opt.step()
    assert not opt.step_was_skipped
    assert all(v.dtype == torch.float32 for v in kernel.get_state_dict(model).values())


@pytest.mark.smoke
def test_bf16_trains_like_fp32() -> None:
    def train(mp: str) -> float:
        torch.manual_seed(0)
        kernel = Kernel(mixed_precision=mp)
        net = Net()
        model, opt = kernel.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
        for _ in range(30):
            kernel.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), y))

    fp32, bf16, fp16 = train("no"), train("bf16"), train("fp16")
    assert bf16 == pytest.approx(fp32, rel=0.1) and fp16 == pytest.approx(fp32, rel=0.1)


# ---- a strategy that realises the precision natively ---------------------------------------------------------


class NativeStrategy(Component):
    """A strategy that realises bf16/fp16 itself (as FSDP's MixedPrecisionPolicy does): it declares both in
    ``provides`` (so the kernel leaves the precision plugin out), casts the model when it prepares it, and answers
    accel_autocast with nullcontext (no autocast; prepared models still return fp32 outputs)."""

    role = "strategy"
    provides = frozenset({"precision:bf16", "precision:fp16"})

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @hookimpl
    def accel_autocast(self, kernel: Kernel) -> Any:
        return contextlib.nullcontext

    @hookimpl
    def accel_prepare_training(self, models: list[Any], optimizers: list[Any], schedulers: list[Any]) -> Any:
        return [m.to(self.dtype) for m in models], optimizers, schedulers


class NativePlugin:
    @hookimpl
    def accel_activate(self, settings: Any) -> Component:
        return NativeStrategy(torch.bfloat16 if settings.mixed_precision == "bf16" else torch.float16)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_strategy_with_native_precision_keeps_amp_out(mode: str) -> None:
    kernel = Kernel(mixed_precision=mode, extra_plugins=[("native", NativePlugin())])
    assert [c.role for c in kernel.components] == ["strategy"]  # amp activated, and was left out by the kernel
    net = Net()
    model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert state_items(kernel) == {}
    want = torch.bfloat16 if mode == "bf16" else torch.float16
    x = torch.randn(4, 16, dtype=want)
    inner, out, autocast = dtype_seen(model, net.fc1, x)
    assert (inner, autocast) == (want, False)  # the strategy's precision, no autocast of ours
    before = net.fc1.weight.detach().clone()
    kernel.backward(model(x).float().mean())
    assert net.fc1.weight.grad.abs().max() < 100  # no loss scaling by amp
    opt.step()
    assert not opt.step_was_skipped and not torch.equal(before, net.fc1.weight)


# ---- fp8 ---------------------------------------------------------------------------------------------------


def test_fp8_without_capable_gpu_is_one_clear_error() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has a GPU that runs fp8")
    with pytest.raises(UsageError, match=r"^mixed_precision=fp8 needs a CUDA GPU of compute capability 8\.9 or newer"):
        Kernel(mixed_precision="fp8")
    with pytest.raises(UsageError, match=r"forced onto the CPU"):
        Kernel(mixed_precision="fp8", cpu=True)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_fp8_emulated_swaps_linear_layers_in_place_and_trains() -> None:
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    kernel = Kernel(mixed_precision="fp8", fp8_emulate=True)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))
    params = list(net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = kernel.prepare(net, opt)
    assert [type(m).__name__ for m in net] == ["Float8Linear", "ReLU", "Float8Linear", "ReLU", "Linear"]
    assert isinstance(net[0], Float8Linear) and list(net.parameters()) == params  # the optimizer's parameters
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(x), y)
        kernel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8
    assert kernel.unwrap_model(model) is net
    state = kernel.get_state_dict(model)
    assert sorted(state) == sorted(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3)).state_dict()
    )
    assert all(v.dtype == torch.float32 for v in state.values())


# ---- where the setting comes from ----------------------------------------------------------------------------


def test_precedence_in_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel argument > what accel launch handed over (flag > env > file) > environment > default."""
    assert Kernel().mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Kernel().settings.sources["mixed_precision"] == "env ACCELERATE_MIXED_PRECISION"
    monkeypatch.setenv("MIXED_PRECISION", "fp16")  # the seed's spelling beats Accelerate's
    kernel = Kernel()
    assert (kernel.mixed_precision, kernel.settings.sources["mixed_precision"]) == ("fp16", "env MIXED_PRECISION")
    assert amp_of(kernel).scaler is not None
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "bf16")
    assert Kernel().mixed_precision == "bf16"
    monkeypatch.setenv("ACCEL_CONFIG", json.dumps({"mixed_precision": "fp16"}))
    assert Kernel().settings.sources["mixed_precision"] == "launch"
    assert Kernel().mixed_precision == "fp16"
    kernel = Kernel(mixed_precision="no")
    assert (kernel.mixed_precision, kernel.settings.sources["mixed_precision"]) == ("no", "argument")
    assert not [c for c in kernel.components if c.role == "precision"]
    monkeypatch.setenv("MIXED_PRECISION", "fp17")
    monkeypatch.delenv("ACCEL_MIXED_PRECISION")
    monkeypatch.delenv("ACCEL_CONFIG")
    with pytest.raises(
        UsageError,
        match="environment variable MIXED_PRECISION must be no or a precision mode a plugin provides, got 'fp17'",
    ):
        Kernel()


WORKER = """
import json, os, pathlib, sys
import torch
from accel import Kernel
arg = sys.argv[1] if len(sys.argv) > 1 else None
kernel = Kernel(mixed_precision=arg)
amps = [c for c in kernel.components if c.role == "precision"]
net = torch.nn.Linear(4, 4)
model, opt = kernel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
kernel.backward(model(torch.randn(2, 4)).sum())
opt.step()
pathlib.Path(f"result_{kernel.process_index}.json").write_text(json.dumps({"rank": kernel.process_index, "world": kernel.num_processes,
    "mp": kernel.mixed_precision, "source": kernel.settings.sources["mixed_precision"],
    "scaler": bool(amps and amps[0].scaler is not None), "autocast": bool(amps)}))
kernel.end_training()
"""


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Each worker's result file (files, not stdout: two processes' lines can interleave on a shared pipe);
    removed after reading so the next launch in the same directory starts clean."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cwd = Path(getattr(proc, "cwd", "."))
    files = sorted(cwd.glob("result_*.json"))
    found = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    return sorted(found, key=lambda r: r["rank"])


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    proc.cwd = cwd  # type: ignore[attr-defined]  # where the workers wrote their result files
    return proc


@pytest.mark.slow
def test_precedence_end_to_end_through_accel_launch(tmp_path: Path) -> None:
    """config file < environment < launch flag < Kernel argument, through `accel launch` (the plan it prints, and
    what its worker sees)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    config = tmp_path / "accel_home" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\nnum_processes: 1\n"
    )
    env = dict(os.environ)
    launch = [str(BIN / "accel"), "launch", "-q"]

    def planned(*args: str) -> str:
        proc = run([*launch, "--dry-run", *args, str(script)], env, tmp_path)
        assert proc.returncode == 0, proc.stderr
        return next(line.strip() for line in proc.stdout.splitlines() if "mixed_precision =" in line)

    assert planned() == "mixed_precision = 'bf16' (file)"
    env["MIXED_PRECISION"] = "fp16"
    assert planned() == "mixed_precision = 'fp16' (env MIXED_PRECISION)"
    assert planned("--mixed_precision", "no") == "mixed_precision = 'no' (flag)"
    # the workers: the environment's fp16 beats the file's bf16; a Kernel argument beats the launch flag
    from_env = results(run([*launch, str(script)], env, tmp_path))
    assert from_env == [{"rank": 0, "world": 1, "mp": "fp16", "source": "launch", "scaler": True, "autocast": True}]
    argument = results(run([*launch, "--mixed_precision", "no", str(script), "bf16"], env, tmp_path))
    assert argument == [{"rank": 0, "world": 1, "mp": "bf16", "source": "argument", "scaler": False, "autocast": True}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


OVERFLOW_WORKER = """
import json
import pathlib
import torch
from accel import Kernel
torch.manual_seed(0)
kernel = Kernel()
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model, opt, sched = kernel.prepare(net, opt, sched)
scaler = [c for c in kernel.components if c.role == "precision"][0].scaler
steps = []
for step in range(3):
    x = torch.randn(4, 8) + kernel.process_index
    loss = model(x).square().mean()
    if step == 1 and kernel.process_index == 0:
        loss = loss * float("inf")  # overflow on one process only: DDP spreads it to all
    before = [p.detach().clone() for p in net.parameters()]
    kernel.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    moved = any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
    steps.append({"skipped": opt.step_was_skipped, "moved": moved, "scale": scaler.get_scale(),
                  "lr": sched.get_last_lr()[0]})
flat = torch.cat([p.detach().flatten() for p in net.parameters()])
pathlib.Path(f"result_{kernel.process_index}.json").write_text(json.dumps({"rank": kernel.process_index, "world": kernel.num_processes,
    "mp": kernel.mixed_precision, "steps": steps, "params": kernel.gather(flat[None]).tolist()}))
kernel.end_training()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_seed_style_fp16_torchrun_two_processes_skip_together(tmp_path: Path) -> None:
    """`MIXED_PRECISION="fp16" torchrun --nproc_per_node 2 script.py`: both processes get fp16 with a scaler; an
    overflow on one process makes both skip the step and halve the scale; parameters stay identical."""
    script = tmp_path / "overflow.py"
    script.write_text(OVERFLOW_WORKER)
    env = dict(os.environ, MIXED_PRECISION="fp16", OMP_NUM_THREADS="1")
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        env,
        tmp_path,
    )
    ranks = results(proc)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 and r["mp"] == "fp16" for r in ranks)
    for r in ranks:
        assert [s["skipped"] for s in r["steps"]] == [False, True, False]
        assert [s["moved"] for s in r["steps"]] == [True, False, True]
        assert [s["scale"] for s in r["steps"]] == [65536.0, 32768.0, 32768.0]
        # StepLR(step_size=1, gamma=0.5) under Accelerate's rule: 2 scheduler steps per applied optimizer step on 2
        # processes, none after the skipped one
        assert [s["lr"] for s in r["steps"]] == [0.025, 0.025, 0.00625]
    gathered = ranks[0]["params"]
    assert gathered[0] == gathered[1]


def cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    return run([str(BIN / "accel"), "launch", "-q", *args, str(script)], dict(os.environ, **env), tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mixed_precision", "fp8", "--cpu"], "mixed_precision=fp8 needs a CUDA GPU of compute capability 8.9"),
        (["--mixed_precision", "fp16", "-p", "no:amp"], "needs a plugin that provides 'precision:fp16'"),
        (
            ["--mixed_precision", "fp15"],
            "`--mixed_precision` must be no or a precision mode a plugin provides, got 'fp15'",
        ),
    ],
)
def test_impossible_combinations_are_refused_at_launch(tmp_path: Path, args: list[str], message: str) -> None:
    proc = cli(args, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr and "ran" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def test_fp8_backend_from_config_file_is_checked_at_launch(tmp_path: Path) -> None:
    config = tmp_path / "te.yaml"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  backend: TE\n")
    proc = cli(["--config_file", str(config)], tmp_path)
    assert proc.returncode == 2 and "fp8_config.backend TE is not provided by accel-plugin-amp" in proc.stderr


def test_accel_config_asks_the_fp8_questions() -> None:
    from accel import Question
    from accel.commands.questionnaire import Questionnaire
    from accel.plugins import Plugins

    answers = {
        "distributed_type": "NO",
        "cpu": False,
        "use_dynamo": "no",
        "mixed_precision": "fp8",
        "fp8_recipe": "rowwise",
        "fp8_pad_inner_dim": True,
    }
    asked: list[str] = []

    def ask(q: Question, disabled: Any) -> Any:
        asked.append(q.key)
        return answers.get(q.key, q.default)

    questionnaire = Questionnaire(Plugins.load(env={"ACCEL_PLUGINS": "ddp,amp"}), ask, env={})
    questionnaire.run()
    assert asked[asked.index("mixed_precision") :] == [
        "mixed_precision",
        "fp8_backend",
        "fp8_recipe",
        "fp8_pad_inner_dim",
    ]
    data = questionnaire.config_data()
    assert data["mixed_precision"] == "fp8"
    assert data["fp8_config"] == {"backend": "AO", "recipe": "rowwise", "pad_inner_dim": True}


def test_bf16_leaves_the_step_to_the_kernels_plain_calls_and_fp16_keeps_the_scaler_hooks() -> None:
    # bf16 has no gradient scaler, so its component implements none of the per-step hooks and the kernel makes the
    # plain PyTorch calls itself (accel.dispatch.HotHooks): 7 Python calls fewer per step. fp16 steps through the
    # scaler's hooks.
    bf16 = Kernel(cpu=True, mixed_precision="bf16")
    assert bf16._hot.plain_backward and bf16._hot.plain_optimizer and not bf16._hot.unscale_needed
    fp16 = Kernel(cpu=True, mixed_precision="fp16")
    assert not fp16._hot.plain_backward and not fp16._hot.plain_optimizer and fp16._hot.unscale_needed
