"""notebook_launcher / debug_launcher: real processes on the CPU, from pytest, a plain Python process and a real
Jupyter kernel; the fork/spawn decision when the accelerator was already initialised (Accelerate #3925)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest
import torch

import accel
import accel.launchers as launchers
from accel import UsageError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith(("ACCEL_", "ACCELERATE_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ACCEL_PLUGINS", "ddp")  # only the strategy these tests rely on, whatever else is installed


def world(tag: str) -> dict:
    """Run in each launched process: what Kernel() sees."""
    from accel import Kernel

    kernel = Kernel()
    ranks = kernel.gather(torch.tensor([kernel.process_index])).tolist()
    seen = {
        "tag": tag,
        "index": kernel.process_index,
        "num": kernel.num_processes,
        "device": str(kernel.device),
        "ranks": ranks,
        "local": os.environ["LOCAL_RANK"],
        "addr": os.environ["MASTER_ADDR"],
        "port": os.environ["MASTER_PORT"],
        "cpu": kernel.settings["cpu"],
        "strategy": [c.name for c in kernel.components],
    }
    kernel.end_training()
    return seen


def fails() -> None:
    raise ValueError("boom in a launched process")


@pytest.mark.smoke
def test_debug_launcher_runs_two_cpu_processes_that_see_their_world() -> None:
    results = accel.debug_launcher(world, args=("dbg",), num_processes=2)
    assert [r["index"] for r in results] == [0, 1]
    for r in results:
        assert r["num"] == 2 and r["ranks"] == [0, 1] and r["device"] == "cpu" and r["cpu"] is True
        assert r["strategy"] == ["ddp"] and r["addr"] == "127.0.0.1" and r["tag"] == "dbg"
    assert results[0]["port"] == results[1]["port"]
    assert "ACCEL_CONFIG" not in os.environ  # restored after the launch


@pytest.mark.smoke
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_end_training_after_a_collective_does_not_hang_in_destroy_process_group() -> None:
    """Before torch 2.8 gloo's process group was destroyed holding the GIL while a worker thread still dropped the
    last collective's work (which needs the GIL): ``end_training`` right after a ``gather`` hung about 1 launch in 7
    on torch 2.7.0 (the floor the torch matrix tests), more often while other threads take turns at the GIL. With
    the pause before the destruction, 40 of 40 launches ended."""
    import threading

    stop = threading.Event()

    def churn() -> None:  # threads starting and ending: the GIL changes hands often, as in a busy notebook
        while not stop.is_set():
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    churners = [threading.Thread(target=churn, daemon=True) for _ in range(3)]
    for t in churners:
        t.start()
    try:
        for launch in range(15):
            results = accel.debug_launcher(world, args=(f"end{launch}",), num_processes=2)
            assert [r["ranks"] for r in results] == [[0, 1], [0, 1]]
    finally:
        stop.set()
        for t in churners:
            t.join()


def test_notebook_launcher_from_a_plain_python_process(tmp_path: Path) -> None:
    """A function defined in a script's __main__, mixed precision handed to Kernel() in each process (a small
    precision plugin registered directly provides bf16 on the CPU, so Kernel() accepts it)."""
    script = tmp_path / "nb.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, types
        from accel import Component, hookimpl, notebook_launcher

        class Bf16(Component):
            role = "precision"
            provides = frozenset({"precision:bf16"})

        prec = types.ModuleType("prec")
        prec.accel_activate = hookimpl(lambda settings: Bf16() if settings.mixed_precision == "bf16" else None)

        def train(scale):
            from accel import Kernel
            kernel = Kernel(extra_plugins=[("prec", prec)])
            out = {"index": kernel.process_index, "num": kernel.num_processes, "mp": kernel.mixed_precision,
                   "source": kernel.settings.sources["mixed_precision"], "value": scale * (kernel.process_index + 1)}
            kernel.end_training()
            return out

        if __name__ == "__main__":
            print("RESULT " + json.dumps(notebook_launcher(train, args=(10,), num_processes=2, mixed_precision="bf16")))
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_HOME=str(tmp_path), ACCEL_PLUGINS="ddp")  # the test's precision plugin, not an installed one
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    assert results == [
        {"index": 0, "num": 2, "mp": "bf16", "source": "launch", "value": 10},
        {"index": 1, "num": 2, "mp": "bf16", "source": "launch", "value": 20},
    ]
    assert "start method fork" in proc.stdout


def test_forked_processes_of_a_parent_that_used_torch_threads_do_not_hang(tmp_path: Path) -> None:
    """GNU OpenMP's thread pool does not survive a fork: a launched process whose parent had run a multi-threaded op
    hung in its first one (the CHANGELOG's former known issue). Forked processes run with one intra-op thread, as
    torchrun's and DataLoader workers do. run_tree: a hang ends at the deadline with every process's stacks."""
    from accel.testing import run_tree

    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent("""
        import json
        import torch
        from accel import debug_launcher

        def work():
            a = torch.randn(800, 800)
            for _ in range(5):
                a = (a @ a).tanh()
            return torch.get_num_threads()

        if __name__ == "__main__":
            torch.set_num_threads(2)
            a = torch.randn(2000, 2000)
            (a @ a).sum()  # the parent's OpenMP pool is up
            print("RESULT " + json.dumps(debug_launcher(work, num_processes=2)))
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env.update(ACCEL_HOME=str(tmp_path), ACCEL_PLUGINS="ddp")
    proc = run_tree([sys.executable, str(script)], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "start method fork" in proc.stdout
    assert "RESULT [1, 1]" in proc.stdout, proc.stdout


def test_one_process_runs_in_this_process_with_the_settings() -> None:
    def here() -> tuple[int, str]:
        return os.getpid(), json.loads(os.environ["ACCEL_CONFIG"])["mixed_precision"]

    [(pid, mp)] = accel.notebook_launcher(here, num_processes=1, mixed_precision="fp16")
    assert pid == os.getpid() and mp == "fp16"
    assert "ACCEL_CONFIG" not in os.environ


def test_bad_arguments_are_one_clear_error_before_anything_starts() -> None:
    with pytest.raises(UsageError, match="did you mean `bf16`"):
        accel.notebook_launcher(world, args=("x",), num_processes=2, mixed_precision="bf61")
    with pytest.raises(UsageError, match="num_processes must be a whole number"):
        accel.notebook_launcher(world, args=("x",), num_processes=0)


def touch(path: str) -> None:
    Path(path).write_text("started")


def test_the_launch_checks_run_before_any_process_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a plugin that provides 'distributed': the one line of `accel launch -n 2`, and nothing forked."""
    monkeypatch.setenv("ACCEL_PLUGINS", "")  # no plugin at all
    marker = tmp_path / "started"
    with pytest.raises(
        UsageError,
        match=r"^running 2 processes needs a plugin that provides 'distributed', and "
        r"none is active",
    ):
        accel.notebook_launcher(touch, args=(str(marker),), num_processes=2)
    with pytest.raises(UsageError, match="needs a plugin that provides 'distributed'"):
        accel.debug_launcher(touch, args=(str(marker),), num_processes=2)
    assert not marker.exists()


def test_a_failing_process_raises_with_its_error() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError, match="boom in a launched process"):
        accel.debug_launcher(fails, num_processes=2)


def test_a_launch_leaves_nothing_in_the_temp_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch's elastic agent keeps its records of a run (each process's error file) in a new torchelastic_* folder
    of the temp directory that it never removes; the launcher removes its own, whether the processes succeed or fail.
    (When one fails, torch.multiprocessing's per-process pytorch-errorfile-*.pickle stay: torch's, made and read
    inside the agent.)"""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert [r["index"] for r in accel.debug_launcher(world, args=("tmp",), num_processes=2)] == [0, 1]
    assert sorted(p.name for p in temp.iterdir()) == []
    with pytest.raises(ChildFailedError, match="boom in a launched process"):
        accel.debug_launcher(fails, num_processes=2)
    assert [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "accel-"))] == []


