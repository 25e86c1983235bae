"""FSDP on the mesh keeps accel-plugin-fsdp's features: ``--plugin parallel`` with dp_shard=2 on 2 CPU processes
(gloo), each ``parallelism_config_fsdp_*`` option against a 1-process run of the kernel alone, and the sharded-training
toolkit's gradient clipping against torch's.

The worker is the fsdp plugin's (plugins/fsdp/tests/fsdp_worker.py: three ``Block`` layers, the model's ``_no_split_modules``),
launched with ``--plugin parallel``, so the same script and measurements serve both plugins. Tolerances follow
plugins/parallel/tests/test_parallel.py's rule: losses and gradient norms relative 1e-5, parameters after 3 AdamW steps absolute 1e-4
(the sharded runs sum the same float32 values in another order; a lost shard or a missing average changes them by
orders of magnitude more).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_fsdp
import torch
from test_fsdp import result

HERE = Path(__file__).parent
WORKER = test_fsdp.WORKER
ACCEL = str(Path(sys.executable).parent / "accel")
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
OPT = "--parallelism_config_fsdp_"
reference = test_fsdp.reference  # the fixture: the worker on 1 process, kernel only


def run(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "FSDP_", "PARALLELISM_"))}
    env.update(ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)


CASES = {
    "offload": [f"{OPT}offload_params", "true"],
    "wrap_policy": [f"{OPT}auto_wrap_policy", "SIZE_BASED_WRAP", f"{OPT}min_num_params", "2000"],
    "activation_checkpointing": [f"{OPT}activation_checkpointing", "true"],
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_option_on_the_mesh_matches_one_process(case: str, reference: Any, tmp_path: Path) -> None:
    mesh = ["-n", "2", "--plugin", "parallel", "--parallelism_config_dp_shard_size", "2"]
    proc = run([ACCEL, "launch", "-q", *mesh, *CASES[case], str(WORKER), "train", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res, params = result(tmp_path / "out")
    ref_res, ref_params = reference
    assert ref_res["block_forwards"] == 3 * 6  # 3 Blocks, 6 steps
    assert res["world"] == 2 and res["plugins"] == ["parallel"] and res["param_type"] == "DTensor"
    assert res["local_numel"] == [res["total_numel"] // 2] * 2  # each process holds half
    assert res["optimizer_params_are_model_params"]
    assert res["losses"] == pytest.approx(ref_res["losses"], rel=LOSS_TOL)
    assert res["norms"] == pytest.approx(ref_res["norms"], rel=LOSS_TOL)  # clipped by the norm over both shards
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=PARAM_TOL, msg=name)

    # what each option changes, and that the others stay off
    offload = case == "offload"
    assert res["offload"] == ("CPUOffloadPolicy(pin_memory=False)" if offload else "OffloadPolicy()")
    assert res["param_device"] == "cpu"
    # SIZE_BASED_WRAP at 2000: fc1 and fc2 of each Block (2112 and 2080 parameters); else the 3 Blocks; plus the root
    assert res["shard_units"] == (7 if case == "wrap_policy" else 4)
    recompute = case == "activation_checkpointing"
    assert res["checkpointed"] == (3 if recompute else 0)
    # activation checkpointing runs each Block's forward again in backward: twice the forward calls
    assert res["block_forwards"] == ref_res["block_forwards"] * (2 if recompute else 1)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "sizes", "units"), [(1, [], 0), (2, ["--parallelism_config_dp_replicate_size", "2"], 4)])
def test_activation_checkpointing_as_its_own_option_matches_the_kernel_alone(
    reference: Any, tmp_path: Path, n: int, sizes: list[str], units: int
) -> None:
    # its own option, on any mesh: one process (no mesh dimension, no FSDP), and replicas (HSDP's replicate dim)
    args = ["-n", str(n), "--plugin", "parallel", *sizes, "--parallelism_config_activation_checkpointing", "true"]
    proc = run([ACCEL, "launch", "-q", *args, str(WORKER), "train", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res, params = result(tmp_path / "out")
    ref_res, ref_params = reference
    assert res["world"] == n and res["plugins"] == ["parallel"] and res["shard_units"] == units
    assert res["checkpointed"] == 3 and res["block_forwards"] == 2 * ref_res["block_forwards"]  # recomputed
    assert res["losses"] == pytest.approx(ref_res["losses"], rel=LOSS_TOL)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=PARAM_TOL, msg=name)


def test_fsdp_options_without_data_parallel_dims_are_refused(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("raise SystemExit('must not run')\n")
    mesh = ["-n", "2", "--plugin", "parallel", "--parallelism_config_tp_size", "2"]
    proc = run([ACCEL, "launch", "-q", *mesh, f"{OPT}offload_params", "true", str(script)], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "accel: error: plugin 'parallel': parallelism_config_fsdp_offload_params set, but the mesh has no "
        "data-parallel dimension for FSDP to shard over (dp_replicate, dp_shard and cp are 1); set "
        "parallelism_config_dp_shard_size > 1 or drop them"
    ]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_of_plain_gradients_is_torchs(norm_type: float) -> None:
    """Without a mesh the toolkit's clipping is torch's clip_grad_norm_: the same norm, the same clipped gradients."""
    from accel.spi.sharded import clip_grad_norm

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    for foreach in (None, False):
        norm = clip_grad_norm(ours, 0.5, norm_type, foreach=foreach)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type, foreach=foreach)
        torch.testing.assert_close(norm, expected)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    ours[0].grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm(ours, 0.5, norm_type, error_if_nonfinite=True)
    assert float(clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradients: norm 0


OLD_AND_FRESH = """
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from accel import Kernel
from accel.spi.sharded import dcp_save
from accel_parallel import load_sharded

out = Path(sys.argv[1])
kernel = Kernel(cpu=True, plugins=["parallel"])


def prepared(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return kernel.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))


model, optimizer = prepared(0)
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
# a checkpoint as accel-plugin-parallel wrote it before the toolkit: no "fresh" entry next to the optimizer state
dcp_save(get_model_state_dict(model), out / "old" / "model")
dcp_save(dict(get_optimizer_state_dict(model, optimizer.optimizer)), out / "old" / "optimizer")
loaded, loaded_optimizer = prepared(1)
load_sharded(kernel, out / "old", model=loaded, optimizer=loaded_optimizer)
assert torch.equal(loaded.weight, model.weight)
steps = [s["step"] for s in loaded_optimizer.optimizer.state.values()]
assert steps and all(float(s) == 1.0 for s in steps), steps
# saved before its first step, an optimizer loads back without state (not torch's zero-learning-rate warm-up step)
fresh, fresh_optimizer = prepared(2)
kernel.save_state(out / "fresh")
again, again_optimizer = prepared(3)
load_sharded(kernel, out / "fresh", model=again, optimizer=again_optimizer, model_key="model_2", optimizer_key="optimizer_2")
assert torch.equal(again.weight, fresh.weight) and not again_optimizer.optimizer.state
print("OK")
"""


def test_parallel_loads_its_checkpoints_from_before_the_toolkit_and_keeps_fresh_optimizers_fresh(
    tmp_path: Path,
) -> None:
    script = tmp_path / "old_and_fresh.py"
    script.write_text(OLD_AND_FRESH)
    proc = run([sys.executable, str(script), str(tmp_path)], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
