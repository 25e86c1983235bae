"""Fault injection: hostile or broken files and silent long work in the CLI: ``accel config`` with a
place it cannot write, a huge config file, an absurd ``--num_processes``, ``accel estimate-memory``'s defaults and
its slow builds, and a stale DeepSpeed build lock. Each case is one line and a non-zero exit code, or a line that
says what long work is being done. Real processes, real files; no mock."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from clitools import ACCEL, run

from accel import UsageError
from accel.config_files import read_config_file


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    clean.update(ACCEL_HOME=str(tmp_path / "home"), COLUMNS="200")
    return clean


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.strip()]


# ---- accel config --------------------------------------------------------------------------------------------------


def test_config_default_where_the_temporary_file_cannot_be_removed_is_one_line(env: dict[str, str]) -> None:
    # the temporary file's name is taken by a directory: writing it fails and so does removing it (EISDIR), as on a
    # read-only file system; before: a traceback from the clean-up inside `except OSError`
    home = Path(env["ACCEL_HOME"])
    home.mkdir()
    (home / "default_config.yaml").write_text("mixed_precision: bf16\n")
    (home / "default_config.yaml.tmp").mkdir()
    result = run(["config", "default", "--force"], env)
    lines = _error_lines(result.stderr)
    assert result.returncode == 2 and len(lines) == 1, result
    assert lines[0].startswith(f"accel: error: cannot write the config file {home / 'default_config.yaml'}: ")
    assert "set ACCEL_HOME to a writable directory" in lines[0]
    assert (home / "default_config.yaml").read_text() == "mixed_precision: bf16\n"  # nothing lost


def test_config_default_on_a_read_only_file_system_is_one_line(env: dict[str, str], tmp_path: Path) -> None:
    home = Path(env["ACCEL_HOME"])
    home.mkdir()
    (home / "default_config.yaml").write_text("mixed_precision: bf16\n")
    unshare = shutil.which("unshare")
    script = f'mount --bind "{home}" "{home}" && mount -o remount,ro,bind "{home}" && exec "$@"'
    probe = subprocess.run([unshare or "unshare", "-m", "sh", "-c", script, "sh", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only folder here (needs unshare -m as root): {probe.stderr[-200:]!r}")
    cmd = [unshare, "-m", "sh", "-c", script, "sh", ACCEL, "config", "default", "--force"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Read-only file system" in lines[0] and "set ACCEL_HOME to a writable directory" in lines[0]
    assert (home / "default_config.yaml").read_text() == "mixed_precision: bf16\n"


def test_a_large_config_file_loads_with_the_c_loader_and_stays_safe(tmp_path: Path) -> None:
    assert yaml.__with_libyaml__  # PyYAML's wheels carry libyaml: the C loader is there to use
    lines = ["distributed_type: NO", "extra:"]
    lines += [f"  key_{i}: [value_{i}, {i}, {i * 0.5}, true, 'text {i}']" for i in range(10_000)]  # ~0.5 MB
    big = tmp_path / "big.yaml"
    big.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    data = read_config_file(big)
    took = time.perf_counter() - start
    print(f"{big.stat().st_size / 2**20:.1f} MiB config read in {took:.2f} s")
    assert len(data["extra"]) == 10_000 and data["extra"]["key_7"] == ["value_7", 7, 3.5, True, "text 7"]
    evil = tmp_path / "evil.yaml"
    evil.write_text("x: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UsageError, match="cannot be parsed|malformed YAML"):
        read_config_file(evil)


def test_a_config_file_of_tens_of_megabytes_is_refused_at_once(tmp_path: Path) -> None:
    """50 MB of YAML takes minutes to parse even with libyaml: such a file is not a config (a data or log file passed
    by mistake), and is refused in one line before it is read."""
    huge = tmp_path / "default_config.yaml"
    with huge.open("wb") as fh:
        fh.truncate(50 * 2**20)
    with pytest.raises(UsageError) as caught:
        read_config_file(huge)
    assert str(caught.value) == (
        f"config file {huge} is 50.0 MiB; an accel or Accelerate config is a few KiB (at most 4 MiB is read): "
        "is this the right file? pass another --config_file"
    )


def test_an_absurd_num_processes_is_refused_in_the_dry_run(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    result = run(["launch", "--dry-run", "--num_processes", "100000000000000000000", "train.py"], env, cwd=tmp_path)
    lines = _error_lines(result.stderr)
    assert result.returncode == 2 and lines == [
        "accel: error: `--num_processes` must be at most 262144, got '100000000000000000000'"
    ], result


# ---- accel estimate-memory -----------------------------------------------------------------------------------------


def test_estimate_memory_defaults_to_this_machines_devices_and_a_slow_build_speaks(
    env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "slow_model.py").write_text(
        "import time\nfrom torch import nn\n\n\ndef net():\n    time.sleep(3)\n    return nn.Linear(1024, 64)\n"
    )
    result = run(["estimate-memory", "slow_model:net", "--dtypes", "fp32"], env, cwd=tmp_path)
    assert result.returncode == 0, result
    import torch

    if torch.accelerator.is_available():
        pytest.skip("the default -n is the accelerator count here; the CPU case is what this checks")
    assert "65.60 thousand parameters" in result.stdout  # a count in words: M/G in the table are MiB/GiB
    assert (
        "Memory per process for 1 process(es) (-n not given: 1, this machine has no accelerator; pass -n N for "
        "another count)" in result.stdout
    )
    lines = _error_lines(result.stderr)
    assert lines[0].startswith("accel estimate-memory: building net() on the meta device (can take a while"), lines
    assert lines[1].startswith("accel estimate-memory: building net() on the meta device: done in "), lines
    quick = run(["estimate-memory", "slow_model:net", "-n", "2", "--dtypes", "fp32", "--json"], env, cwd=tmp_path)
    assert quick.returncode == 0 and '"num_processes": 2' in quick.stdout, quick


# ---- DeepSpeed's op build --------------------------------------------------------------------------------------------

SCRIPT = "from accel import Kernel\n\nkernel = Kernel()\nprint('ready', kernel.process_index, flush=True)\nkernel.end_training()\n"


def test_a_stale_deepspeed_build_lock_is_named_with_the_fix_before_launching(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from clitools import deepspeed_env

    extensions = tmp_path / "extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # what an interrupted build leaves; before: every later launch slept forever, silently
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(deepspeed_env(tmp_path), TORCH_EXTENSIONS_DIR=str(extensions))
    start = time.monotonic()
    result = run(
        ["launch", "-q", "--plugin", "deepspeed", "--cpu", "-n", "2", "train.py"], env, cwd=tmp_path, timeout=120
    )
    lines = _error_lines(result.stderr)
    assert result.returncode == 2 and lines == [
        f"accel: error: {lock} is the lock of an interrupted build of the deepspeed_shm_comm op (no build is "
        f"running): DeepSpeed would wait for it forever; remove it (rm {lock}) and launch again"
    ], result
    assert time.monotonic() - start < 60 and "ready" not in result.stdout


def test_a_build_lock_held_by_a_running_build_is_not_stale(tmp_path: Path) -> None:
    from accel_deepspeed.ops import stale_locks

    folder = tmp_path / "py311_cpu" / "cpu_adam"
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert stale_locks(env) == [folder / "lock"]
    build = subprocess.Popen(["sleep", "60"], cwd=folder)  # a build's ninja works in the op's folder
    try:
        assert stale_locks(env) == []
    finally:
        build.kill()
        build.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_first_deepspeed_run_says_it_builds_the_op_and_shows_the_build(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from clitools import EXTENSIONS, deepspeed_env

    (tmp_path / "train.py").write_text(SCRIPT)
    fresh = tmp_path / "fresh_extensions"
    # A first run in a folder without the built op. The suite's own build of it (EXTENSIONS, made by the DeepSpeed
    # tests) lends its object files when it has them: the op is then linked, not compiled again (60-70 CPU s), and
    # the run goes through the same first-run path (no op library: the line, the build with its output shown).
    built = Path(EXTENSIONS) / "deepspeed_shm_comm"
    if (built / "shm.o").is_file() and (built / "shm_interface.o").is_file():
        shutil.copytree(built, fresh / built.name, ignore=shutil.ignore_patterns("*.so", "lock"))
    env = dict(deepspeed_env(tmp_path), TORCH_EXTENSIONS_DIR=str(fresh))
    result = run(
        ["launch", "-q", "--plugin", "deepspeed", "--cpu", "-n", "2", "train.py"], env, cwd=tmp_path, timeout=840
    )
    print(result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("accel: building DeepSpeed's")]
    assert len(said) == 1 and "deepspeed_shm_comm op (first run only" in said[0], result.stderr[-3000:]
    assert "c++ " in result.stdout, result.stdout[-3000:]  # the build's own output (ninja -v's commands)
    assert sorted(re.findall(r"ready \d", result.stdout)) == ["ready 0", "ready 1"], result.stdout[-3000:]
