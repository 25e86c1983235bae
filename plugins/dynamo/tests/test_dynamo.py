"""accel-plugin-dynamo: torch.compile of prepared models, in place and before the strategy wraps them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from accel import Kernel, UsageError
from accel.commands.launch import plan_launch

BIN = Path(sys.executable).parent
CLEARED = (
    "ACCEL_CONFIG",
    "ACCEL_PLUGINS",
    "ACCEL_DISABLE_PLUGINS",
    "ACCEL_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCEL_DYNAMO_MODE",
    "ACCELERATE_DYNAMO_MODE",
    "ACCEL_DYNAMO_USE_FULLGRAPH",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "ACCEL_DYNAMO_USE_DYNAMIC",
    "ACCELERATE_DYNAMO_USE_DYNAMIC",
    "ACCEL_MIXED_PRECISION",
    "MIXED_PRECISION",
    "ACCELERATE_MIXED_PRECISION",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


@pytest.fixture(autouse=True)
def clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "accel_home"))
    for var in CLEARED:
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    counters.clear()


def frames() -> int:
    """Frames dynamo compiled since the last reset."""
    return int(counters["frames"]["ok"])


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def compiler_of(kernel: Kernel) -> Any:
    found = [c for c in kernel.components if c.role == "compiler"]
    return found[0] if found else None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def train(kernel: Kernel, net: nn.Module, steps: int = 3) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = kernel.prepare(net, opt)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        kernel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


# ---- validation of the settings -----------------------------------------------------------------------------


def test_unknown_backend_is_one_clear_error_with_the_choices() -> None:
    with pytest.raises(UsageError) as err:
        Kernel(dynamo_backend="inductr")
    message = str(err.value)
    assert "dynamo_backend 'inductr' is not a torch.compile backend of this torch (available: " in message
    assert "aot_eager" in message and "eager" in message and "did you mean `inductor`?" in message


@pytest.mark.parametrize(
    "spelling, backend",
    [("INDUCTOR", "inductor"), ("AOT_EAGER", "aot_eager"), ("eager", "eager"), ("Cudagraphs", "cudagraphs")],
)
def test_accelerate_spellings_are_accepted(spelling: str, backend: str) -> None:
    kernel = Kernel(dynamo_backend=spelling)
    assert compiler_of(kernel).backend == backend


@pytest.mark.parametrize("spelling", ["no", "NO"])
def test_no_backend_means_no_compiler(spelling: str) -> None:
    assert compiler_of(Kernel(dynamo_backend=spelling)) is None


def test_options_from_kernel_arguments_reach_torch_compile() -> None:
    kernel = Kernel(
        dynamo_backend="inductor",
        dynamo_mode="max-autotune-no-cudagraphs",
        dynamo_use_fullgraph=True,
        dynamo_use_dynamic=False,
    )
    assert compiler_of(kernel).options() == {
        "backend": "inductor",
        "mode": "max-autotune-no-cudagraphs",
        "fullgraph": True,
        "dynamic": False,
    }
    with pytest.warns(RuntimeWarning, match="dynamo_mode=max-autotune only applies to the inductor backend"):
        kernel = Kernel(dynamo_backend="eager", dynamo_mode="max-autotune")
    assert compiler_of(kernel).options() == {"backend": "eager", "fullgraph": False, "dynamic": None}
    with pytest.raises(UsageError, match="must be one of default, reduce-overhead, max-autotune"):
        Kernel(dynamo_backend="eager", dynamo_mode="fastest")


def test_config_file_and_flags_in_accelerate_spelling(tmp_path: Path) -> None:
    """dynamo_config keys of an Accelerate config file; flags beat the file."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: 'NO'
        dynamo_config:
          dynamo_backend: AOT_EAGER
          dynamo_mode: default
          dynamo_use_fullgraph: true
          dynamo_use_dynamic: false
          dynamo_use_regional_compilation: true
        num_processes: 1
        """)
    )
    plugins, plan, _ = plan_launch(["-q", "--config_file", str(config), str(script)], env=dict(os.environ))
    s = plan.settings
    assert (s["dynamo_backend"], s["dynamo_use_fullgraph"], s["dynamo_use_dynamic"]) == ("AOT_EAGER", True, False)
    assert s["dynamo_use_regional_compilation"] is True
    assert compiler_of(plugins).backend == "aot_eager"
    plugins, plan, _ = plan_launch(
        ["-q", "--config_file", str(config), "--dynamo_backend", "eager", "--dynamo_use_dynamic", str(script)],
        env=dict(os.environ),
    )
    assert (plan.settings["dynamo_backend"], plan.settings["dynamo_use_dynamic"]) == ("eager", True)
    handed = json.loads(plan.env["ACCEL_CONFIG"])
    assert handed["dynamo_backend"] == "eager" and handed["dynamo_use_fullgraph"] is True


def test_bad_backend_is_refused_at_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    proc = subprocess.run(
        [str(BIN / "accel"), "launch", "-q", "--dynamo_backend", "nonsense", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("accel: error: plugin 'dynamo': dynamo_backend 'nonsense' is not a torch.compile")
    assert len(proc.stderr.strip().splitlines()) == 1 and "ran" not in proc.stdout


# ---- compiling ------------------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_model_is_compiled_in_place_in_one_process() -> None:
    kernel = Kernel(dynamo_backend="eager")
    net = Net()
    model, losses = train(kernel, net)
    assert frames() >= 1 and graphs() >= 1
    assert model is net and kernel.unwrap_model(model) is net  # compiled in place: no wrapper at all
    assert list(kernel.get_state_dict(model)) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert not any("_orig_mod" in k for k in net.state_dict())


def test_without_the_plugin_nothing_is_compiled() -> None:
    """The control for the counters above: the same training without dynamo compiles no frame."""
    train(Kernel(), Net())
    assert frames() == 0


@pytest.mark.smoke
def test_torch_nn_containers_are_compiled_too() -> None:
    """A model whose code lives in torch.nn (nn.Sequential) is compiled through the plugin, whatever torch's own
    nn.Module.compile() does with it (up to torch 2.13 it silently leaves such a module uncompiled)."""
    kernel = Kernel(dynamo_backend="eager")
    train(kernel, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    assert frames() >= 1


def test_a_model_compiled_by_the_user_is_left_alone() -> None:
    kernel = Kernel(dynamo_backend="eager")
    net = Net()
    compiled = torch.compile(net, backend="eager")
    model = kernel.prepare(compiled)
    model(torch.randn(2, 8))
    assert frames() == 1 and model is compiled and net._compiled_call_impl is None
    assert kernel.unwrap_model(model, keep_torch_compile=False) is net


@pytest.mark.smoke
def test_aot_eager_trains_like_eager() -> None:
    torch.manual_seed(0)
    net = Net()
    twin = copy.deepcopy(net)
    _, plain = train(Kernel(), net)
    _, compiled = train(Kernel(dynamo_backend="aot_eager"), twin)
    assert graphs() >= 1
    assert compiled == pytest.approx(plain, rel=1e-5)
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


class Breaks(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


def test_fullgraph_turns_a_graph_break_into_an_error() -> None:
    train(Kernel(dynamo_backend="eager"), Breaks(), steps=1)
    assert graphs() == 2  # broken in two, silently
    torch._dynamo.reset()
    with pytest.raises(Exception, match="graph_break"):
        train(Kernel(dynamo_backend="eager", dynamo_use_fullgraph=True), Breaks(), steps=1)


def test_dynamic_shapes_setting_reaches_dynamo() -> None:
    def shapes(**kwargs: Any) -> int:
        torch._dynamo.reset()
        counters.clear()
        kernel = Kernel(dynamo_backend="eager", **kwargs)
        model = kernel.prepare(Net())
        for batch in (2, 3, 5):
            model(torch.randn(batch, 8))
        return frames()

    assert shapes(dynamo_use_dynamic=False) == 3  # one compile per batch size
    assert shapes(dynamo_use_dynamic=True) == 1


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.smoke
def test_regional_compilation_compiles_the_repeated_blocks() -> None:
    kernel = Kernel(dynamo_backend="eager", dynamo_use_regional_compilation=True)
    net = Blocks()
    captured: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        captured.append(
            " ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_module" or n.op == "call_function")
        )
        return gm.forward

    compiler_of(kernel).backend = backend  # a counting backend, so the graphs can be inspected
    train(kernel, net, steps=2)
    assert captured and all("gelu" in g for g in captured)  # only block graphs, never the whole model
    assert not any("embed" in g or "head" in g for g in captured)


@pytest.mark.requires_plugins("amp")
def test_compile_with_fp16_autocast_and_scaler() -> None:
    kernel = Kernel(dynamo_backend="aot_eager", mixed_precision="fp16")
    net = Net()
    seen: list[torch.dtype] = []
    net.fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    model, losses = train(kernel, net)
    assert graphs() >= 1 and all(d == torch.float16 for d in seen)
    assert model(torch.randn(2, 8)).dtype == torch.float32
    assert kernel.unwrap_model(model) is net


# ---- several processes and inductor ----------------------------------------------------------------------------

DDP_WORKER = """
import json
import pathlib
import torch
from torch._dynamo.utils import counters
from accel import Kernel

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

