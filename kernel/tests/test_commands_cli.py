"""accel.commands.cli and accel.commands.guard: the ``accel`` entry point. ``--help`` lists the command table,
``--version``, an unknown command is one line with a did-you-mean; every command of the table names a function that
exists; listing or rejecting a command imports neither torch nor a plugin; the guard turns accel's errors into one
line and exit 2, Ctrl-C into 130, a closed pipe into 141 without a word."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from accel.commands.cli import COMMANDS, main
from accel.commands.guard import run_guarded
from accel.errors import PluginError, UsageError
from accel.testing import isolated_env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``accel ARGS`` in a subprocess."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "accel"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def err_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return isolated_env(tmp_path / "home")


def test_top_level_help_and_version(env):
    result = run(["--help"], env)
    assert result.returncode == 0 and result.stderr == ""
    for command in ("launch", "plugins", "env"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), result
    version = run(["--version"], env)
    assert version.returncode == 0 and re.fullmatch(r"accel \d+\.\d+\.\d+\S*\n", version.stdout)


def test_unknown_command_is_one_line(env):
    result = run(["lauch"], env)
    assert result.returncode == 2 and err_lines(result) == [
        "accel: error: unknown command 'lauch'; did you mean `launch`? (see `accel --help`)"
    ]


def test_every_command_names_a_function_and_the_help_lists_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name, target, text in COMMANDS:
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(text)}$", usage, re.M), name
    assert main([]) == 0 and capsys.readouterr().out == usage


def test_listing_or_rejecting_a_command_imports_no_torch_and_no_plugin(tmp_path: Path) -> None:
    code = (
        "import sys\nbefore = set(sys.modules)  # what the interpreter's start-up (.pth files) loaded\n"
        "from accel.commands.cli import main\n"
        "codes = [main(['--help']), main(['--version']), main(['plugns'])]\n"
        "from importlib.metadata import entry_points\n"
        "plugins = {e.value.partition(':')[0].split('.')[0] for e in entry_points(group='accel')}\n"
        "new = set(sys.modules) - before\n"
        "loaded = sorted(m for m in new if m == 'torch' or m.split('.')[0] in plugins)\n"
        "print('RESULT', codes, loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "RESULT [0, 0, 2] []", out.stdout
    assert err_lines(out) == ["accel: error: unknown command 'plugns'; did you mean `plugins`? (see `accel --help`)"]


def fails(error: BaseException) -> int:
    raise error


@pytest.mark.parametrize(
    "error, code, line",
    [
        (UsageError("bad   value\n  on two lines"), 2, "accel: error: bad value on two lines"),
        (PluginError("plugin 'x' failed"), 2, "accel: error: plugin 'x' failed"),
        (KeyboardInterrupt(), 130, None),
    ],
)
def test_the_guard_turns_accels_errors_into_one_line(
    error: BaseException, code: int, line: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_guarded(lambda: fails(error)) == code
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == ([line] if line else [])


def test_the_guard_leaves_other_errors_alone() -> None:
    """A bug is not a user mistake: its traceback is shown (by Python), not reworded."""
    with pytest.raises(ZeroDivisionError):
        run_guarded(lambda: 1 // 0)
    assert run_guarded(lambda: 7) == 7


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``accel --help | head -1``: the reader leaves; exit 141 and nothing on stderr."""
    code = (
        "import sys\nfrom accel.commands.guard import run_guarded\n"
        "def spam():\n    while True:\n        print('x' * 1000, flush=True)\n"
        "sys.exit(run_guarded(spam))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=isolated_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""
