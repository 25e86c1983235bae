"""How every ``accel`` command runs: accel's own errors become one line on stderr, never a traceback. Kept apart
from :mod:`accel.commands.cli` (which imports every command) so that a command's own ``main`` uses it without an
import circle."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from accel.errors import AccelError


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command; turn accel's own errors into one line on stderr and exit code 2."""
    try:
        return fn()
    except AccelError as exc:
        print(f"accel: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `accel env | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
