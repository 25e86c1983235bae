"""Run a ported Accelerate example on 2 CPU processes, under accel (``accel launch -n 2``) or under Accelerate 1.15
(torchrun with Accelerate's own environment variables, the ``accel`` names mapped back by ``accelerate_shim/``), and
read back what it did: the records of ``record/sitecustomize.py`` (learning rate at each optimizer step, training
losses), the ``epoch N: ...`` lines the examples print, and the files they wrote.

Used by ``test_examples.py`` and by ``compare_accelerate.py`` (``make compat-vs-accelerate``).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import random
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ACCEL = str(Path(sys.executable).with_name("accel"))
RECORD = HERE / "record"
SHIM = HERE / "accelerate_shim"
#: DeepSpeed's JIT-built ops (the shared-memory communication op of every process group) are kept between runs.
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(ROOT / ".cache" / "torch_extensions")
_DROP = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONPATH",
)


def free_port() -> int:
    for _ in range(100):
        port = random.randrange(20000, 60000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


@dataclass
class Run:
    """One finished run of an example."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    out: Path  # the run's working directory (records under out/record)

    def __str__(self) -> str:  # what pytest shows when an assert fails
        return (
            f"$ {' '.join(self.cmd)}\nexit {self.returncode}\n--- stdout (tail)\n{self.stdout[-4000:]}\n"
            f"--- stderr (tail)\n{self.stderr[-8000:]}"
        )

    def record(self, rank: int = 0) -> dict[str, list[Any]]:
        path = self.out / "record" / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"no record of process {rank}\n{self}")
        data: dict[str, list[Any]] = json.loads(path.read_text())
        return data

    @property
    def lrs(self) -> list[float]:
        """Learning rate of the first parameter group at each optimizer step of process 0."""
        return [groups[0] for groups in self.record(0)["lrs"]]

    @property
    def losses(self) -> list[float]:
        return list(self.record(0)["losses"])

    def epochs(self) -> list[Any]:
        """What the example printed after ``epoch N:`` (a dict literal, a number or text), in order."""
        found = []
        for line in self.stdout.splitlines():
            m = re.match(r"^epoch (\d+): (.*)$", line.strip())
            if m:
                try:
                    found.append(ast.literal_eval(m.group(2)))
                except (ValueError, SyntaxError):
                    found.append(m.group(2))
        return found


@dataclass
class Case:
    """How to run one example: its script, arguments, launch flags (accel) and sizes."""

    script: str
    args: Sequence[str] = ()
    flags: Sequence[str] = ()  # accel launch flags (mixed precision, plugin, ...)
    config: dict[str, Any] = field(default_factory=dict)  # COMPAT_CONFIG overrides
    train_size: int = 128
    eval_size: int = 64
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 600


