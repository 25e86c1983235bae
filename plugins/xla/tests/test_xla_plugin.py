"""accel-plugin-xla in the main environment (torch 2.13, where torch-xla cannot load): discovery without torch_xla,
the plugin listed as unavailable with the exact reason (for real: the torch-xla 2.9.0 wheel on PYTHONPATH gives the
undefined-symbol ImportError), activation, Accelerate's TPU config keys, and the exact launch commands (local
torch_xla.launch and TPU pods through gcloud). It runs in `make test` (pyproject.toml's testpaths
name it); training on the XLA device is tested in `.venv-xla` (`make test-xla`, the other modules here)."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import accel_xla
from accel import Settings, UsageError
from accel.commands.launch import plan_launch
from accel.options import resolve
from accel.plugins import Plugins
from accel.testing import imported_modules, isolated_env, run_tree
from accel_xla import launch as xla_launch
from accel_xla.availability import release

ROOT = Path(__file__).resolve().parents[3]
XLA_VERSION = "2.9.0"
SYMBOL = "undefined symbol: _ZN5torch8autograd10deleteNodeEPNS0_4NodeE"


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment for an ``accel`` subprocess (accel.testing.isolated_env): no accel, Accelerate or
    launcher variables, every config lookup place inside ``home``, and ``PYTHONPATH`` only what ``extra`` gives."""
    env = isolated_env(home / "accel_home", extra={"HOME": str(home / "user"), "PYTHONUNBUFFERED": "1", **extra})
    (home / "accel_home").mkdir(parents=True, exist_ok=True)
    env.pop("XDG_CACHE_HOME", None)
    env["PYTHONPATH"] = extra.get("PYTHONPATH", "")
    return env


def run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``accel ARGS``, waiting for every process it starts (accel.testing.run_tree)."""
    return run_tree([str(Path(sys.executable).parent / "accel"), *args], env=env, cwd=cwd, timeout=240)


def err_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def settings(
    phase: str = "run",
    env: dict[str, str] | None = None,
    config: dict | None = None,
    world_size: int = 1,
    **kwargs: object,
) -> Settings:
    options = Plugins.load(env={}).options()
    values, sources = resolve(options, kwargs=kwargs, config=config, env=env or {})
    return Settings(values, sources, world_size=world_size, phase=phase, env=env or {})


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch_xla loads (only the availability answer; the component is the real one)."""
    monkeypatch.setattr(accel_xla, "unavailable_reason", lambda: None)


@pytest.fixture(scope="session")
def broken_torch_xla() -> Path:
    """The real torch-xla 2.9.0 wheel, unpacked with `pip install --no-deps --target` into the repository's ignored
    .cache/ (kept between runs: an 80 MB download once). On PYTHONPATH next to torch 2.13 it cannot load."""
    target = ROOT / ".cache" / f"torch-xla-{XLA_VERSION}"
    if not (target / "torch_xla" / "__init__.py").is_file() or not list(target.glob("torch_xla-*.dist-info")):
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--disable-pip-version-check",
                "--target",
                str(tmp),
                f"torch-xla=={XLA_VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if target.exists():
            import shutil

            shutil.rmtree(target)
        os.replace(tmp, target)
    return target


def accel(args: list[str], tmp_path: Path, pythonpath: Path | None = None, cwd: Path | None = None, **env: str):
    """``accel ARGS`` in a subprocess, in ``tmp_path`` (which holds an empty ``train.py``)."""
    (tmp_path / "train.py").touch()
    extra = {"PYTHONPATH": str(pythonpath)} if pythonpath else {}
    return run(args, clean_env(tmp_path / "home", **extra, **env), cwd=cwd or tmp_path)


# ---- discovery ------------------------------------------------------------------------------------------------


def test_entry_point_module_and_components_do_not_import_torch() -> None:
    assert imported_modules("accel_xla", ["torch", "torch_xla"]) == []
    assert imported_modules("accel_xla.launch", ["torch", "torch_xla"]) == []


def test_listed_as_unavailable_without_torch_xla(tmp_path: Path) -> None:
    proc = accel(["plugins", "--json"], tmp_path)
    assert proc.returncode == 0, proc
    row = next(r for r in json.loads(proc.stdout) if r["name"] == "xla")
    assert row["distribution"] == "accel-plugin-xla" and row["status"] == "unavailable"
    assert row["reason"].startswith("torch_xla is not installed;"), row
    assert "pip install torch==2.9.0 torch-xla==2.9.0" in row["reason"]
    assert {
        "accel_activate",
        "accel_unavailable_reason",
        "accel_launch",
        "accel_setup",
        "accel_optimizer_step",
        "accel_prepare_dataloader",
        "accel_save_state",
        "accel_load_state",
    } <= set(row["hooks"])