# ---- the CUDA-already-initialised case (#3925) -------------------------------------------------------------


def fake_torch(kind: str | None, initialized: bool) -> types.SimpleNamespace:
    """A stand-in for the torch module of a machine with an accelerator of ``kind`` (this machine has none)."""
    device = torch.device(kind) if kind else None
    ns = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(current_accelerator=lambda check_available=False: device)
    )
    if kind:
        setattr(ns, kind, types.SimpleNamespace(is_initialized=lambda: initialized))
    return ns


def test_initialized_accelerator_detection() -> None:
    assert launchers.initialized_accelerator() is None  # real torch on this CPU machine
    assert launchers.initialized_accelerator(fake_torch("cuda", True)) == "cuda"
    assert launchers.initialized_accelerator(fake_torch("cuda", False)) is None
    assert launchers.initialized_accelerator(fake_torch("xpu", True)) == "xpu"
    assert launchers.initialized_accelerator(fake_torch(None, False)) is None
    assert launchers.initialized_accelerator(types.SimpleNamespace()) is None  # torch without torch.accelerator


def test_start_method_choice() -> None:
    assert launchers.choose_start_method(world, (), None, None) == "fork"
    assert launchers.choose_start_method(world, (), None, "cuda") == "spawn"  # importable: spawn instead of fork
    with pytest.raises(
        UsageError,
        match=r"cuda was already initialised.*Cannot re-initialize CUDA in forked "
        r"subprocess.*Restart the notebook kernel",
    ):
        launchers.choose_start_method(lambda: None, (), None, "cuda")  # a lambda cannot be imported by spawn
    with pytest.raises(UsageError, match="already initialised"):
        launchers.choose_start_method(world, (), "fork", "cuda")  # fork asked for explicitly: refused, not hung
    with pytest.raises(UsageError, match="not available"):
        launchers.choose_start_method(world, (), "teleport", None)


