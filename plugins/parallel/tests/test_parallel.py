"""accel-plugin-parallel: training on an N-D device mesh with real processes (gloo, CPU, torchrun on free ports).

Each 4-process run trains an MLP (user tensor-parallel plan) and a tiny Llama built from a config (its Hugging Face
tp_plan) on the same global batches as a 1-process run of the kernel alone, and is compared with it.

Tolerances. Losses: relative 1e-5; parameters after 3 AdamW steps (6 batches, gradient accumulation 2, so
``no_sync`` is exercised): absolute 1e-4. The sharded runs compute the same float32 sums in another order
(tensor-parallel partial sums, FSDP's reduce-scatter averaging over the data-parallel processes), so single values
differ from the reference at float32 rounding (~1e-7 relative; measured: losses and gradient norms within 5e-7
relative). AdamW divides each gradient by its running RMS, which turns rounding differences of near-zero gradients
into larger parameter differences in a few entries; measured worst case: 2.2e-6 (Llama, 2x2; 6.2e-5 in a 6-step run
without accumulation), 3e-8 (MLP). 1e-4 leaves room for other BLAS summation orders and is far below any real error:
the parameters move by up to 5.9e-2 over the run (measured), and a missing gradient average, a skipped
accumulation or a lost shard changes the updates by that order.
Resume on the same mesh and loading a checkpoint (on any mesh) are exact: compared bitwise.

Launches (each process start costs seconds of ``import torch``/``transformers``): one launch of 4 processes runs
the checkpoint's run, the resume from it and the HSDP and tp=4 runs that load it one after the other, as cases of
``launch_cases`` (each its own Kernel, mesh, models, optimizers and loaders); new processes load the checkpoint in
test_one_process_loads_a_2x2_checkpoint_equal_to_the_gathered_state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
WORKER = HERE / "parallel_worker.py"
ACCEL = str(Path(sys.executable).parent / "accel")
MODELS = ("mlp", "llama")
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "PARALLELISM_"))}
    env.update(ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run(args: list[str], tmp: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env_for(tmp), capture_output=True, text=True, timeout=timeout, cwd=tmp)


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run([ACCEL, "launch", "-q", *args], tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def mesh(n: int, **sizes: int) -> list[str]:
    return [
        "-n",
        str(n),
        "--plugin",
        "parallel",
        *[a for dim, size in sizes.items() for a in (f"--parallelism_config_{dim}_size", str(size))],
    ]


def sizes(pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1) -> dict[str, int]:
    """A mesh as Kernel options: every size given, so that none comes from the launch's flags."""
    given = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
    return {f"parallelism_config_{dim}_size": size for dim, size in given.items()}


Case = tuple[str, dict[str, Any], list[str]]  # name, Kernel options, worker arguments


def launch_cases(tmp: Path, launch_args: list[str], worker: Path, cases: list[Case]) -> Callable[[str], Path]:
    """One launch that runs several cases one after the other (``--cases``: each its own Kernel and mesh on the
    launch's processes), instead of one launch per case: every process start costs seconds of ``import torch``.
    Returns ``out(name)``, the directory of case ``name``, which fails with the launch's output when that case
    wrote no result (it failed, or an earlier case stopped the launch)."""
    out = tmp / "out"
    proc = run([ACCEL, "launch", "-q", *launch_args, str(worker), str(out), "--cases", json.dumps(cases)], tmp)

    def case_out(name: str) -> Path:
        done = (out / name / "result.json").is_file()
        assert done, (
            f"case {name}: no result (launch exit {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        )
        return out / name

    return case_out


Result = tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]


