"""Accelerate's public names and what each is on accel: the two tables of docs/migrating-from-accelerate.md.

- ``accelerate_names.json``: every argument of ``Accelerator(...)`` and every public member of ``Accelerator``, each
  the same on :class:`accel.Kernel`, renamed (to its accel name), or refused with the one line saying what to use.
- ``accelerate_modules.json``: the public names of ``accelerate``, ``accelerate.utils``, ``accelerate.data_loader``
  and ``accelerate.state``: the accel name of each, or why it is refused.

This module is also the accel plugin ``accelerate-names`` (entry point of group ``accel``): its
``accel_explain_name`` hook gives those lines to the kernel, so a script moved to ``accel`` by renaming that calls
``Kernel(deepspeed_plugin=...)`` or reads ``kernel.scaler`` is told what to use instead. The kernel holds no table of
Accelerate's names. ``python -m accel_accelerate.names`` prints both tables of the guide.

It imports neither torch nor the façade (discovery hooks run for ``accel --help``).
"""

from __future__ import annotations

import fnmatch
import functools
import json
from pathlib import Path
from typing import Any

from accel.spi import hookimpl

HERE = Path(__file__).resolve().parent


@functools.cache
def accelerate_names() -> dict[str, Any]:
    """The table: ``{"arguments": {name: entry}, "members": {name: entry}}``; an entry has ``status`` (``same``,
    ``renamed`` with ``accel``, or ``refused`` with ``message``) and an optional ``note``."""
    with open(HERE / "accelerate_names.json", encoding="utf-8") as fh:
        return dict(json.load(fh))


def argument_refusal(name: str) -> str | None:
    """The message for an ``Accelerator`` argument ``Kernel`` refuses, or None."""
    entry = accelerate_names()["arguments"].get(name)
    return entry["message"] if entry and entry["status"] == "refused" else None


def member_message(name: str) -> str | None:
    """What to use instead of an ``Accelerator`` member that ``Kernel`` does not have, or None."""
    entry = accelerate_names()["members"].get(name)
    if not entry or entry["status"] == "same":
        return None
    if entry["status"] == "renamed":
        note = f" ({entry['note']})" if entry.get("note") else ""
        return f"Kernel has no attribute {name!r} (Accelerate's name): use kernel.{entry['accel']}{note}"
    return str(entry["message"])


@functools.cache
def accelerate_modules() -> dict[str, Any]:
    """The public names of Accelerate's modules (accelerate_modules.json): ``{"names": {name: entry}, "patterns":
    {fnmatch pattern: entry}}``; an entry has ``accel`` (the accel name, ``accel.X`` or ``kernel.X``) and an
    optional ``note``, or ``refused`` (why, and what to use)."""
    with open(HERE / "accelerate_modules.json", encoding="utf-8") as fh:
        return dict(json.load(fh))


def module_name_entry(name: str) -> tuple[str, dict[str, str]] | None:
    """The entry for a public name of Accelerate's modules and what it was found under (the name itself or the
    pattern it matches), or None when the table has no entry for it."""
    table = accelerate_modules()
    if name in table["names"]:
        return name, table["names"][name]
    for pattern, entry in table["patterns"].items():
        if fnmatch.fnmatchcase(name, pattern):
            return pattern, entry
    return None


def modules_table() -> str:
    """The guide's table of the public names of ``accelerate``, ``accelerate.utils``, ``accelerate.data_loader`` and
    ``accelerate.state``: one row per name, and one per pattern for a family of names."""
    table = accelerate_modules()
    lines = ["| Accelerate name | accel | notes |", "| --- | --- | --- |"]
    for key, entry in sorted([*table["names"].items(), *table["patterns"].items()], key=lambda kv: kv[0].lower()):
        if "accel" in entry:
            accel, note = f"`{entry['accel']}`", entry.get("note", "")
        else:
            accel, note = "refused", entry["refused"]
        lines.append(f"| `{key}` | {accel} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The name-by-name table of docs/migrating-from-accelerate.md (tests check the guide holds exactly this)."""
    names = accelerate_names()
    lines = []
    for part, title, suffix in (
        ("arguments", "`Accelerator(...)` argument", "="),
        ("members", "`Accelerator` member", ""),
    ):
        lines += [f"| {title} | accel | notes |", "| --- | --- | --- |"]
        for name in sorted(names[part]):
            entry = names[part][name]
            shown = f"`{name}{suffix}`"
            if entry["status"] == "same":
                accel, note = "same", entry.get("note", "")
            elif entry["status"] == "renamed":
                accel, note = f"`{entry['accel']}`", entry.get("note", "")
            else:  # the message after its "X is not supported:" part
                accel, note = "refused", entry["message"].split(": ", 1)[-1]
            lines.append(f"| {shown} | {accel} | {note.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


@hookimpl
def accel_explain_name(kind: str, name: str) -> str | None:
    """An ``Accelerator`` argument (``kind="argument"``) that ``Kernel`` refuses, or a member (``kind="member"``) it
    does not have under that name: the line saying what to use instead."""
    if kind == "argument":
        return argument_refusal(name)
    if kind == "member":
        return member_message(name)
    return None


if (
    __name__ == "__main__"
):  # python -m accel_accelerate.names: print the guide's tables (Accelerator's, then the modules')
    print(markdown_table())
    print(modules_table(), end="")
