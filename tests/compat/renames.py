"""The renames of docs/migrating-from-accelerate.md as code, for the ports of upstream scripts in ``upstream/``.

A port is its upstream file with these renames applied and nothing else: ``test_upstream_ports.py`` checks that
``rename(upstream) == port`` byte for byte and that each rule's ``guide`` text is in the guide. The renames act on
Python *name tokens* only (``tokenize``), so comments, strings and names that merely contain ``accelerate``
(``is_accelerate_version``) stay as upstream wrote them.

A :class:`Skip` leaves out one statement that checks a behaviour accel decided differently (the guide says how and
why): the line that is exactly that statement becomes ``pass`` with a comment naming the guide's text.

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


@dataclass(frozen=True)
class ModulePath:
    """After the renames, ``from OLD import`` becomes ``from NEW import`` (Accelerate's module paths whose names accel
    exports elsewhere)."""

    old: str
    new: str
    guide: str  # the guide's text that maps it (must appear verbatim in the guide)


_TOP = "| `from accelerate.accelerator import X`, `from accelerate.state import X`, `from accelerate.data_loader import X` |"
_TEST_UTILS = "| `from accelerate.test_utils import X`, `from accelerate.test_utils.testing import assert_exception` |"
MODULE_PATHS = (
    ModulePath("accel.accelerator", "accel", _TOP),
    ModulePath("accel.state", "accel", _TOP),
    ModulePath("accel.data_loader", "accel", _TOP),
    ModulePath("accel.test_utils.testing", "accel.testing.regression", _TEST_UTILS),
    ModulePath("accel.test_utils", "accel.testing.regression", _TEST_UTILS),
)


@dataclass(frozen=True)
class Skip:
    """A statement line (stripped, as it reads after the renames) that becomes ``pass``: a check of a behaviour the
    guide says accel does otherwise."""

    statement: str
    why: str  # the line's new comment
    guide: str  # the guide's text that says it (must appear verbatim in the guide)


SKIPS = (
    Skip(
        "test_can_disable_even_batches()",
        "accel: a process that runs out gets empty batches, not fewer",
        "- **`even_batches=False` never hangs.** Processes that run out of data early get empty batches",
    ),
    Skip(
        "accelerator.state.distributed_type = DistributedType.FSDP",
        "accel: kernel.state is read-only",
        "| `state` | same | a read-only view of the Kernel's distributed facts",
    ),
    Skip(
        "test_join_raises_warning_for_non_ddp_distributed(accelerator)",
        "accel: join_uneven_inputs works on gloo; a Mock is refused",
        "It works on every backend torch's `Join` supports (gloo/CPU included)",
    ),
    Skip(
        "accelerator.state.distributed_type = original_state",
        "accel: kernel.state is read-only",
        "| `state` | same | a read-only view of the Kernel's distributed facts",
    ),
)


def rename(source: str) -> str:
    """``source`` with every rule of :data:`RENAMES` applied to its name tokens, then the :data:`MODULE_PATHS` of its
    ``from ... import`` lines, then the :data:`SKIPS`."""
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
    for row, line in enumerate(lines):
        for path in MODULE_PATHS:
            old = f"from {path.old} import "
            if line.lstrip().startswith(old):
                lines[row] = line.replace(old, f"from {path.new} import ", 1)
                break
    skips = {skip.statement: skip for skip in SKIPS}
    for row, line in enumerate(lines):
        skip = skips.get(line.strip())
        if skip is not None:
            indent = line[: len(line) - len(line.lstrip())]
            lines[row] = f"{indent}pass  # {skip.why}\n"
    return "".join(lines)


def missing_from_guide() -> list[str]:
    """The rules whose guide text is not (or no longer) in the guide."""
    text = GUIDE.read_text()
    return [rule.guide for rule in (*RENAMES, *MODULE_PATHS, *SKIPS) if rule.guide not in text]


if __name__ == "__main__":
    upstream, port = (Path(arg) for arg in sys.argv[1:3])
    port.write_text(rename(upstream.read_text()))
