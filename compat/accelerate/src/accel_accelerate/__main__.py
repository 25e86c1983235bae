"""``python -m accel_accelerate``: which ``accelerate`` this process imports, and why."""

from __future__ import annotations

import importlib.util
import os
import sys

from accel_accelerate import ACCELERATE_API_VERSION
from accel_accelerate.startup import SHADOW, VARIABLE, decide


def main() -> int:
    on, why = decide(os.environ, [p for p in sys.path if p != SHADOW])
    spec = importlib.util.find_spec("accelerate")
    origin = spec.origin if spec is not None else None
    print(f"accel's accelerate (API {ACCELERATE_API_VERSION}): {'on' if on else 'off'}: {why}")
    print(f"import accelerate -> {origin or 'not importable'}")
    print(
        f"under accel launch: {'off' if os.environ.get(VARIABLE, '').strip() in ('0', 'false', 'no', 'off') else 'on'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