torch.manual_seed(0)
kernel = Kernel()
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model, opt = kernel.prepare(net, opt)
frames_before = counters["frames"]["ok"]
for step in range(3):
    loss = model(torch.randn(4, 8) + kernel.process_index).square().mean()
    kernel.backward(loss)
    opt.step()
    opt.zero_grad()
flat = torch.cat([p.detach().flatten() for p in net.parameters()])
pathlib.Path(f"result_{kernel.process_index}.json").write_text(json.dumps({
    "rank": kernel.process_index, "world": kernel.num_processes, "wrapper": type(model).__name__,
    "backend": kernel.settings["dynamo_backend"], "frames": counters["frames"]["ok"] - frames_before,
    "graphs": counters["stats"]["unique_graphs"], "captured": counters["stats"]["calls_captured"],
    "unwrapped_is_net": kernel.unwrap_model(model) is net,
    "keys": sorted(kernel.get_state_dict(model)), "params": kernel.gather(flat[None]).tolist()}))
kernel.end_training()
"""


def worker_results(proc: subprocess.CompletedProcess[str], cwd: Path) -> list[dict[str, Any]]:
    """Each worker's result file (files, not stdout: two processes' lines can interleave on a shared pipe)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = [json.loads(f.read_text()) for f in sorted(cwd.glob("result_*.json"))]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.requires_plugins("ddp")
