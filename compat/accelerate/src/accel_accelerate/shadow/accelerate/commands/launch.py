"""``accelerate.commands.launch``: ``accelerate launch`` as a function (TRL's ``trl`` command starts training
with it). Under accel-accelerate it is ``accel launch``: the same flags, accel's launcher."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """A parser that keeps every argument for ``accel launch`` (which reads Accelerate's flags itself)."""
    parser = argparse.ArgumentParser("accelerate launch", add_help=False, allow_abbrev=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def launch_command(args: argparse.Namespace) -> None:
    """Run ``accel launch`` with the parsed arguments; exits with its status when it fails."""
    rest = list(getattr(args, "rest", []) or [])
    status = subprocess.call([sys.executable, "-m", "accel.commands.cli", "launch", *rest])
    if status:
        raise SystemExit(status)
