"""Words at the terminal, wrong or missing, and output: each mistake gets one line naming the value and the fix (and the
exit code a script or command ends with), and the output fits a pipe. Each test's docstring says what was printed
before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from clitools import clean_env, launch_env, run

from accel import Kernel, UsageError

# ---- the failure summary names the first process that failed ------------------------------------------------------

RANK_1_RAISES = """
import torch, torch.distributed as dist
from accel import Kernel
kernel = Kernel()
kernel.wait_for_everyone()
if kernel.process_index == 1:
    raise ValueError("boom on rank 1")
dist.all_reduce(torch.ones(1))  # rank 0 fails here, in the same second, once rank 1 is gone
"""


@pytest.mark.multiprocess
def test_the_last_line_names_the_process_that_failed_first(tmp_path: Path) -> None:
    """Before: `accel: process 0 of 2 exited with code 1 (1 more failed after it)` (torch's failure times have
    whole seconds; a slow poll saw both exits at once and the tie went to rank 0)."""
    script = tmp_path / "rank1.py"
    script.write_text(RANK_1_RAISES)
    result = run(["launch", "-q", "-n", "2", "--monitor_interval", "2", str(script)], clean_env(tmp_path))
    assert result.returncode == 1, result
    assert result.err_lines[-1].startswith("accel: process 1 of 2 exited with code 1 (1 more failed after it); "), (
        result
    )


def failed(local_rank: int, exitcode: int, timestamp: int, tmp_path: Path) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank, 1000 + local_rank, exitcode, str(tmp_path / "no-error-file.json"))
    failure.timestamp = timestamp  # what torch's agent set: int(time.time()) when its poll saw this exit
    return failure


def test_the_first_failure_is_found_when_torchs_poll_crosses_a_second(tmp_path: Path) -> None:
    """Before: CI printed `process 0 of 2 exited with code 1 (1 more failed after it)` for the run above: torch's
    agent stamps each failure it sees with `int(time.time())`, one after another, and rank 0's failure was stamped in
    second 100 and rank 1's in second 101, though rank 1 raised first (the noted times say so)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from accel.distributed import failure_line

    settings: Any = {"num_processes": 2}
    exc = ChildFailedError("script", {0: failed(0, 1, 100, tmp_path), 1: failed(1, 1, 101, tmp_path)})
    line, code = failure_line(exc, settings, None, {0: 99.7, 1: 99.6})
    assert line.startswith("accel: process 1 of 2 exited with code 1 (1 more failed after it); ") and code == 1, line
    # with no noted times torch's seconds decide; within one second a process stopped by SIGTERM comes last
    line, _ = failure_line(exc, settings, None, {})
    assert line.startswith("accel: process 0 of 2 exited with code 1"), line
    stopped = ChildFailedError("script", {0: failed(0, -15, 100, tmp_path), 1: failed(1, 1, 100, tmp_path)})
    line, code = failure_line(stopped, settings, None, {1: 100.2})
    assert line.startswith("accel: process 1 of 2 exited with code 1") and code == 1, line


# ---- plugin names that match nothing, ACCELERATE_* variables, log_with ----------------------------------------------


def test_disabling_a_misspelt_plugin_warns_with_the_closest_name(tmp_path: Path) -> None:
    """Before: `-p no:ddpp` and `ACCEL_DISABLE_PLUGINS=tensorbaord` were accepted without a word (ddp stayed on)."""
    env = clean_env(tmp_path)
    result = run(["plugins", "-p", "no:ddpp"], env)
    assert result.returncode == 0, result
    assert result.err_lines == [
        "accel: warning: -p no:ddpp names no plugin, so it does nothing; did you mean `ddp`? (installed: ddp)"
    ]
    result = run(["plugins"], {**env, "ACCEL_DISABLE_PLUGINS": "tensorbaord", "ACCEL_PLUGINS": "ddp,dpp"})
    assert result.err_lines == [
        "accel: warning: ACCEL_DISABLE_PLUGINS=tensorbaord names no plugin, so it does nothing; did you mean "
        "`tensorboard`? (installed: ddp)",
        "accel: warning: ACCEL_PLUGINS=dpp names no plugin, so it does nothing; did you mean `ddp`? (installed: ddp)",
    ]
    # a published plugin that is not installed here is no typo; one that is installed is no typo either
    quiet = run(["plugins"], {**env, "ACCEL_DISABLE_PLUGINS": "wandb,ddp"})
    assert quiet.returncode == 0 and quiet.err_lines == [], quiet


def kernel_stderr(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    full = {**launch_env(tmp_path), "ACCEL_PLUGINS": "", **env}
    return subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=120)


