"""The kernel's required dependencies are what runs need (kernel/README.md). numpy is not a dependency of the
kernel's own code: ``import accel`` and a one-process training run work without it. Writing a checkpoint needs it
because safetensors' torch writer goes through numpy (hence ``safetensors[torch]``, which brings it); the test says
so, and fails (time to make numpy optional) when safetensors stops needing it. numpy is blocked in a fresh
interpreter with ``sys.modules["numpy"] = None`` (imports fail and ``importlib.util.find_spec`` says it is absent, as
torch checks). The CLI's plugin table needs no rich."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from clitools import clean_env, run

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_NUMPY = r"""
import sys, traceback

sys.modules["numpy"] = None  # as if not installed

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Kernel
from accel.utils import set_seed

set_seed(0)
kernel = Kernel(cpu=True, gradient_accumulation_steps=2)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model, opt, loader = kernel.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.01),
                                    DataLoader(data, batch_size=8, shuffle=True, num_workers=1))
before = [p.detach().clone() for p in net.parameters()]
for x, y in loader:
    with kernel.accumulate(model):
        kernel.backward(torch.nn.functional.mse_loss(model(x), y))
        kernel.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
assert not all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
assert kernel.gather_for_metrics(torch.arange(3)).tolist() == [0, 1, 2]
print("TRAINED")
try:
    kernel.save_state(sys.argv[1])
except ImportError:
    print(traceback.format_exc())
else:
    print("SAVED")
kernel.end_training()
assert sys.modules["numpy"] is None
"""


def test_kernel_trains_without_numpy_and_saves_through_safetensors_numpy(tmp_path: Path) -> None:
    env = clean_env(tmp_path, ACCEL_PLUGINS="")  # the kernel alone: plugins bring their own dependencies
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_NUMPY, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TRAINED" in result.stdout
    assert "SAVED" not in result.stdout, (
        "safetensors now writes torch tensors without numpy: make numpy optional (kernel/pyproject.toml: "
        "safetensors instead of safetensors[torch]; kernel/README.md)"
    )
    assert "numpy" in result.stdout and "safetensors/torch.py" in result.stdout, result.stdout


def test_kernel_dependencies_are_these_each_with_its_reason() -> None:
    deps = tomllib.loads((ROOT / "kernel" / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.match(r"[A-Za-z0-9_.\-\[\]]+", d).group(0) for d in deps]
    assert sorted(n.lower() for n in names) == ["pluggy", "pyyaml", "questionary", "safetensors[torch]", "torch"]
    readme = (ROOT / "kernel" / "README.md").read_text()
    for name in names:  # each required one has its reason in kernel/README.md
        assert f"| `{name}` |" in readme, name


def test_plugins_table_without_rich(tmp_path: Path) -> None:
    code = "import sys\nsys.modules['rich'] = None\nfrom accel.commands.cli import main\nsys.exit(main(['plugins']))\n"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(tmp_path, COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "accel plugins (entry-point group 'accel')"
    assert lines[1].split() == ["name", "distribution", "version", "hooks", "status"]
    assert max(map(len, lines)) <= 100
    assert run(["plugins"], clean_env(tmp_path, COLUMNS="100")).stdout == result.stdout
