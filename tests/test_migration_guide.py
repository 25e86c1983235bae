"""docs/migrating-from-accelerate.md must not promise what the Kernel does not have."""

from __future__ import annotations

import re
from pathlib import Path

from accel.kernel import Kernel

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-accelerate.md"


def section(title: str) -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:end]


def test_every_name_in_the_same_name_table_exists_on_kernel() -> None:
    rows = [ln for ln in section("### Same name, same meaning").splitlines() if ln.startswith("| `")]
    names = {m.group(1) for row in rows for m in re.finditer(r"`([a-z_]+)[(`]", row.split("|")[1])}
    assert len(names) > 40
    kernel = Kernel(cpu=True)  # some names are instance attributes (device, gradient_state)
    missing = sorted(n for n in names if not hasattr(kernel, n))
    kernel.end_training()
    assert not missing, f"the guide lists names Kernel does not have: {missing}"


def test_constructor_arguments_exist() -> None:
    import inspect

    params = set(inspect.signature(Kernel.__init__).parameters)
    rows = [ln for ln in section("### Constructor arguments").splitlines() if ln.startswith("| ")]
    claimed = set()
    for row in rows:
        accelerate, accel = row.split("|")[1:3]
        column = accelerate if accel.strip().startswith("same") else accel  # "same": the Accelerate name is kept
        claimed |= {m.group(1) for m in re.finditer(r"`([a-z_]+)=", column)}
    assert {"mixed_precision", "gradient_accumulation_steps", "cpu", "even_batches", "plugins"} <= claimed
    declared = params | {"ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_backend", "ddp_timeout",
                         "zero_stage"}  # plugin options (ddp here; zero_stage belongs to accel-plugin-deepspeed)
    assert claimed <= declared | {"device_placement"}, claimed - declared