def result(out: Path, suffix: str = "") -> Result:
    return (
        json.loads((out / "result.json").read_text()),
        {k: load_file(str(out / f"{k}{suffix}.safetensors")) for k in MODELS},
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """One process, kernel only (no plugin), the whole global batch each step."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = run([sys.executable, str(WORKER), str(tmp / "out"), "--ref"], tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res, params = result(tmp / "out")
    assert res["world"] == 1 and res["plugins"] == [] and res["param_type"] != "DTensor"
    return res, params


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """4 processes (one launch, dp_shard=2 x tp=2 from its flags), one case after the other: a checkpoint after
    batch 4 of 6 (optimizer step 2 of 3); then, each with a new Kernel, models, optimizers and loaders, resume from
    it, and on their own meshes (Kernel options) train and load it."""
    tmp = tmp_path_factory.mktemp("four")
    ckpt = str(tmp / "out" / "2x2" / "ckpt")
    cases: list[Case] = [
        ("2x2", {}, ["--save-at", "4"]),
        ("resume", {}, ["--save-at", "4", "--resume", ckpt]),
        ("hsdp", sizes(dp_replicate=2, dp_shard=2), ["--load", ckpt]),
        ("tp4", sizes(tp=4), ["--load", ckpt]),
    ]
    return launch_cases(tmp, mesh(4, dp_shard=2, tp=2), WORKER, cases)


@pytest.fixture(scope="module")
def saved(four: Callable[[str], Path]) -> Path:
    """4 processes, dp_shard=2 x tp=2, a checkpoint after batch 4 of 6 (optimizer step 2 of 3)."""
    return four("2x2")


def assert_matches(res: dict[str, Any], params: dict[str, dict[str, torch.Tensor]], ref: Result) -> None:
    ref_res, ref_params = ref
    for key in MODELS:
        assert res["losses"][key] == pytest.approx(ref_res["losses"][key], rel=LOSS_TOL), key
        assert res["norms"][key] == pytest.approx(ref_res["norms"][key], rel=LOSS_TOL), key  # norm over all shards
        assert params[key].keys() == ref_params[key].keys()
        for name, value in ref_params[key].items():
            torch.testing.assert_close(params[key][name], value, rtol=0, atol=PARAM_TOL, msg=f"{key}.{name}")
    assert res["optimizer_params_are_model_params"], "the optimizer must step the sharded parameters"
    # every sample of the 10-sample evaluation set counted once, in order, whatever the mesh
    assert res["eval_seen"] == list(range(10)) and res["eval_seen_objects"] == list(range(10))


def assert_bitwise(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    for key in MODELS:
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp_shard_2_x_tp_2_matches_one_process(saved: Path, reference: Result) -> None:
    res, params = result(saved)
    assert (res["world"], res["dp"], res["tp"], res["plugins"]) == (4, 2, 2, ["parallel"])
    assert res["param_type"] == "DTensor"
    for key in MODELS:  # each rank holds about a quarter (FSDP pads uneven dims, replicated biases count whole)
        assert res["local_numel"][key] <= 0.3 * res["total_numel"][key], key
    assert_matches(res, params, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_on_the_same_mesh_is_bitwise(saved: Path, four: Callable[[str], Path]) -> None:
    assert_bitwise(result(saved)[1], result(four("resume"))[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_matches_one_process_and_loads_a_2x2_checkpoint(
    four: Callable[[str], Path], saved: Path, reference: Result
) -> None:
    res, params = result(four("hsdp"))
    assert (res["world"], res["dp"], res["tp"]) == (4, 4, 1)
    assert res["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}  # the case's mesh, not the launch's
    assert_matches(res, params, reference)
    assert_bitwise(result(saved, "_at_save")[1], result(four("hsdp"), "_loaded")[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp_4_matches_one_process_and_loads_a_2x2_checkpoint(
    four: Callable[[str], Path], saved: Path, reference: Result
) -> None:
    res, params = result(four("tp4"))
    assert (res["world"], res["dp"], res["tp"]) == (4, 1, 4)
    assert res["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 4}
    assert_matches(res, params, reference)
    assert_bitwise(result(saved, "_at_save")[1], result(four("tp4"), "_loaded")[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_process_loads_a_2x2_checkpoint_equal_to_the_gathered_state(
    saved: Path, reference: Result, tmp_path: Path
) -> None:
    launch(tmp_path, *mesh(1), str(WORKER), str(tmp_path / "out"), "--load", str(saved / "ckpt"))
    res, params = result(tmp_path / "out")
    assert (res["world"], res["plugins"]) == (1, ["parallel"])
    assert_matches(res, params, reference)
    assert_bitwise(result(saved, "_at_save")[1], result(tmp_path / "out", "_loaded")[1])