def test_accelerate_variables_accel_does_not_read_get_one_notice(tmp_path: Path) -> None:
    """Before: ACCELERATE_USE_DEEPSPEED=true ran without DeepSpeed and without a word."""
    proc = kernel_stderr(
        tmp_path,
        "from accel import Kernel\nKernel()\n",
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_USE_FSDP="false",  # asks for nothing
        ACCELERATE_MIXED_PRECISION="no",  # read by accel
        ACCELERATE_DEBUG_MODE="1",  # read by accel (debug mode; one process: nothing to check)
    )
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert len(notices) == 1, proc.stderr
    assert notices[0].endswith(
        "UserWarning: accel does not read ACCELERATE_USE_DEEPSPEED (use --plugin deepspeed "
        "or Kernel(plugins=['deepspeed'])); its settings are `accel launch` flags, Kernel arguments or ACCEL_* "
        "variables (`accel launch --help`)"
    ), notices
    silent = kernel_stderr(tmp_path, "from accel import Kernel\nKernel()\n", ACCELERATE_MIXED_PRECISION="no")
    assert silent.returncode == 0 and "UserWarning" not in silent.stderr, silent.stderr


def test_log_with_typo_suggests_the_tracker_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `... no published plugin has it; did you mean `tracker:tensorboard`?` (a name nobody can pass)."""
    monkeypatch.setenv("ACCEL_PLUGINS", "")
    with pytest.raises(UsageError) as err:
        Kernel(log_with="tensorbaord")
    assert str(err.value) == (
        "log_with='tensorbaord' names no tracker; did you mean `tensorboard`? (trackers: all, jsonl, mlflow, "
        "tensorboard, wandb; a tracker plugin of your own is named as its entry point)"
    )


# ---- prepare, backward, gather_for_metrics ---------------------------------------------------------------------------


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ACCEL_PLUGINS", "")
    k = Kernel()
    yield k
    k.end_training()


def test_prepare_refuses_what_it_cannot_mean(kernel: Any) -> None:
    """Before: each of these was returned unchanged, without a word."""
    model = torch.nn.Linear(2, 1)
    cases = {
        (None,): "kernel.prepare() got only None; prepare takes models, optimizers, DataLoaders and LR schedulers",
        (model, torch.ones(2)): "kernel.prepare() argument 2 is a tensor; prepare takes models, optimizers, "
        "DataLoaders and LR schedulers; move a tensor with tensor.to(kernel.device), or wrap data in a Dataset and "
        "a DataLoader",
        ((x for x in range(3)),): "kernel.prepare() argument 1 is an iterator (generator), which is used up after "
        "one pass and cannot be split between processes; prepare takes models, optimizers, DataLoaders and LR "
        "schedulers: pass the DataLoader itself",
        (model, model): "kernel.prepare() argument 2 is the same Linear object as argument 1; pass each object once",
    }
    for args, message in cases.items():
        with pytest.raises(UsageError) as err:
            kernel.prepare(*args)
        assert str(err.value) == message
    # what Accelerate passes through still passes: None next to other objects (an optional scheduler), other objects
    prepared, nothing, number = kernel.prepare(model, None, 3)
    assert nothing is None and number == 3 and isinstance(prepared, torch.nn.Module)


def test_backward_of_a_loss_without_grad_is_one_line(kernel: Any) -> None:
    """Before: torch's `RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn`."""
    model = kernel.prepare(torch.nn.Linear(2, 1))
    with torch.no_grad():
        loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(
        UsageError, match=r"^kernel.backward\(\): the loss does not require grad: it was computed under"
    ):
        kernel.backward(loss)
    with pytest.raises(UsageError, match=r"^kernel.backward\(\) needs the loss tensor, got float 0.5$"):
        kernel.backward(0.5)


def test_gather_for_metrics_of_an_unpicklable_value_is_one_line(kernel: Any) -> None:
    """Before: a raw `PicklingError`/`TypeError: cannot pickle 'generator' object` from all_gather_object under
    several processes (and the value passed through on one)."""
    with pytest.raises(UsageError, match=r"^kernel.gather_for_metrics\(\) got generator .* neither tensors"):
        kernel.gather_for_metrics(x for x in range(2))
    # numbers, strings and tensors still gather (Accelerate's gather_object path included)
    assert kernel.gather_for_metrics(5) == [5]
    assert kernel.gather_for_metrics(["a"], use_gather_object=True) == ["a"]
    assert torch.equal(kernel.gather_for_metrics(torch.ones(2)), torch.ones(2))


