"""docs/migrating-from-accelerate.md must not promise what accel does not have. (Its name-by-name table is checked
by kernel/tests/test_accelerate_names.py.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-accelerate.md"


def section(title: str) -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end]


def accel_names_of_the_imports_table() -> list[str]:
    """Dotted accel names of the table's second column (``accel.utils.tqdm``, ``accel.DataLoaderConfiguration``),
    with the bare names listed after one (``accel.utils.DummyOptim``, ``DummyScheduler``) qualified the same way."""
    names = []
    for row in section("## Imports").splitlines():
        if not row.startswith("| `"):
            continue
        accel = row.split("|")[2]
        for module, name in re.findall(r"`(?:from (accel(?:\.\w+)*) import )?((?:accel\.)?[\w.]+)", accel):
            if module:
                names.append(f"{module}.{name}")
            elif name.startswith("accel."):
                names.append(name)
        if "the same names in `accel.utils`" in accel:
            accelerate = row.split("|")[1]
            names += [f"accel.utils.{n}" for n in re.findall(r"`(?:accelerate\.utils\.)?(\w+Kwargs)`", accelerate)]
    return names


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_accel_name_of_the_imports_table_exists() -> None:
    names = accel_names_of_the_imports_table()
    assert {
        "accel.Kernel",
        "accel.DataLoaderConfiguration",
        "accel.utils.set_seed",
        "accel.skip_first_batches",
        "accel.logging.get_logger",
        "accel.utils.GradScalerKwargs",
    } <= set(names)
    for name in names:
        if name.startswith("accel.utils.Dummy") and importlib.util.find_spec("accel_deepspeed") is None:
            continue  # exported by accel-plugin-deepspeed
        resolve(name)


def test_the_scheduler_section_names_the_options_the_kernel_declares() -> None:
    from accel.data_arguments import SCHEDULER_RULES
    from accel.options import Options, core_options

    options = Options()
    core_options(options)
    assert options["scheduler_steps"].choices == SCHEDULER_RULES
    text = section("## The LR scheduler")
    for rule in SCHEDULER_RULES:
        assert f'scheduler_steps="{rule}"' in text
    assert "`ACCEL_SCHEDULER_STEPS`" in text and "`--scheduler_steps`" in text
