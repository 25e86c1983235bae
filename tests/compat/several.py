"""Run several ported examples one after another in the processes of one ``accel launch`` (``harness.run_several``):
every process pays ``import torch``/transformers/datasets once for all of them instead of once per example.

``python several.py <plan.json>``: the plan is a list of ``{"name", "script", "args", "out", "env"}``. For each
entry, in order, each process changes into ``out``, sets ``env`` (the example's ``COMPAT_*`` sizes and what its own
launch flags give the workers, ``ACCEL_CONFIG`` among them; ``null`` unsets a variable), ``sys.argv``
and its own stdout/stderr files (``out/several/rank<R>.stdout``/``.stderr``, file descriptors 1 and 2, so what
libraries and child processes write lands there too), starts a fresh record (``record/sitecustomize.py``), runs the
script as ``__main__`` and writes its exit code to ``out/several/rank<R>.exit``. The example is Accelerate's code,
unchanged: each one builds its own ``Kernel``, as it does in a process of its own.

An example that fails ends the process at once (exit 1) rather than going on to the next: the other process may be
waiting in a collective of the failed one. ``harness.run_several`` then starts the remaining examples again.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import sitecustomize  # record/sitecustomize.py, on PYTHONPATH


def run_one(entry: dict, rank: str) -> int:
    out = Path(entry["out"])
    logs = out / "several"
    logs.mkdir(parents=True, exist_ok=True)
    saved_env = dict(os.environ)
    saved_fds = os.dup(1), os.dup(2)
    os.chdir(out)
    for key, value in entry["env"].items():  # null: a variable the launch's flags set and this example's do not
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.argv = [entry["script"], *entry["args"]]
    saved_path = list(sys.path)
    sys.path[0] = os.path.dirname(entry["script"])  # as `python <script>` has it
    sitecustomize.start(entry["env"]["COMPAT_RECORD"])
    code = 0
    with open(logs / f"rank{rank}.stdout", "w") as stdout, open(logs / f"rank{rank}.stderr", "w") as stderr:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        try:
            runpy.run_path(entry["script"], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
    for fd in saved_fds:
        os.close(fd)
    sys.path[:] = saved_path
    sitecustomize.flush()
    os.environ.clear()
    os.environ.update(saved_env)
    (logs / f"rank{rank}.exit").write_text(str(code))
    gc.collect()
    return code


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    rank = os.environ.get("RANK", "0")
    for entry in plan:  # each example's Kernel starts a group of its own (accel.spi.restart_store_args keys it apart)
        code = run_one(entry, rank)
        if code:
            print(f"several.py: {entry['name']} exited {code} on process {rank}", file=sys.stderr)
            os._exit(code)


if __name__ == "__main__":
    main()