@pytest.mark.slow
def test_installed_torch_xla_that_cannot_load_is_reported_not_crashed(tmp_path: Path, broken_torch_xla: Path) -> None:
    """torch-xla 2.9.0 next to torch 2.13: `accel plugins`/`accel env` show the undefined-symbol ImportError and the
    torch that fixes it, exit 0; using it is one clear line (exit 2 from the CLI, UsageError from Kernel)."""
    proc = accel(["plugins", "--json"], tmp_path, broken_torch_xla)
    assert proc.returncode == 0, proc
    row = next(r for r in json.loads(proc.stdout) if r["name"] == "xla")
    assert row["status"] == "unavailable", row
    assert row["reason"].startswith("torch_xla cannot be imported: ImportError: "), row
    assert f"_XLAC.cpython-311-x86_64-linux-gnu.so: {SYMBOL}" in row["reason"], row
    assert f"torch-xla {XLA_VERSION} is built for torch 2.9" in row["reason"]
    assert f"`pip install torch=={XLA_VERSION}`" in row["reason"]

    proc = accel(["env"], tmp_path, broken_torch_xla, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    assert proc.returncode == 0, proc
    line = next(x for x in proc.stdout.splitlines() if x.startswith("- `Plugin xla`"))
    assert "unavailable (torch_xla cannot be imported: ImportError:" in line and SYMBOL in line, line
    # An unavailable plugin is not asked for hardware: PJRT_DEVICE alone does not make an XLA device usable here.
    assert "Devices reported by xla" not in proc.stdout and "- `Devices (used)`: xla" not in proc.stdout

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = accel(["launch", "--plugin", "xla", str(script)], tmp_path, broken_torch_xla)
    assert proc.returncode == 2, proc
    assert len(err_lines(proc)) == 1 and "Traceback" not in proc.stderr, proc
    assert err_lines(proc)[0].startswith("accel: error: plugin 'xla': torch_xla cannot be imported: ImportError:")
    assert SYMBOL in proc.stderr and f"pip install torch=={XLA_VERSION}" in proc.stderr

    code = (
        "from accel import Kernel, UsageError\n"
        "try:\n    Kernel(plugins=['xla'])\nexcept UsageError as exc:\n    print('UsageError:', exc)\n"
    )
    env = clean_env(tmp_path / "home", PYTHONPATH=str(broken_torch_xla))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UsageError: plugin 'xla': torch_xla cannot be imported:") and SYMBOL in out.stdout


def test_detect_hardware_reads_pjrt_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert accel_xla.accel_detect_hardware({"PJRT_DEVICE": "CPU"}) is None  # torch_xla is not installed here
    monkeypatch.setattr(accel_xla.importlib.util, "find_spec", lambda name: object() if name == "torch_xla" else None)
    assert accel_xla.accel_detect_hardware({}) is None
    assert accel_xla.accel_detect_hardware({"PJRT_DEVICE": "IPU"}) is None
    cpu = accel_xla.accel_detect_hardware({"PJRT_DEVICE": "cpu", "CPU_NUM_DEVICES": "3"})
    assert (cpu.name, cpu.device_count, cpu.priority, dict(cpu.details)) == ("xla", 3, 20, {"PJRT_DEVICE": "CPU"})
    gpu = accel_xla.accel_detect_hardware({"PJRT_DEVICE": "GPU", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert (gpu.device_count, gpu.details["PJRT_DEVICE"]) == (2, "CUDA")
    assert accel_xla.accel_detect_hardware({"PJRT_DEVICE": "TPU"}).device_count >= 1


def test_release_matching() -> None:
    assert release("2.9.0+cu128") == release("2.9.1") == "2.9" != release("2.13.0+cpu")


# ---- activation -----------------------------------------------------------------------------------------------


def test_activation_when_selected_or_pjrt_device(available: None) -> None:
    from accel_xla.strategy import XLAStrategy

    assert accel_xla.accel_activate(settings()) is None
    for chosen in (
        settings(plugins=["xla"]),
        settings(config={"distributed_type": "XLA"}),
        settings(config={"distributed_type": "TPU"}),
        settings(env={"PJRT_DEVICE": "TPU"}),
    ):
        comp = accel_xla.accel_activate(chosen)
        assert isinstance(comp, XLAStrategy) and comp.role == "strategy"
        assert {"distributed", "precision:bf16"} <= comp.provides


def test_unavailable_refuses_when_selected_and_stays_out_otherwise() -> None:
    with pytest.raises(
        UsageError, match=r"^torch_xla is not installed; .*pip install torch==2\.9\.0 torch-xla==2\.9\.0"
    ):
        accel_xla.accel_activate(settings(plugins=["xla"]))
    with pytest.raises(UsageError, match="torch_xla is not installed"):
        accel_xla.accel_activate(settings(config={"distributed_type": "XLA"}))
    assert accel_xla.accel_activate(settings(env={"PJRT_DEVICE": "CPU"})) is None  # PJRT_DEVICE alone: no failure
    pod = settings(phase="launch", plugins=["xla"], tpu_use_cluster=True, tpu_name="pod")
    assert accel_xla.accel_activate(pod) is not None  # a pod launch only runs gcloud here


def test_selected_xla_wins_the_strategy_role_over_ddp(available: None) -> None:
    plugins = Plugins.load(env={})
    found = plugins.activate(
        settings(phase="launch", world_size=8, config={"distributed_type": "XLA", "num_processes": 8})
    )
    assert [c.name for c in found if c.role == "strategy"] == ["xla"]


def test_precision_checks(available: None) -> None:
    with pytest.raises(UsageError, match="mixed_precision=fp16 is not supported on XLA"):
        accel_xla.accel_activate(settings(plugins=["xla"], mixed_precision="fp16"))
    with pytest.raises(UsageError, match="downcast_bf16 .* needs --mixed_precision bf16"):
        accel_xla.accel_activate(settings(plugins=["xla"], downcast_bf16=True))
    assert accel_xla.accel_activate(settings(plugins=["xla"], mixed_precision="bf16", downcast_bf16=True))


def test_config_questions() -> None:
    assert accel_xla.accel_config_questions({"distributed_type": "MULTI_GPU"}) is None
    keys = [q.key for q in accel_xla.accel_config_questions({"distributed_type": "XLA"})]
    assert keys == ["main_training_function", "tpu_use_cluster"]
    keys = [
        q.key
        for q in accel_xla.accel_config_questions(
            {"distributed_type": "XLA", "tpu_use_cluster": True, "mixed_precision": "bf16"}
        )
    ]
    assert keys == [
        "main_training_function",
        "tpu_use_cluster",
        "tpu_name",
        "tpu_zone",
        "tpu_use_sudo",
        "downcast_bf16",
    ]
    options = Plugins.load(env={}).options()
    assert {
        q.key
        for q in accel_xla.accel_config_questions(
            {"distributed_type": "XLA", "tpu_use_cluster": True, "mixed_precision": "bf16"}
        )
    } <= {o.name for o in options}


# ---- launch commands ------------------------------------------------------------------------------------------


def _launcher_line(stdout: str) -> str:
    return next(x for x in stdout.splitlines() if x.startswith("launcher: "))


def _dry_run_in_process(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(the launcher line, stderr) of ``accel launch --dry-run ARGV``, run in this process."""
    env = {"ACCEL_HOME": str(tmp_path / "home"), "PATH": os.environ.get("PATH", "")}
    plugins, plan, _ = plan_launch(["--dry-run", *argv], env)
    assert plugins.pm.hook.accel_launch(plan=plan) == 0
    out = capsys.readouterr()
    return _launcher_line(out.out), out.err


def test_local_launch_command(tmp_path: Path, available: None, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    head = "launcher: xla (torch_xla.launch, one process per local XLA device): "
    line, err = _dry_run_in_process(["--plugin", "xla", str(script), "--lr", "1"], tmp_path, capsys)
    assert line == head + shlex.join([sys.executable, "-m", "accel_xla.spawn", str(script), "--lr", "1"])
    assert err == ""
    line, err = _dry_run_in_process(
        ["--plugin", "xla", "-n", "1", "--main_training_function", "train", str(script)], tmp_path, capsys
    )
    assert line == head + shlex.join(
        [sys.executable, "-m", "accel_xla.spawn", "--single_process", "--main_training_function", "train", str(script)]
    )
    line, err = _dry_run_in_process(["--plugin", "xla", "-m", "pkg.train", "x"], tmp_path, capsys)
    assert line == head + shlex.join([sys.executable, "-m", "accel_xla.spawn", "-m", "pkg.train", "x"])
    line, err = _dry_run_in_process(["--plugin", "xla", "-n", "4", str(script)], tmp_path, capsys)
    assert line == head + shlex.join([sys.executable, "-m", "accel_xla.spawn", str(script)])
    assert "num_processes=4 is not passed on: torch_xla.launch starts one process per local XLA device" in err
    with pytest.raises(UsageError, match="--no_python cannot be used with the xla plugin"):
        _dry_run_in_process(["--plugin", "xla", "--no_python", "/bin/true"], tmp_path, capsys)


def _pod_parts(stdout: str, name: str) -> tuple[list[str], list[str], list[str], dict]:
    """(gcloud command up to --command, the remote steps, the worker command, its ACCEL_CONFIG)."""
    prefix = f"launcher: xla (TPU pod {name}, every worker through gcloud): "
    line = _launcher_line(stdout)
    assert line.startswith(prefix), line
    cmd = shlex.split(line[len(prefix) :])
    assert cmd[-2] == "--command"
    steps = cmd[-1].split(" && ")
    worker = shlex.split(steps[-1])
    config = next(w for w in worker if w.startswith("ACCEL_CONFIG="))
    assert config.startswith("ACCEL_CONFIG=base64:")
    handed = json.loads(base64.b64decode(config.split(":", 1)[1]))
    return cmd[:-2], steps[:-1], [w for w in worker if not w.startswith("ACCEL_CONFIG=")], handed


def test_tpu_pod_command_from_flags(tmp_path: Path) -> None:
    """No torch_xla is needed here for a pod launch: gcloud starts the run on every worker."""
    proc = accel(
        [
            "launch",
            "--plugin",
            "xla",
            "--tpu_cluster",
            "--tpu_name",
            "my-pod",
            "--tpu_zone",
            "us-central2-b",
            "--tpu_use_sudo",
            "--env",
            "XLA_FLAGS=--xla_dump_to=/tmp/d",
            "--env",
            "B=2",
            "--command",
            "pip install -e .",
            "--mixed_precision",
            "bf16",
            "--dry-run",
            "train.py",
            "--epochs",
            "2",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc
    gcloud, startup, worker, handed = _pod_parts(proc.stdout, "my-pod")
    assert gcloud == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "my-pod",
        "--zone",
        "us-central2-b",
        "--worker",
        "all",
    ]
    assert startup == [f"cd {tmp_path}", "pip install -e ."]
    assert worker == [
        "sudo",
        "env",
        "PJRT_DEVICE=TPU",
        "XLA_FLAGS=--xla_dump_to=/tmp/d",
        "B=2",
        "python3",
        "-m",
        "accel_xla.spawn",
        "train.py",
        "--epochs",
        "2",
    ]
    assert handed == {"mixed_precision": "bf16", "plugins": ["xla"]}
    assert "xla (strategy)" in proc.stdout

    proc = accel(
        [
            "launch",
            "--plugin",
            "xla",
            "--tpu_cluster",
            "--tpu_name",
            "p2",
            "--use_alpha",
            "--dry-run",
            "-m",
            "pkg.train",
        ],
        tmp_path,
        ACCEL_DISABLE_PLUGINS="wandb",
    )
    assert proc.returncode == 0, proc
    gcloud, startup, worker, handed = _pod_parts(proc.stdout, "p2")
    assert gcloud == ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "ssh", "p2", "--worker", "all"]
    assert worker == [
        "env",
        "PJRT_DEVICE=TPU",
        "ACCEL_DISABLE_PLUGINS=wandb",
        "python3",
        "-m",
        "accel_xla.spawn",
        "-m",
        "pkg.train",
    ]


def test_tpu_pod_command_from_an_accelerate_config(tmp_path: Path) -> None:
    (tmp_path / "setup.sh").write_text("# run on every worker\npip install -r requirements.txt\n\nexport X=1\n")
    config = tmp_path / "tpu.yaml"
    config.write_text(
        textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: XLA
        downcast_bf16: 'no'
        machine_rank: 0
        main_training_function: main
        mixed_precision: bf16
        num_machines: 1
        num_processes: 8
        rdzv_backend: static
        same_network: true
        tpu_env: [TPU_LOG=1]
        tpu_name: accel-pod
        tpu_zone: europe-west4-a
        tpu_use_cluster: true
        tpu_use_sudo: false
        tpu_vm: []
        command_file: setup.sh
        use_cpu: false
        """)
    )
    proc = accel(["launch", "--config_file", str(config), "--dry-run", "train.py"], tmp_path)
    assert proc.returncode == 0, proc
    gcloud, startup, worker, handed = _pod_parts(proc.stdout, "accel-pod")
    assert gcloud == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "accel-pod",
        "--zone",
        "europe-west4-a",
        "--worker",
        "all",
    ]
    assert startup == [f"cd {tmp_path}", "pip install -r requirements.txt", "export X=1"]
    assert worker == [
        "env",
        "PJRT_DEVICE=TPU",
        "TPU_LOG=1",
        "python3",
        "-m",
        "accel_xla.spawn",
        "--main_training_function",
        "main",
        "train.py",
    ]
    assert handed["distributed_type"] == "XLA" and handed["mixed_precision"] == "bf16"
    assert handed["num_processes"] == 8 and handed["downcast_bf16"] is False
    assert not [k for k in handed if k.startswith("tpu_") or k in ("command_file", "commands")]
    assert "downcast_bf16 = False (file)" in proc.stdout and "tpu_use_cluster = True (file)" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tpu_cluster"], "a TPU pod launch (tpu_use_cluster) needs --tpu_name"),
        (["--tpu_cluster", "--tpu_name", "p", "--vm", "v1"], "tpu_vm (legacy TPU-node VM names) is not supported"),
        (["--tpu_cluster", "--tpu_name", "p", "--env", "NOEQUALS"], "tpu_env entries are NAME=VALUE, got 'NOEQUALS'"),
        (
            ["--tpu_cluster", "--tpu_name", "p", "--command_file", "missing.sh"],
            "command_file 'missing.sh' cannot be read",
        ),
        (["--tpu_cluster", "--tpu_name", "p", "--downcast_bf16"], "downcast_bf16 stores the parameters in bf16"),
        (["--tpu_cluster", "--tpu_name", "p", "--mixed_precision", "fp16"], "mixed_precision=fp16 is not supported"),
    ],
)
def test_bad_launch_options_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = accel(["launch", "--plugin", "xla", *args, "--dry-run", "train.py"], tmp_path)
    assert proc.returncode == 2, proc
    assert len(err_lines(proc)) == 1 and message in err_lines(proc)[0], proc


