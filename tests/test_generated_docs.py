"""The generated parts of the docs (docs/hooks.md, docs/plugin-api.md) are what docs/generate.py makes from the code
now: a changed hookspec docstring, a new hook implementation, a new record field or option type without
`make docs` fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generator():
    spec = importlib.util.spec_from_file_location("accel_docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_up_to_date():
    gen = generator()
    stale = gen.stale_pages()
    assert not stale, (
        f"{', '.join(str(p.relative_to(ROOT)) for p in stale)} differ from the generator's output: "
        f"run `{gen.COMMAND}` (python docs/generate.py) and commit the result"
    )


def test_the_generated_pages_are_the_ones_we_document():
    assert {p.name for p in generator().pages()} == {"hooks.md", "plugin-api.md"}


def test_a_stale_block_is_found_and_replaced():
    gen = generator()
    page = "intro\n<!-- generated: options (x) -->\nold text\n<!-- end generated -->\noutro\n"
    new = gen.render(page, {})
    assert new != page and "old text" not in new and new.startswith("intro\n") and new.endswith("outro\n")
    assert '"mapping"' in new and "options.add(" in new
    assert gen.render(new, {}) == new
