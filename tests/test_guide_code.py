"""Every code block of docs/migrating-from-accelerate.md runs: Python blocks (and the ``+`` lines of diff blocks) in
a real Python process; a block preceded by ``<!-- guide-test: accel launch -n 2 [flags] -->`` under
``accel launch`` on 2 CPU processes. A block that cannot run (shell commands that install packages, fragments) is
preceded by ``<!-- guide-test: illustrative (why) -->``; the test counts those, so a new one is a decision."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "migrating-from-accelerate.md"
ACCEL = Path(sys.executable).with_name("accel")
MARKER = re.compile(r"<!-- guide-test: (.+?) -->")
#: The blocks marked illustrative, and all blocks: change these only with the guide.
ILLUSTRATIVE = 2
BLOCKS = 6


@dataclass
class Block:
    line: int  # where its fence is (1-based)
    language: str
    code: str
    directive: str  # "" (run with python), "illustrative (...)", or "accel launch ..."

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.language}"


def blocks() -> list[Block]:
    found: list[Block] = []
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)$", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.fullmatch(before.strip())
        code = "\n".join(lines[i + 1 : end]) + "\n"
        if fence.group(1) == "diff":  # the accel side of the diff
            code = "\n".join(line[1:] for line in lines[i + 1 : end] if line.startswith("+")) + "\n"
        found.append(Block(i + 1, fence.group(1), code, marker.group(1) if marker else ""))
        i = end + 1
    return found


BLOCKS_FOUND = blocks()


def test_every_block_runs_or_is_marked_illustrative() -> None:
    assert len(BLOCKS_FOUND) == BLOCKS, [b.id for b in BLOCKS_FOUND]
    marked = [b for b in BLOCKS_FOUND if b.directive.startswith("illustrative")]
    assert len(marked) == ILLUSTRATIVE, [b.id for b in marked]
    for block in BLOCKS_FOUND:
        if block.directive.startswith("illustrative"):
            assert re.fullmatch(r"illustrative \(.+\)", block.directive), f"{block.id}: say why it does not run"
        else:
            assert block.language in ("python", "diff"), f"{block.id}: a {block.language} block must be marked"
            assert block.directive in ("",) or block.directive.startswith("accel launch "), block.id


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [b for b in BLOCKS_FOUND if not b.directive.startswith("illustrative")], ids=lambda b: b.id
)
def test_the_block_runs(tmp_path: Path, block: Block) -> None:
    script = tmp_path / "guide_block.py"
    script.write_text(block.code, encoding="utf-8")
    if block.directive:
        words = shlex.split(block.directive)
        assert words[:2] == ["accel", "launch"]
        cmd = [str(ACCEL), *words[1:], str(script)]
    else:
        cmd = [sys.executable, str(script)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_"))}
    env.update(ACCEL_HOME=str(tmp_path / "home"), HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.id} of {GUIDE.name} failed:\n{block.code}\n{proc.stdout}\n{proc.stderr}"
    if "--debug" in block.directive:  # what the debug-mode block says it prints
        assert (
            proc.stdout.count("DistributedOperationError") == 0
            and proc.stdout.count("the processes made different collective calls") == 2
        )
        assert proc.stdout.count("torch.Size([3, 3])") == 2
