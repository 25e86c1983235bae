"""docs/big-models.md: the example runs as written, in a fresh process, and prints what the page says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "big-models.md"


def test_the_big_models_example_runs(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    example = text[text.index("## Example") :]
    code = re.search(r"```python\n(.*?)```", example, flags=re.S)
    assert code is not None
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok"
    shown = re.search(r"print\(model.hf_device_map\)  # (\{.*\})", code.group(1))
    assert shown is not None
    printed = lines[-2]
    # the page abbreviates the middle of the map with "..."; the parts it shows are what the program printed
    for part in shown.group(1).strip("{}").split(", "):
        if part != "...":
            assert part in printed, (part, printed)
    assert "'disk'" in printed and "'cpu'" in printed
