"""`accel config`: the interactive questionnaire driven through a real pseudo-terminal, `config default`, `config
update`, `config show`, and Accelerate-written config files used unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from accel.testing.shadow import hide_plugins

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
ACCELERATE = FIXTURES / "accelerate_configs"
DOWN = "\x1b[B"  # arrow key down
CLEAR = "\x15"  # Ctrl-U: clear the pre-filled default of a text prompt


@pytest.fixture(scope="session")
def shadow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every published plugin but ddp hidden, so the questions are the same whatever else is installed."""
    return hide_plugins(tmp_path_factory.mktemp("shadow"), keep=("ddp",))


@pytest.fixture
def env(tmp_path: Path, shadow: Path) -> dict[str, str]:
    """A clean environment: ACCEL_HOME in a tmp dir, no ACCEL_* / ACCELERATE_* variables of the caller, only the
    kernel and the ddp plugin visible."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "MIXED_PRECISION"))}
    home = tmp_path / "home"
    home.mkdir()
    clean.update(ACCEL_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", COLUMNS="200", PYTHONPATH=str(shadow))
    return clean


@pytest.fixture(scope="session")
def backends_shadow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every published plugin hidden but ddp and the real accel-plugin-deepspeed and accel-plugin-dynamo (installed
    editable by `make setup`), whose `accel config` questions the DeepSpeed test answers."""
    return hide_plugins(tmp_path_factory.mktemp("shadow_backends"), keep=("ddp", "deepspeed", "dynamo"))


def accel(
    args: list[str], env: dict[str, str], stdin: int | None = subprocess.DEVNULL
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel.commands.cli", *args],
        env=env,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


class Terminal:
    """`accel config` on a pseudo-terminal: wait for a prompt, press keys."""

    def __init__(self, env: dict[str, str], args: list[str] = ()) -> None:
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "accel.commands.cli", "config", *args],
            env=env,
            encoding="utf-8",
            timeout=60,
            dimensions=(60, 220),
        )
        self.transcript: list[str] = []

    def answer(self, prompt: str, keys: str) -> str:
        """Wait for ``prompt`` (a regex), then type ``keys``. Returns what was shown before the prompt."""
        self.child.expect(prompt)
        shown = self.child.before + self.child.after
        self.transcript.append(shown)
        self.child.send(keys)
        return shown

    def menu(self, prompt: str, shows: str) -> str:
        """Wait for a menu and for ``shows`` (a regex) in it; return the menu as shown, without answering."""
        self.child.expect(prompt)
        shown = self.child.after
        self.child.expect(shows)
        return shown + self.child.before + self.child.after

    def finish(self) -> tuple[int, str]:
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus, self.child.before


def test_config_multi_cpu_through_a_terminal(env: dict[str, str], tmp_path: Path) -> None:
    term = Terminal(env)
    term.answer("Which type of machine are you using", DOWN + "\r")  # multi-CPU
    term.answer("How many different machines", "\r")  # 1
    term.answer("Should distributed operations be checked", "n")
    # DeepSpeed and FSDP run on the CPU too: offered (here with their install commands: only ddp is installed)
    strategy = term.menu("Which training strategy do you want to use", "not installed: pip install accel-plugin-fsdp")
    assert "data parallel" in strategy and "not installed: pip install accel-plugin-deepspeed" in strategy
    term.child.send("\r")
    dynamo = term.menu("optimize your script with torch dynamo", "pip install accel-plugin-dynamo")
    assert "needs a plugin" in dynamo  # no plugin provides compiling: the hint, not the choice
    term.child.send("\r")
    term.answer("How many processes should be used", CLEAR + "2\r")
    precision = term.menu("Do you wish to use mixed precision", r"fp8 \(needs a plugin: pip install accel-plugin-amp\)")
    assert "fp16 (needs a plugin: pip install accel-plugin-deepspeed or pip install accel-plugin-amp)" in precision
    term.child.send("\r")
    code, out = term.finish()
    assert code == 0, out
    path = Path(env["ACCEL_HOME"]) / "default_config.yaml"
    assert f"accel configuration saved at {path}" in out
    data = yaml.safe_load(path.read_text())
    assert data["distributed_type"] == "MULTI_CPU"
    assert data["num_processes"] == 2 and data["use_cpu"] is True and data["mixed_precision"] == "no"
    assert data["compute_environment"] == "LOCAL_MACHINE" and "dynamo_config" not in data
    # The file drives `accel launch`: two processes through the DDP plugin's torchrun.
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = accel(["launch", "--dry-run", str(script)], env)
    assert plan.returncode == 0, plan.stderr
    assert "--nproc_per_node=2" in plan.stdout and "ddp (strategy)" in plan.stdout