@pytest.mark.slow
def test_initialised_accelerator_switches_a_real_launch_to_spawn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launchers, "initialized_accelerator", lambda torch_module=None: "cuda")
    results = accel.debug_launcher(world, args=("spawned",), num_processes=2)
    assert [r["index"] for r in results] == [0, 1] and all(r["ranks"] == [0, 1] for r in results)
    assert "start method spawn" in capsys.readouterr().out


def run_in_jupyter(code: str, timeout: float = 240) -> tuple[str, list[dict]]:
    manager = pytest.importorskip("jupyter_client.manager")
    km, kc = manager.start_new_kernel(kernel_name="python3")
    outputs: list[dict] = []
    try:
        reply = kc.execute_interactive(
            code,
            timeout=timeout,
            output_hook=lambda msg: (
                outputs.append({"type": msg["msg_type"], **msg["content"]})
                if msg["msg_type"] in ("stream", "error")
                else None
            ),
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return reply["content"]["status"], outputs


def test_notebook_launcher_in_a_real_jupyter_kernel() -> None:
    """The function is defined in the notebook (no file to import it from), so only fork can start it; then the
    same launch with an initialised accelerator is refused with the clear message, not a CUDA error in a child."""
    code = textwrap.dedent("""
        import accel.launchers
        from accel import notebook_launcher

        def train(tag):
            from accel import Kernel
            import torch
            kernel = Kernel()
            got = kernel.gather(torch.tensor([kernel.process_index])).tolist()
            kernel.end_training()
            return (kernel.process_index, kernel.num_processes, got, tag)

        print("RESULTS", notebook_launcher(train, ("nb",), num_processes=2))
        accel.launchers.initialized_accelerator = lambda torch_module=None: "cuda"
        notebook_launcher(train, ("nb",), num_processes=2)
    """)
    status, outputs = run_in_jupyter(code)
    text = "".join(o.get("text", "") for o in outputs if o["type"] == "stream")
    assert "RESULTS [(0, 2, [0, 1], 'nb'), (1, 2, [0, 1], 'nb')]" in text
    assert status == "error"
    [error] = [o for o in outputs if o["type"] == "error"]
    assert error["ename"] == "UsageError"
    assert "cuda was already initialised" in error["evalue"] and "Restart the notebook kernel" in error["evalue"]
