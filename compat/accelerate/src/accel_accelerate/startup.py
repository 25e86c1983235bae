"""The switch that decides which ``accelerate`` a process imports. Run at interpreter start-up by
``accel_accelerate.pth``; it imports nothing beyond ``os`` and ``sys`` and never raises.

- ``ACCEL_ACCELERATE=1``: ``import accelerate`` gives accel's façade (``shadow/accelerate``), and
  ``importlib.metadata.version("accelerate")`` the Accelerate API version it implements.
- ``ACCEL_ACCELERATE=0``: never; the real ``accelerate``, if installed, is imported as usual.
- unset: on in the processes ``accel launch`` starts (they carry ``ACCEL_CONFIG``), and in any process when no other
  ``accelerate`` is installed; off otherwise (plain ``python``/``torchrun`` with the real Accelerate installed).

Nothing is written into another distribution's files: the façade is put first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: importing typing would cost every Python start a few milliseconds
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

VARIABLE = "ACCEL_ACCELERATE"
SHADOW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shadow")
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def other_accelerate(path: Sequence[str]) -> str | None:
    """The folder of an ``accelerate`` package on ``path`` other than the façade, or None."""
    for entry in path:
        folder = os.path.join(entry or os.getcwd(), "accelerate")
        if os.path.abspath(entry or ".") != SHADOW and os.path.isfile(os.path.join(folder, "__init__.py")):
            return folder
    return None


def decide(env: Mapping[str, str], path: Sequence[str]) -> tuple[bool, str]:
    """Whether the façade is on for a process with this environment and ``sys.path``, and why (one phrase)."""
    value = env.get(VARIABLE, "").strip().lower()
    if value in _ON:
        return True, f"{VARIABLE}={env[VARIABLE]}"
    if value in _OFF:
        return False, f"{VARIABLE}={env[VARIABLE]}"
    if value:
        return False, f"{VARIABLE}={env[VARIABLE]!r} is not understood: set it to 1 (accel's) or 0 (the other one)"
    if "ACCEL_CONFIG" in env:
        return True, "a process started by accel launch (ACCEL_ACCELERATE=0 turns it off)"
    other = other_accelerate(path)
    if other is None:
        return True, "no other accelerate is installed"
    return False, f"Accelerate is installed at {other} (ACCEL_ACCELERATE=1 or accel launch turns accel's on)"


def _apply() -> None:
    try:
        on, why = decide(os.environ, sys.path)
        if on and SHADOW not in sys.path:
            sys.path.insert(0, SHADOW)
        elif not on and why.endswith("(the other one)"):
            print(f"accel-accelerate: {why}", file=sys.stderr)
    except Exception as exc:  # start-up must go on whatever happens here  # noqa: BLE001
        print(f"accel-accelerate: the accelerate switch failed ({exc}); accel's accelerate is off", file=sys.stderr)


_apply()