def test_config_multi_node_questions(env: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "node1.yaml"
    term = Terminal(env, ["--config_file", str(target)])
    term.answer("Which type of machine are you using", DOWN + "\r")  # multi-CPU
    term.answer("How many different machines", CLEAR + "2\r")
    term.answer("What is the rank of this machine", DOWN + "\r")  # 1
    term.answer("IP address of the machine that will host the main process", "10.0.0.7\r")
    term.answer("What is the port", CLEAR + "29555\r")
    term.answer("Are all the machines on the same local network", "n")
    term.answer("What rendezvous backend will you use", DOWN + "\r")  # c10d
    term.answer("Should distributed operations be checked", "y")
    term.answer("Which training strategy do you want to use", "\r")  # data parallel
    term.answer("optimize your script with torch dynamo", "\r")
    term.answer("How many processes should be used", "\r")  # default: 2 per machine x 2 machines
    term.answer("Do you wish to use mixed precision", "\r")
    code, out = term.finish()
    assert code == 0, out
    data = yaml.safe_load(target.read_text())
    assert (data["num_machines"], data["machine_rank"], data["main_process_ip"], data["main_process_port"]) == (
        2,
        1,
        "10.0.0.7",
        29555,
    )
    assert data["same_network"] is False and data["rdzv_backend"] == "c10d" and data["debug"] is True
    assert data["num_processes"] == 4
    assert not (Path(env["ACCEL_HOME"]) / "default_config.yaml").exists()


def test_config_multi_gpu_deepspeed_zero3_offload(env: dict[str, str], backends_shadow: Path) -> None:
    """The DeepSpeed and dynamo questions come from the real plugins through `accel_config_questions`."""
    env = dict(env, PYTHONPATH=str(backends_shadow))
    term = Terminal(env)
    machine = term.menu(
        "Which type of machine are you using", r"TPU \(XLA\) \(not installed: pip install accel-plugin-xla\)"
    )
    assert "multi-GPU" in machine
    term.child.send(DOWN * 2 + "\r")  # multi-GPU
    term.answer("How many different machines", "\r")
    term.answer("Should distributed operations be checked", "n")
    strategy = term.menu("Which training strategy do you want to use", "not installed: pip install accel-plugin-fsdp")
    assert "DeepSpeed (ZeRO" in strategy and "accel-plugin-deepspeed" not in strategy
    term.child.send(DOWN + "\r")  # DeepSpeed
    term.answer("specify a json file to a DeepSpeed config", "n")
    term.answer("ZeRO optimization stage", DOWN + "\r")  # 2 -> 3
    term.answer("Where to offload optimizer states", DOWN + "\r")  # cpu
    term.answer("Where to offload parameters", DOWN + "\r")  # cpu
    term.answer("How many gradient accumulation steps", CLEAR + "4\r")
    term.answer("Do you want to use gradient clipping", "y")
    term.answer("What is the gradient clipping value", CLEAR + "0.5\r")
    term.answer("save 16-bit model weights", "y")
    term.answer("deepspeed.zero.Init", "y")
    term.answer("optimize your script with torch dynamo", DOWN + "\r")  # yes (the dynamo plugin is installed)
    term.answer("Which dynamo backend", "\r")  # inductor
    term.answer("customize the defaults sent to torch.compile", "y")
    term.answer("Which mode do you want to use", DOWN + "\r")  # reduce-overhead
    term.answer("fullgraph mode", "y")
    term.answer("dynamic shape tracing", "n")
    term.answer("regional compilation", "y")
    term.answer("How many processes should be used", CLEAR + "4\r")
    term.answer(r"What GPU\(s\) \(by id\)", CLEAR + "0,1,2,3\r")
    term.answer("Do you wish to use mixed precision", "\r")
    code, out = term.finish()
    assert code == 0, out
    data = yaml.safe_load((Path(env["ACCEL_HOME"]) / "default_config.yaml").read_text())
    assert data["distributed_type"] == "DEEPSPEED"
    assert data["deepspeed_config"] == {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": True,
    }
    assert data["dynamo_config"] == {
        "dynamo_backend": "inductor",
        "dynamo_mode": "reduce-overhead",
        "dynamo_use_fullgraph": True,
        "dynamo_use_dynamic": False,
        "dynamo_use_regional_compilation": True,
    }
    assert data["num_processes"] == 4 and data["gpu_ids"] == "0,1,2,3" and data["use_cpu"] is False
    # The plugin's keys validate and show where they came from.
    shown = json.loads(accel(["config", "show", "--json"], env).stdout)["settings"]
    assert shown["zero_stage"]["value"] == 3 and shown["zero_stage"]["source"].startswith("file ")
    assert shown["zero_stage"]["key"] == "deepspeed_config.zero_stage"


def test_config_strategy_not_installed_shows_install_hint_and_ctrl_c_writes_nothing(env: dict[str, str]) -> None:
    term = Terminal(env)
    term.answer("Which type of machine are you using", DOWN * 2 + "\r")  # multi-GPU
    term.answer("How many different machines", "\r")
    term.answer("Should distributed operations be checked", "n")
    strategy = term.menu("Which training strategy do you want to use", "not installed: pip install accel-plugin-fsdp")
    assert "not installed: pip install accel-plugin-deepspeed" in strategy
    term.child.sendcontrol("c")
    code, out = term.finish()
    assert code == 130
    assert "cancelled; nothing was written" in out and "Traceback" not in out
    assert not (Path(env["ACCEL_HOME"]) / "default_config.yaml").exists()


def test_config_without_terminal_is_one_clear_line(env: dict[str, str]) -> None:
    result = accel(["config"], env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a terminal" in lines[0] and "accel config default" in lines[0]
    assert "EOFError" not in result.stderr and "Traceback" not in result.stderr
    assert not list(Path(env["ACCEL_HOME"]).iterdir())


def test_config_default_writes_for_cpu_and_refuses_to_overwrite(env: dict[str, str]) -> None:
    first = accel(["config", "default", "--mixed_precision", "bf16"], env)
    path = Path(env["ACCEL_HOME"]) / "default_config.yaml"
    assert first.returncode == 0, first.stderr
    assert f"saved at {path}" in first.stdout
    data = yaml.safe_load(path.read_text())
    assert (data["distributed_type"], data["num_processes"], data["use_cpu"], data["mixed_precision"]) == (
        "NO",
        1,
        True,
        "bf16",
    )
    assert "accel-plugin-amp" in first.stderr  # noted: bf16 needs a precision plugin
    before = path.read_text()
    again = accel(["config", "default"], env)
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    assert path.read_text() == before
    forced = accel(["config", "default", "--force"], env)
    assert forced.returncode == 0 and yaml.safe_load(path.read_text())["mixed_precision"] == "no"
    typo = accel(["config", "default", "--force", "--mixed_precision", "bf61"], env)
    assert typo.returncode == 2 and "did you mean `bf16`" in typo.stderr and "Traceback" not in typo.stderr


def test_config_default_location_follows_xdg_cache_home(env: dict[str, str], tmp_path: Path) -> None:
    env = dict(env, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    del env["ACCEL_HOME"]
    result = accel(["config", "default"], env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "xdg" / "accel" / "default_config.yaml").is_file()


def test_config_update_upgrades_legacy_accelerate_file(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_text((ACCELERATE / "legacy_fp16.yaml").read_text())
    result = accel(["config", "update", "--config_file", str(path)], env)
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(path.read_text())
    assert data["mixed_precision"] == "fp16" and "fp16" not in data
    assert data["dynamo_config"] == {"dynamo_backend": "no"} and "dynamo_backend" not in data
    assert "main_process_ip" not in data  # null meant "not set"
    assert data["distributed_type"] == "MULTI_GPU" and data["num_processes"] == 2  # values kept
    assert data["use_cpu"] is False and data["debug"] is False  # missing keys get their defaults
    assert "fp16: true" in result.stdout
    again = accel(["config", "update", "--config_file", str(path)], env)
    assert again.returncode == 0 and "already up to date" in again.stdout


def test_config_update_refuses_unknown_key_with_did_you_mean(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_procesess: 2\n")
    before = path.read_text()
    result = accel(["config", "update", "--config_file", str(path)], env)
    assert result.returncode == 2
    assert (
        str(path) in result.stderr
        and "`num_procesess`" in result.stderr
        and "did you mean `num_processes`" in result.stderr
    )
    assert path.read_text() == before


def test_config_show_reports_the_source_of_every_value(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 3\nmixed_precision: fp16\ngpu_ids: all\n")
    env = dict(env, ACCEL_MIXED_PRECISION="bf16")
    result = accel(["config", "show", "--json", "--config_file", str(path), "--num_machines", "1"], env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["settings"]
    assert shown["num_processes"]["value"] == 3 and shown["num_processes"]["source"] == f"file {path}"
    assert shown["mixed_precision"]["value"] == "bf16"
    assert shown["mixed_precision"]["source"] == "env ACCEL_MIXED_PRECISION"  # env beats the file
    assert shown["num_machines"]["source"] == "flag"
    assert shown["rdzv_backend"]["source"] == "default"
    assert shown["ddp_backend"]["plugin"] == "ddp"
    del env["ACCEL_MIXED_PRECISION"]
    accelerate_env = dict(env, ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_USE_CPU="true")
    shown = json.loads(accel(["config", "show", "--json", "--config_file", str(path)], accelerate_env).stdout)[
        "settings"
    ]
    assert shown["mixed_precision"]["source"] == "env ACCELERATE_MIXED_PRECISION"  # Accelerate's variables work
    assert shown["cpu"]["value"] is True and shown["cpu"]["source"] == "env ACCELERATE_USE_CPU"
    env["ACCEL_MIXED_PRECISION"] = "bf16"
    text = accel(["config", "show", "--config_file", str(path)], env)
    assert text.returncode == 0 and f"file {path}" in text.stdout and "env ACCEL_MIXED_PRECISION" in text.stdout


@pytest.mark.parametrize(
    "name",
    [
        "interactive_no_distributed.yaml",
        "default_cpu.yaml",
        "multi_cpu.yaml",
        "multi_node.yaml",
        "deepspeed_zero3.yaml",
    ],
)
def test_accelerate_written_configs_are_read_unchanged(env: dict[str, str], name: str) -> None:
    path = ACCELERATE / name
    result = accel(["config", "show", "--json", "--config_file", str(path)], env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    raw = yaml.safe_load(path.read_text())
    for key in ("distributed_type", "num_processes", "num_machines", "mixed_precision"):
        if key in raw:
            assert shown["settings"][key]["value"] == raw[key], key
            assert shown["settings"][key]["source"] == f"file {path}"
    if "deepspeed_config" in raw:  # the DeepSpeed plugin is not installed here: its keys are set aside, not errors
        assert "deepspeed_config" in " ".join(shown["ignored"])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("interactive_no_distributed.yaml", "launcher: accel (one process)"),
        ("default_cpu.yaml", "launcher: accel (one process)"),
        ("multi_cpu.yaml", "--nproc_per_node=2"),
        ("multi_node.yaml", "--nnodes=2 --nproc_per_node=4"),
    ],
)
def test_accelerate_written_configs_drive_launch(env: dict[str, str], tmp_path: Path, name: str, expected: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = accel(["launch", "--config_file", str(ACCELERATE / name), "--dry-run", str(script)], env)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_accelerate_deepspeed_config_without_plugin_says_what_to_install(env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = accel(["launch", "--config_file", str(ACCELERATE / "deepspeed_zero3.yaml"), "--dry-run", str(script)], env)
    assert result.returncode == 2
    assert "pip install accel-plugin-deepspeed" in result.stderr and "Traceback" not in result.stderr


def test_config_commands_do_not_import_torch(env: dict[str, str], tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from accel.commands.cli import main\n"
        f"assert main(['config', 'default', '--config_file', {str(tmp_path / 'c.yaml')!r}]) == 0\n"
        f"assert main(['config', 'show', '--config_file', {str(tmp_path / 'c.yaml')!r}]) == 0\n"
        f"assert main(['config', 'update', '--config_file', {str(tmp_path / 'c.yaml')!r}]) == 0\n"
        "import accel; accel.notebook_launcher\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