def _env(out: Path, case: Case, extra_path: Sequence[Path] = ()) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROP and not k.startswith(("ACCEL_", "ACCELERATE_", "TORCHELASTIC_", "SLURM_", "COMPAT_"))
    }
    env.update(
        ACCEL_HOME=str(out / "accel_home"),
        HF_HOME=str(out / "hf_home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_EXTENSIONS_DIR=EXTENSIONS,
        COMPAT_RECORD=str(out / "record"),
        COMPAT_TRAIN_SIZE=str(case.train_size),
        COMPAT_EVAL_SIZE=str(case.eval_size),
        COMPAT_CONFIG=json.dumps(case.config),
        MPLBACKEND="Agg",
        WANDB_MODE="offline",
        TQDM_DISABLE="1",
        PYTHONPATH=os.pathsep.join(str(p) for p in (*extra_path, RECORD, HERE)),
    )
    env.update(case.env)
    return env


def _per_rank(out: Path, stream: str) -> str:
    """What the processes wrote to ``stream``, process after process (torchrun's ``<logs>/<run>/attempt_<n>/<local
    rank>/<stream>.log``): two processes printing to one pipe interleave their writes (workers run ``python -u``,
    so ``print("epoch 2:", metrics)`` is several writes), and one process's lines must stay whole to be parsed."""
    files = sorted(
        (out / "logs").glob(f"*/attempt_*/*/{stream}.log"),
        key=lambda f: (f.parent.parent.name, int(f.parent.name)),
    )
    return "".join(f.read_text(errors="replace") for f in files)


def _finish(cmd: list[str], env: dict[str, str], out: Path, timeout: float, cwd: Path | None = None) -> Run:
    """Run ``cmd`` in ``cwd`` (default ``out``) with :func:`accel.testing.run_tree`: past the deadline (or when processes outlive
    it) every process of the run prints its Python stacks before it is killed, and the result says so (exit -9)."""
    from accel.testing import RunLeftovers, RunTimeout, run_tree

    try:
        proc = run_tree(cmd, env=env, cwd=cwd or out, timeout=timeout)
    except (RunTimeout, RunLeftovers) as exc:
        stdout, stderr = _per_rank(out, "stdout"), _per_rank(out, "stderr")
        return Run(cmd, -9, stdout, f"{exc}\n{stderr}\n[timed out after {timeout} s]", out)
    stdout, stderr = proc.stdout + _per_rank(out, "stdout"), proc.stderr + _per_rank(out, "stderr")
    return Run(cmd, proc.returncode, stdout, stderr, out)


def run_accel(case: Case, out: Path, num_processes: int = 2) -> Run:
    """``accel launch -n 2 [flags] tests/compat/<script> [args]`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = _launch_command(num_processes, out / "logs", case.flags, [str(HERE / case.script), *case.args])
    return _finish(cmd, _env(out, case), out, case.timeout)


def _launch_command(
    num_processes: int, logs: Path, flags: Sequence[str], script: Sequence[str], port: int | None = None
) -> list[str]:
    return [
        ACCEL,
        "launch",
        "-n",
        str(num_processes),
        "--main_process_port",
        str(port or free_port()),
        "--log_dir",  # each process's output in its own files, not interleaved on one pipe (see _per_rank)
        str(logs),
        "--tee",
        "0",
        *flags,
        *script,
    ]


@dataclass(frozen=True)
class Planned:
    """What ``accel launch -n N [flags] several.py`` would do for one example, planned by accel's own launch code
    (``plan_launch`` and the strategy's ``accel_launch``, as ``--dry-run`` runs them, in this process): the strategy
    that starts it, the launcher command it would start (the same torchrun command whichever of ddp, fsdp or
    deepspeed starts it) and the variables its flags give the workers on top of the example's environment
    (``ACCEL_CONFIG``, and what a strategy hands over, such as DeepSpeed's accumulation from its config file)."""

    strategy: str
    launcher: str
    env: dict[str, str]


def plan(case: Case, out: Path, num_processes: int = 2, logs: Path = Path("logs"), port: int = 1) -> Planned:
    """:class:`Planned` for ``case`` run in ``out`` (relative paths in its flags are read from there) by a launch
    with ``--log_dir logs --main_process_port port``. Raises ``accel.UsageError`` where ``accel launch`` would
    refuse the flags."""
    from accel.commands.launch import plan_launch

    env = _env(out, case)
    argv = _launch_command(num_processes, logs, case.flags, ["--dry-run", str(HERE / "several.py")], port=port)
    printed = io.StringIO()
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(out), contextlib.redirect_stdout(printed):
        plugins, launch, _ = plan_launch(argv[2:], env)
        plugins.pm.hook.accel_launch(plan=launch)
    launcher = next(line for line in printed.getvalue().splitlines() if line.startswith("launcher: "))
    _, strategy, command = launcher.split(" ", 2)  # launcher: ddp (torchrun): python -m torch.distributed.run ...
    return Planned(strategy, command, {k: v for k, v in launch.env.items() if env.get(k) != v})


def run_several(items: Sequence[tuple[str, Case, Path]], out: Path, num_processes: int = 2) -> dict[str, Run]:
    """Several examples (``(name, case, its own working directory)``) one after another in the processes of one
    ``accel launch -n 2 [flags] several.py <plan>`` (see ``several.py``): one ``import torch``/transformers per
    process for all of them. Each gets its own :class:`Run` (its own output, record, files and exit code). When an
    example fails, the launch ends there and the examples after it are started again in a new launch, so one failure
    is that example's alone.

    Their flags may differ where ``accel launch`` would start them with the same launcher command (:func:`plan`):
    the launch takes the first example's flags, and each example gets the variables its own flags give the workers
    (``--mixed_precision bf16``, ``--plugin deepspeed --zero_stage 3``: ``ACCEL_CONFIG``), set by ``several.py`` for
    that example alone; a variable the launch's flags set and the example's do not is unset for it."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    remaining = list(items)
    for attempt in range(len(items)):
        if not remaining:
            break
        port, logs = free_port(), out / f"logs{attempt}"
        planned = {name: plan(case, item_out, num_processes, logs, port) for name, case, item_out in remaining}
        launchers = {p.launcher for p in planned.values()}
        if len(launchers) > 1:
            raise ValueError(f"run_several needs one launcher command, got {sorted(launchers)}")
        entries = []
        launched_env = planned[remaining[0][0]].env
        for name, case, item_out in remaining:
            item_out.mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in _env(item_out, case).items() if k.startswith("COMPAT_") or k == "ACCEL_HOME"}
            own: dict[str, str | None] = {k: None for k in launched_env}  # null: several.py unsets it
            own.update(planned[name].env)
            entries.append(
                {
                    "name": name,
                    "script": str(HERE / case.script),
                    "args": list(case.args),
                    "out": str(item_out),
                    "env": {**env, **case.env, **own},
                }
            )
        (out / f"plan{attempt}.json").write_text(json.dumps(entries, indent=1))
        # what every example's environment holds is there from the start (record/sitecustomize.py reads it then)
        common = {k: v for k, v in remaining[0][1].env.items() if all(c.env.get(k) == v for _, c, _ in remaining)}
        launch = Case(
            "several.py",
            flags=remaining[0][1].flags,
            env=common,
            timeout=sum(case.timeout for _, case, _ in remaining),
        )
        script = [str(HERE / "several.py"), str(out / f"plan{attempt}.json")]
        cmd = _launch_command(num_processes, logs, launch.flags, script, port=port)
        # started where the first example runs, where accel launch reads the relative paths of its flags
        launched = _finish(cmd, _env(out, launch), out, launch.timeout, cwd=remaining[0][2])
        done = 0
        for name, _, item_out in remaining:
            logs = item_out / "several"
            codes = [logs / f"rank{r}.exit" for r in range(num_processes)]
            stdout, stderr = (
                "".join(f.read_text(errors="replace") for f in sorted(logs.glob(f"rank*.{stream}")))
                if logs.exists()
                else ""
                for stream in ("stdout", "stderr")
            )
            if all(code.exists() for code in codes):
                returncode = max(int(code.read_text()) for code in codes)
                done += 1
                if done == len(remaining) and launched.returncode:  # the processes failed at exit, after the last
                    returncode = returncode or launched.returncode
                    stderr += f"\n--- the launch ({launched.returncode})\n{launched.stderr}"
                runs[name] = Run(cmd, returncode, stdout, stderr, item_out)
                if returncode:  # the processes ended after it: the next one never started
                    break
                continue
            if logs.exists() or not done:  # the launch ended in this example (or before the first one)
                runs[name] = Run(
                    cmd,
                    launched.returncode or 1,
                    stdout + launched.stdout,
                    f"{stderr}\n--- the launch, ended in {name} ({launched.returncode})\n{launched.stderr}",
                    item_out,
                )
                done += 1
            break
        remaining = remaining[done:]
    return runs


def accelerate_environment(flags: Sequence[str]) -> dict[str, str]:
    """The environment ``accelerate launch`` gives its workers for the accel launch flags the tests use."""
    env = {"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    flags = list(flags)
    i = 0
    while i < len(flags):
        flag, value = flags[i], flags[i + 1] if i + 1 < len(flags) else ""
        if flag == "--mixed_precision":
            env["ACCELERATE_MIXED_PRECISION"] = value
        elif flag == "--gradient_accumulation_steps":
            env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = value
        elif flag == "--plugin" and value == "deepspeed":
            env["ACCELERATE_USE_DEEPSPEED"] = "true"
            del env["ACCELERATE_USE_CPU"]  # with it Accelerate runs plain multi-CPU DDP and ignores DeepSpeed
        elif flag == "--plugin" and value == "fsdp":
            env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_CPU_RAM_EFFICIENT_LOADING="false")
        elif flag == "--zero_stage":
            env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = value
        elif flag == "--deepspeed_config_file":
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = value
        else:
            i += 1
            continue
        i += 2
    return env


def run_accelerate(case: Case, out: Path, python: str, num_processes: int = 2) -> Run:
    """The same port under Accelerate: torchrun of Accelerate's venv, Accelerate's launch variables, the accel
    names mapped back to Accelerate's by ``accelerate_shim``."""
    out.mkdir(parents=True, exist_ok=True)
    env = _env(out, case, extra_path=[SHIM])
    env.update(accelerate_environment(case.flags))
    cmd = [
        os.path.abspath(python),  # the run starts in `out`
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(num_processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--log-dir",
        str(out / "logs"),
        "--redirects",
        "3",
        str(HERE / case.script),
        *case.args,
    ]
    return _finish(cmd, env, out, case.timeout)


def accelerate_python() -> str | None:
    """A Python with Accelerate 1.15 (for the comparison), or None: ``ACCEL_COMPAT_ACCELERATE_PYTHON``, else the
    venv ``make compat-vs-accelerate`` builds (``.venv-compat-accelerate``), else ``.venv-acc``."""
    candidates = [
        os.environ.get("ACCEL_COMPAT_ACCELERATE_PYTHON", ""),
        str(ROOT / ".venv-compat-accelerate" / "bin" / "python"),
        str(ROOT / ".venv-acc" / "bin" / "python"),  # the smaller venv some set-ups build (torch, then accelerate)
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    return None