@pytest.mark.parametrize(
    "given, message",
    [
        (
            {"num_processes": 2, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.1.2.3"},
            "does not carry out num_machines=2, machine_rank=1, main_process_ip='10.1.2.3' (torch_xla.launch",
        ),
        ({"max_restarts": 2}, "the xla plugin does not carry out max_restarts=2 (torch_xla.launch"),
        ({"log_dir": "logs", "tee": "3"}, "the xla plugin does not carry out tee='3', log_dir='logs' (torch"),
        (
            {"num_cpu_threads_per_process": 3, "main_process_port": 29517},
            "does not carry out num_cpu_threads_per_process=3, main_process_port=29517 (torch_xla.launch",
        ),
    ],
)
def test_launch_settings_it_cannot_carry_out_are_refused(available: None, given: dict, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        xla_launch.plan(settings(phase="launch", plugins=["xla"], **given))
    assert not xla_launch.plan(settings(phase="launch", plugins=["xla"])).pod  # the defaults ask for nothing


def test_pod_only_options_need_the_pod(available: None) -> None:
    with pytest.raises(UsageError, match=r"--tpu_zone only applies to a TPU pod launch; add --tpu_cluster"):
        xla_launch.plan(settings(phase="launch", plugins=["xla"], tpu_zone="z"))
    spec = xla_launch.plan(settings(phase="launch", plugins=["xla"], config={"tpu_zone": "z"}))  # a file may have it
    assert not spec.pod


def test_config_file_values_are_checked(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("distributed_type: XLA\ntpu_use_sudo: maybe\n")
    proc = accel(["launch", "--config_file", str(config), "--dry-run", "train.py"], tmp_path)
    assert proc.returncode == 2 and "`tpu_use_sudo` expects true or false, got 'maybe'" in proc.stderr, proc
