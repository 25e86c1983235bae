"""The renames of docs/migrating-from-accelerate.md as code, for the ports of upstream scripts in ``upstream/``.

A port is its upstream file with these renames applied and nothing else: ``test_upstream_ports.py`` checks that
``rename(upstream) == port`` byte for byte and that each rule's ``guide`` text is in the guide. The renames act on
Python *name tokens* only (``tokenize``), so comments, strings and names that merely contain ``accelerate``
(``is_accelerate_version``) stay as upstream wrote them.

``python tests/compat/renames.py UPSTREAM PORT`` writes (or rewrites) a port from its upstream file.
"""

from __future__ import annotations

import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-accelerate.md"


@dataclass(frozen=True)
class Rename:
    """Name token ``old`` becomes ``new``; with ``after``, only as an attribute of a name ending in ``after``
    (``accelerator.state``, ``unpickled_accelerator.state``)."""

    old: str
    new: str
    guide: str  # the guide's text that maps it (must appear verbatim in the guide)
    after: str | None = None


RENAMES = (
    Rename(
        "accelerate",
        "accel",
        "renaming `Accelerator` to `Kernel` and `accelerate` to `accel` in the imports",
    ),
    Rename("Accelerator", "Kernel", "| `from accelerate import Accelerator` | `from accel import Kernel` |"),
)


def rename(source: str) -> str:
    """``source`` with every rule of :data:`RENAMES` applied to its name tokens."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []  # row, start col, end col, new text
    previous: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            for rule in RENAMES:
                if token.string != rule.old:
                    continue
                if rule.after is not None and not (
                    len(previous) >= 2 and previous[-1].string == "." and previous[-2].string.endswith(rule.after)
                ):
                    continue
                (row, start), (_, end) = token.start, token.end
                edits.append((row, start, end, rule.new))
                break
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = [*previous[-1:], token]
    for row, start, end, new in reversed(edits):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + new + line[end:]
    return "".join(lines)


def missing_from_guide() -> list[str]:
    """The rules whose guide text is not (or no longer) in the guide."""
    text = GUIDE.read_text()
    return [rule.guide for rule in RENAMES if rule.guide not in text]


if __name__ == "__main__":
    upstream, port = (Path(arg) for arg in sys.argv[1:3])
    port.write_text(rename(upstream.read_text()))
