"""``python -m accel_xla.spawn [--single_process] [--main_training_function NAME] [-m] script [args...]``

Runs a training script in one process per local XLA device through ``torch_xla.launch`` (what ``accel launch``
starts for the xla plugin, here and on each worker of a TPU pod). Each process runs the script as ``__main__`` with
``sys.argv = [script, *args]``; with ``--main_training_function NAME`` (Accelerate's ``main_training_function``,
when set explicitly) it loads the script and calls ``NAME()`` instead. The run's settings reach ``Kernel()`` through
``ACCEL_CONFIG`` in the environment, which the processes inherit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from collections.abc import Sequence


def run_target(target: str, args: Sequence[str], module: bool, function: str | None) -> None:
    """Run the script (or module) in this process, as ``python script args`` would."""
    sys.argv = [target, *args]
    if module:
        if function:
            getattr(importlib.import_module(target), function)()
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    if function:
        namespace = runpy.run_path(target, run_name="__accel_xla_main__")
        if not callable(namespace.get(function)):
            raise SystemExit(f"accel_xla.spawn: {target} has no function {function!r} (main_training_function)")
        namespace[function]()
    else:
        runpy.run_path(target, run_name="__main__")


def _process(index: int, target: str, args: Sequence[str], module: bool, function: str | None) -> None:
    run_target(target, args, module, function)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel_xla.spawn", description=__doc__.splitlines()[0])
    parser.add_argument("--single_process", action="store_true", help="run one process (this one) only")
    parser.add_argument("--main_training_function", default=None, help="call this function of the script")
    parser.add_argument("-m", dest="module", action="store_true", help="the target is a module")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    import torch_xla

    torch_xla.launch(
        _process,
        args=(opts.target, opts.args, opts.module, opts.main_training_function),
        debug_single_process=opts.single_process,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
