"""Helpers of the DeepSpeed tests (here and in the cross-plugin suites of ``tests/``, through ``tests/clitools.py``):
the environment of a test's own ``accel launch``, with DeepSpeed's CPU ops built once."""

from __future__ import annotations

import os
from pathlib import Path

#: Where DeepSpeed builds its CPU ops (the shm communication op, 2-3 min) once, kept between runs (ignored by git).
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
    Path(__file__).resolve().parents[3] / ".cache" / "torch_extensions"
)


def deepspeed_env(tmp: Path) -> dict[str, str]:
    """The environment of a test's own DeepSpeed ``accel launch``: none of the variables a surrounding launcher or
    accel config would set, a private ``ACCEL_HOME``, one thread per process, unbuffered output, DeepSpeed's ops
    built once in :data:`EXTENSIONS`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCEL_", "ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    env.update(
        ACCEL_HOME=str(tmp / "accel_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_EXTENSIONS_DIR=EXTENSIONS
    )
    return env


def build_ops() -> None:
    """Build DeepSpeed's CPU communication op into :data:`EXTENSIONS` with the call DeepSpeed's communication makes
    (so the tests' launches load it instead of building it); torch's build lock makes a concurrent build wait."""
    os.environ["TORCH_EXTENSIONS_DIR"] = EXTENSIONS
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("ShareMemCommBuilder").load()


if __name__ == "__main__":  # `make setup-deepspeed-ops`: build the op ahead of the tests, beside the suite
    build_ops()