def test_compiled_under_ddp_in_two_processes(tmp_path: Path) -> None:
    """`accel launch -n 2 --dynamo_backend eager`: each process compiles the model (frames counted while training
    under DistributedDataParallel), parameters stay in sync, unwrap_model gives the user's module."""
    script = tmp_path / "ddp_compile.py"
    script.write_text(DDP_WORKER)
    proc = subprocess.run(
        [str(BIN / "accel"), "launch", "-q", "-n", "2", "--dynamo_backend", "eager", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    ranks = worker_results(proc, tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["world"], r["wrapper"], r["backend"]) == (2, "DistributedDataParallel", "eager")
        assert r["frames"] >= 1 and r["graphs"] >= 1
        assert r["captured"] >= 3  # linear, tanh, linear: the whole forward is in the graph, not fragments of DDP
        assert r["unwrapped_is_net"] and r["keys"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert ranks[0]["params"][0] == ranks[0]["params"][1]


INDUCTOR_WORKER = """
import json, os, pathlib
import torch
from torch._dynamo.utils import counters
from accel import Kernel

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
x = torch.randn(4, 8)
expected = net(x)
kernel = Kernel(dynamo_backend="INDUCTOR")
model = kernel.prepare(net)
out = model(x)
out.sum().backward()
files = sum(len(f) for _, _, f in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
pathlib.Path("result_0.json").write_text(json.dumps({"rank": 0, "graphs": counters["stats"]["unique_graphs"],
    "close": bool(torch.allclose(out, expected, atol=1e-5)), "cache_files": files,
    "unwrapped": kernel.unwrap_model(model) is net}))
"""


@pytest.mark.slow
def test_inductor_compiles_with_its_cache_in_the_workspace(tmp_path: Path) -> None:
    script = tmp_path / "inductor.py"
    script.write_text(INDUCTOR_WORKER)
    cache = tmp_path / "inductor-cache"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache)),
    )
    (result,) = worker_results(proc, tmp_path)
    assert result == {"rank": 0, "graphs": 1, "close": True, "cache_files": result["cache_files"], "unwrapped": True}
    assert result["cache_files"] > 0


# ---- accel config ------------------------------------------------------------------------------------------------


def test_accel_config_asks_the_torch_compile_questions() -> None:
    from accel import Question
    from accel.commands.questionnaire import Questionnaire
    from accel.plugins import Plugins

    answers = {
        "distributed_type": "NO",
        "cpu": True,
        "use_dynamo": "yes",
        "dynamo_backend": "inductor",
        "dynamo_customize": True,
        "dynamo_mode": "max-autotune",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": True,
        "mixed_precision": "no",
    }
    asked: list[str] = []

    def ask(q: Question, disabled: Any) -> Any:
        asked.append(q.key)
        return answers.get(q.key, q.default)

    questionnaire = Questionnaire(Plugins.load(env={"ACCEL_PLUGINS": "ddp,dynamo"}), ask, env={})
    questionnaire.run()
    i = asked.index("dynamo_backend")
    assert asked[i : i + 6] == [
        "dynamo_backend",
        "dynamo_customize",
        "dynamo_mode",
        "dynamo_use_fullgraph",
        "dynamo_use_dynamic",
        "dynamo_use_regional_compilation",
    ]
    assert questionnaire.config_data()["dynamo_config"] == {
        "dynamo_backend": "inductor",
        "dynamo_mode": "max-autotune",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": True,
    }
    # without customising, only the backend is written
    answers["dynamo_customize"] = False
    questionnaire = Questionnaire(Plugins.load(env={"ACCEL_PLUGINS": "ddp,dynamo"}), ask, env={})
    questionnaire.run()
    assert questionnaire.config_data()["dynamo_config"] == {"dynamo_backend": "inductor"}


@pytest.mark.smoke
def test_checkpoints_of_a_compiled_model_load_into_an_uncompiled_one(tmp_path: Path) -> None:
    """save_model/save_state of a compiled model: plain keys (no `_orig_mod.`), loadable without dynamo."""
    from safetensors.torch import load_file

    kernel = Kernel(dynamo_backend="eager")
    net = Net()
    model, _ = train(kernel, net)
    assert frames() >= 1
    kernel.save_model(model, tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    kernel.save_state(tmp_path / "ckpt")

    plain = Kernel()
    net2 = Net()
    model2, opt2 = plain.prepare(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
    plain.load_state(tmp_path / "ckpt")
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(exported[k], v) for k, v in net2.state_dict().items())
