"""DeepSpeed's just-in-time built ops: say so before the first (minutes-long) build, show its output, and find a
stale build lock before launching.

torch builds an extension in ``<extensions root>/<op name>`` and holds ``<that folder>/lock`` while it does; a
build that was interrupted leaves the lock behind, and every later build of that op then waits for it forever
without a word. While a build really runs, ``ninja`` (and the compiler) run with that folder as their working
directory, so a lock with no process working in its folder is a stale one.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from accel.spi import UsageError

#: The op DeepSpeed builds for every run on the CPU (its shared-memory collectives) and how long it takes.
SHM_OP = "ShareMemCommBuilder"
BUILD_TIME = "~2-4 min on 2 cores"
#: How long the other processes of the machine wait for the main one to start the build (it takes the lock first).
LOCK_WAIT_S = 60.0
#: A lock younger than this is looked at again a moment later before it is called stale.
FRESH_S = 10.0


def extensions_root(env: Mapping[str, str]) -> Path:
    """Where torch builds extensions: ``$TORCH_EXTENSIONS_DIR``, else its per-user cache folder."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    cache = (
        Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path(env.get("HOME", "~")).expanduser() / ".cache"
    )
    return cache / "torch_extensions"


def _working_in(folder: Path) -> list[int]:
    """Processes of this machine whose working directory is ``folder`` (a build's ninja and compilers)."""
    pids = []
    target = os.path.realpath(folder)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.path.realpath(os.readlink(entry / "cwd")) == target:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def stale_locks(env: Mapping[str, str]) -> list[Path]:
    """Build locks under the extensions root (``<root>/<op>/lock``, or one level deeper for torch's default
    ``py311_cpu``-style folders) that no running build holds."""
    root = extensions_root(env)
    if not root.is_dir() or not Path("/proc/self/cwd").exists():  # no /proc: liveness cannot be told; say nothing
        return []
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    stale = [lock for lock in locks if lock.is_file() and not _working_in(lock.parent)]
    if any(time.time() - _mtime(lock) < FRESH_S for lock in stale):
        # a build that has just taken its lock starts ninja within a moment (and a finished one removes it)
        time.sleep(FRESH_S / 5)
        stale = [lock for lock in stale if lock.is_file() and not _working_in(lock.parent)]
    return sorted(stale)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def check_build_locks(env: Mapping[str, str]) -> None:
    """Before launching: a stale build lock would make DeepSpeed's op build wait forever; name it and the fix."""
    stale = stale_locks(env)
    if stale:
        lock = stale[0]
        raise UsageError(
            f"{lock} is the lock of an interrupted build of the {lock.parent.name} op (no build is running): "
            f"DeepSpeed would wait for it forever; remove it (rm {lock}) and launch again"
            + (f" ({len(stale) - 1} more stale lock(s) there)" if len(stale) > 1 else "")
        )


def announce_build(local_rank: int) -> None:
    """On the main process of this machine, before DeepSpeed initialises its communication: when its shared-memory
    op is not built yet, say so in one line and build it with its output shown (DeepSpeed builds it silently)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: where torch builds an extension
    except ImportError:  # another torch: DeepSpeed still builds the op, only without this line
        return

    builder = get_accelerator().create_op_builder(SHM_OP)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    if installed_ops.get(builder.name, False):
        return
    folder = Path(_get_build_directory(builder.name, verbose=False))
    built = folder / f"{builder.name}.so"
    if built.is_file():
        return
    if local_rank != 0:
        # let the main process take the build lock first (its build is the one shown); DeepSpeed's own load here
        # then waits for it. Bounded: a main process that fails before building does not hold this one up.
        deadline = time.monotonic() + LOCK_WAIT_S
        while not (folder / "lock").exists() and not built.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    print(
        f"accel: building DeepSpeed's {builder.name} op (first run only, {BUILD_TIME}) in {folder}; its build "
        "output follows",
        file=sys.stderr,
        flush=True,
    )
    builder.load(verbose=True)  # DeepSpeed's own later load finds it built
