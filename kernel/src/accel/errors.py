"""Errors the kernel raises on purpose. ``UsageError`` is a user mistake: the CLI prints it as one line, exit 2."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType


class AccelError(Exception):
    """Base class of every error accel raises on purpose."""


class UsageError(AccelError):
    """Bad input from the user (flag, config file, Kernel argument). Printed as one line; exit code 2."""


class PluginError(AccelError):
    """A plugin is missing, failed to load, or two plugins conflict."""


class CheckpointError(UsageError):
    """A checkpoint cannot be saved or loaded as asked: incomplete, damaged, refused (unlisted or unsafe files), or
    not compatible with this run (the message says what differs). Printed as one line like any UsageError."""


class DistributedOperationError(AccelError):
    """Debug mode (``debug: true``) found processes making different collective calls: another operation, or
    tensors of another shape or dtype (accel/debug.py). Raised on every process with the same one-line message.
    Accelerate's ``DistributedOperationException``."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first frame outside accel (the
    user's line that called the Kernel)."""
    root = os.path.dirname(os.path.abspath(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level