UNPREPARED = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from accel import Kernel
kernel = Kernel(log_with="tensorboard", project_dir={project!r})
kernel.init_trackers("words")
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_dl = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
shown_dl = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
model, optimizer, prepared_dl = kernel.prepare(model, optimizer, shown_dl)
batches = 0
for (x,) in train_dl:
    kernel.backward(model(x).sum())
    batches += 1
kernel.log_table("table", columns=["a"], data=[[1]])
kernel.log_table("table", columns=["a"], data=[[1]])
kernel.print(f"batches {{batches}}")
kernel.end_training()
"""


@pytest.mark.multiprocess
def test_unprepared_dataloader_and_unsupported_log_table_warn_once_on_the_main_process(tmp_path: Path) -> None:
    """Before: a DataLoader that skipped prepare gave both processes the whole dataset without a word, and
    TensorBoard's `log_table` warning came once per process."""
    pytest.importorskip("tensorboard")
    script = tmp_path / "unprepared.py"
    script.write_text(UNPREPARED.format(project=str(tmp_path / "project")))
    env = clean_env(tmp_path, hide=False, ACCEL_PLUGINS="ddp,tensorboard")
    result = run(["launch", "-q", "-n", "2", str(script)], env)
    assert result.returncode == 0, result
    assert "batches 4" in result.stdout  # every process iterated the whole dataset: what the warning is about
    warned = [line for line in result.err_lines if "Warning:" in line]
    assert len(warned) == 2, result
    assert warned[0].endswith(
        "UserWarning: DataLoader `train_dl` did not go through kernel.prepare(): each of the 2 processes iterates "
        "its whole dataset (the same batches everywhere, an epoch 2x too long); pass it to kernel.prepare() to give "
        "each process its own shard"
    ), warned
    assert "kernel.log_table(): none of the active trackers (tensorboard) can log this" in warned[1], warned


def test_a_prepared_or_sharded_dataloader_is_not_warned_about(tmp_path: Path) -> None:
    """The one look happens once and knows the loaders that went through prepare (kept under their old name too)."""
    code = """
    import torch, warnings
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from accel import Kernel
    kernel = Kernel()
    kernel._loader_check_due = True  # as with several processes
    data = TensorDataset(torch.ones(4, 2))
    loader = DataLoader(data, batch_size=2)
    own = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    model, prepared = kernel.prepare(torch.nn.Linear(2, 1), loader)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for (x,) in loader:
            kernel.backward(model(x).sum())
    print("WARNINGS", len(seen))
    """
    proc = kernel_stderr(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    assert "WARNINGS 0" in proc.stdout, proc.stdout + proc.stderr


# ---- output -----------------------------------------------------------------------------------------------------------


def test_plugins_in_a_pipe_is_one_line_per_plugin_whatever_the_width(tmp_path: Path) -> None:
    """Before: cells wrapped at 80 columns in a pipe, install hints cut mid-word (`inte/l-extension-for-p/ytorch`)."""
    env = clean_env(tmp_path, hide=False)
    env.pop("COLUMNS", None)
    result = run(["plugins"], env)
    rows = json.loads(run(["plugins", "--json"], env).stdout)
    lines = result.stdout.splitlines()
    assert len(lines) == 3 + len(rows), result.stdout  # title, header, rule, one line per plugin
    for row, line in zip(rows, lines[3:], strict=True):
        assert line.startswith(row["name"]) and row["reason"] in line and ", ".join(row["hooks"]) in line, line
    assert run(["plugins"], {**env, "COLUMNS": "300"}).stdout != "" and result.returncode == 0


def test_mlflow_works_with_its_defaults(tmp_path: Path) -> None:
    """Before: with log_with="all" the mlflow tracker failed at init_trackers: mlflow-skinny cannot open MLflow's
    default store (`sqlite:` needs SQLAlchemy; the file store needs MLFLOW_ALLOW_FILE_STORE)."""
    pytest.importorskip("mlflow")
    code = f"""
    from accel import Kernel
    kernel = Kernel(log_with="mlflow", project_dir={str(tmp_path / "project")!r})
    kernel.init_trackers("defaults", config={{"lr": 0.1}})
    kernel.log({{"loss": 0.5}}, step=1)
    kernel.end_training()
    import mlflow
    runs = mlflow.search_runs(experiment_names=["defaults"], output_format="list")
    print("RUNS", len(runs), runs[0].data.metrics, mlflow.get_tracking_uri().startswith(("file:", "sqlite:")))
    """
    env = {"ACCEL_PLUGINS": "mlflow"}
    proc = kernel_stderr(tmp_path, code, **env)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert "RUNS 1 {'loss': 0.5} True" in proc.stdout, proc.stdout + proc.stderr
