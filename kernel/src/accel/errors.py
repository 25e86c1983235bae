"""Errors the kernel raises on purpose. ``UsageError`` is a user mistake: the CLI prints it as one line, exit 2."""

from __future__ import annotations


class AccelError(Exception):
    """Base class of every error accel raises on purpose."""


class UsageError(AccelError):
    """Bad input from the user (flag, config file, Kernel argument). Printed as one line; exit code 2."""


class PluginError(AccelError):
    """A plugin is missing, failed to load, or two plugins conflict."""


class CheckpointError(UsageError):
    """A checkpoint cannot be saved or loaded as asked: incomplete, damaged, refused (unlisted or unsafe files), or
    not compatible with this run (the message says what differs). Printed as one line like any UsageError."""
