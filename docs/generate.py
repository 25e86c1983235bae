"""Generate the parts of the docs that restate code: ``make docs`` (``python docs/generate.py``).

A page holds hand-written prose and generated blocks::

    <!-- generated: KEY (python docs/generate.py; do not edit) -->
    ...replaced by BLOCKS[KEY]()...
    <!-- end generated -->

The generator rewrites only what lies between the markers; everything else in the page is kept as written.
``--check`` writes nothing and exits 1 naming the stale pages (tests/test_generated_docs.py runs the same
check in the suite). Sources:

- ``hooks`` (docs/hooks.md): every hook of ``accel/hookspecs.py`` in file order, grouped by the file's section
  comments, with its signature, its ``@hookspec`` flags and its docstring verbatim; and who answers each hook,
  from the plugins of this repository (``accel/known_plugins.json``), loaded through their entry points the
  way a run loads them, and the kernel's own default implementations.
- ``records``, ``options``, ``kernel-members``, ``kernel-imports``, ``launch-settings`` (docs/plugin-api.md): the
  fields of the records plugins receive and return (with their comments), ``Options.add`` and its types, the
  kernel names plugins of this repository actually use (found by reading their source), and the kernel's launch
  settings an ``accel_launch`` answer must honour or refuse.

Needs the repository's venv (``make setup``): the plugins must be installed. Imports no plugin backend.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND = "make docs"
MARK = re.compile(r"(<!-- generated: ([\w-]+)[^\n]*-->\n)(.*?)(<!-- end generated -->)", re.S)
KERNEL = "kernel"  # the column of the kernel's own (default, ``trylast``) implementations


# ---- hooks ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Hook:
    name: str
    function: Callable[..., Any]
    firstresult: bool
    historic: bool
    phase: str


@dataclasses.dataclass
class Phase:
    title: str
    text: str  # the rest of the section comment (may be empty)


def hookspecs_module() -> Any:
    from accel import hookspecs

    return hookspecs


def phases() -> list[tuple[int, Phase]]:
    """The section comments of hookspecs.py (``# ----`` then ``# Title`` and more comment lines), by line."""
    lines = Path(inspect.getfile(hookspecs_module())).read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.fullmatch(r"# -{20,}", line):
            comment = []
            for following in lines[i + 1 :]:
                if not following.startswith("#"):
                    break
                comment.append(following[1:].strip())
            if comment:  # "Title" or "Title. First sentence of the text ..." on the first line
                title, _, rest = comment[0].partition(". ")
                found.append((i + 1, Phase(title.rstrip("."), " ".join([rest, *comment[1:]]).strip())))
    return found


def hooks() -> list[Hook]:
    """Every hook of hookspecs.py, in file order, with the section it is under."""
    spec_module = hookspecs_module()
    marker = f"{spec_module.PROJECT}_spec"
    sections = phases()
    found = []
    for name, fn in vars(spec_module).items():
        if name.startswith("accel_") and hasattr(fn, marker):
            line = inspect.getsourcelines(fn)[1]
            phase = [p for start, p in sections if start < line]
            opts = getattr(fn, marker)
            found.append(
                (
                    line,
                    Hook(
                        name,
                        fn,
                        bool(opts.get("firstresult")),
                        bool(opts.get("historic")),
                        phase[-1].title if phase else "",
                    ),
                )
            )
    return [hook for _, hook in sorted(found, key=lambda pair: pair[0])]


def signature(fn: Callable[..., Any], annotated: bool) -> str:
    """``name(a, b) -> R`` (``annotated``: ``name(a: A, b: B) -> R``), from the string annotations."""
    sig = inspect.signature(fn)
    params = [f"{p.name}: {p.annotation}" if annotated else p.name for p in sig.parameters.values()]
    return f"{fn.__name__}({', '.join(params)}) -> {sig.return_annotation}"


@dataclasses.dataclass
class Impl:
    plugin: str  # column: a plugin name or KERNEL
    where: str  # "DDPStrategy", "module", or a built-in plugin's "name` (`module" ("accel` (`accel.defaults")
    opts: dict[str, Any]


#: accel plugins of this repository that come with a distribution other than a plugin's (known_plugins.json lists
#: the plugin distributions): accel-accelerate's tables of Accelerate's names
OTHER_PLUGINS = ("accelerate-names",)


def known_plugin_names() -> list[str]:
    from accel.options import known_plugins

    return [*known_plugins()["plugins"], *OTHER_PLUGINS]


def plugin_modules() -> dict[str, Any]:
    """The entry-point module of every plugin of this repository, loaded the way a run loads it."""
    from accel.plugins import GROUP

    points = {ep.name: ep for ep in md.entry_points(group=GROUP)}
    missing = [name for name in known_plugin_names() if name not in points]
    if missing:
        raise SystemExit(
            f"docs/generate.py: plugins {missing} of this repository are not installed in "
            f"{sys.prefix}; run `make setup` (it installs every plugins/*/) and `{COMMAND}` again"
        )
    return {name: points[name].load() for name in known_plugin_names()}


def implementations(obj: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(hook name, hookimpl options) for every hook implemented by a module or a class (inherited ones too)."""
    marker = f"{hookspecs_module().PROJECT}_impl"
    for attr in sorted(dir(obj)):
        if attr.startswith("accel_"):
            opts = getattr(getattr(obj, attr), marker, None)
            if opts is not None:
                yield attr, dict(opts)


def component_classes(module: Any) -> list[type]:
    """The classes a plugin module lists in ``accel_components`` (``"package.module:Class"``)."""
    classes = []
    for spec in getattr(module, "accel_components", ()):
        mod_name, _, cls_name = spec.partition(":")
        classes.append(getattr(importlib.import_module(mod_name), cls_name))
    return classes


def kernel_implementers() -> list[tuple[str, Any]]:
    """What the kernel registers itself in every run (the built-in plugins, ``accel.builtin``): the objects a plugin
    manager holds when every plugin is left out (an empty ``ACCEL_PLUGINS`` allow-list), as ``name` (`module``."""
    from accel.plugins import Plugins

    pm = Plugins.load(env={"ACCEL_PLUGINS": ""}).pm
    return [(f"{name}` (`{getattr(obj, '__name__', type(obj).__name__)}", obj) for name, obj in pm.list_name_plugin()]


def who_answers() -> dict[str, list[Impl]]:
    """Hook name -> its implementations: the kernel's own, then each plugin of this repository."""
    table: dict[str, list[Impl]] = {}
    for where, obj in kernel_implementers():
        for hook, opts in implementations(obj):
            table.setdefault(hook, []).append(Impl(KERNEL, where, opts))
    for name, module in plugin_modules().items():
        for hook, opts in implementations(module):
            table.setdefault(hook, []).append(Impl(name, "module", opts))
        for cls in component_classes(module):
            for hook, opts in implementations(cls):
                table.setdefault(hook, []).append(Impl(name, cls.__name__, opts))
    return table


def mark(impls: list[Impl]) -> str:
    """A cell of the who-answers table: ``✓``, ``wrapper`` or ``default`` (trylast)."""
    marks = []
    for impl in impls:
        if impl.opts.get("wrapper") or impl.opts.get("hookwrapper"):
            marks.append("wrapper")
        elif impl.opts.get("trylast") and impl.plugin == KERNEL:
            marks.append("default")
        else:
            marks.append("✓")
    return ", ".join(dict.fromkeys(marks))


def answered_by(impls: list[Impl]) -> str:
    if not impls:
        return "nobody in this repository"
    parts = []
    for impl in impls:
        kind = "wrapper, " if impl.opts.get("wrapper") or impl.opts.get("hookwrapper") else ""
        where = "module level" if impl.where == "module" else f"`{impl.where}`"
        if impl.plugin == KERNEL:
            parts.append(f"the built-in `{impl.where}`, {kind}last)")
        else:
            parts.append(f"`{impl.plugin}` ({kind}{where})")
    return ", ".join(parts)


def flags(hook: Hook) -> str:
    calling = (
        "first answer wins: `@hookspec(firstresult=True)`"
        if hook.firstresult
        else "everyone: `@hookspec` (every implementation is called)"
    )
    return calling + ("; historic (`historic=True`)" if hook.historic else "")


def anchor(hook: Hook) -> str:
    """GitHub's anchor for the ``### `name(args) -> R``` heading."""
    heading = signature(hook.function, annotated=False).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def hooks_block() -> str:
    spec_module = hookspecs_module()
    all_hooks = hooks()
    table = who_answers()
    columns = [KERNEL, *known_plugin_names()]
    out = [
        "## The contract's rules (from `hookspecs.py`)",
        "",
        inspect.getdoc(spec_module) or "",
        "",
        "## Who answers each hook",
        "",
        "Computed from the plugins of this repository (`known_plugins.json`, loaded through their entry points) "
        "and the kernel's own implementations (`default`: registered `trylast`, asked last). `✓`: "
        "implemented (at module level for the discovery hooks, else by the plugin's component); `wrapper`: "
        "`@hookimpl(wrapper=True)`.",
        "",
        "| hook | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for hook in all_hooks:
        impls = table.get(hook.name, [])
        cells = [mark([i for i in impls if i.plugin == column]) for column in columns]
        out.append(f"| [`{hook.name}`](#{anchor(hook)}) | " + " | ".join(cells) + " |")
    current = None
    for hook in all_hooks:
        if hook.phase != current:
            current = hook.phase
            out += ["", f"## {current}"]
            text = next((p.text for _, p in phases() if p.title == current), "")
            if text:
                out += ["", text]
        out += [
            "",
            f"### `{signature(hook.function, annotated=False)}`",
            "",
            "```python",
            signature(hook.function, annotated=True),
            "```",
            "",
            f"**Who answers:** {flags(hook)}. **Implemented by:** {answered_by(table.get(hook.name, []))}.",
            "",
            inspect.getdoc(hook.function) or "",
        ]
    unknown = sorted(set(table) - {h.name for h in all_hooks})
    if unknown:
        raise SystemExit(f"docs/generate.py: implementations of hooks that hookspecs.py lacks: {unknown}")
    return "\n".join(out) + "\n"


# ---- plugin API ------------------------------------------------------------------------------------------------


def row(*cells: str) -> str:
    """A Markdown table row; ``|`` and ``<`` inside a cell are escaped (a type ``int | None``, a path ``<dir>``)."""
    return "| " + " | ".join(c.replace("|", "\\|").replace("<", "&lt;") for c in cells) + " |"


def first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def field_comments(cls: type) -> dict[str, str]:
    """Comments of a class's annotated attributes: ``#:`` lines right above it and a ``#`` comment on its line."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    body = ast.parse("\n".join(lines)).body[0]
    comments = {}
    for node in getattr(body, "body", []):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                above.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            tokens = [
                tok
                for tok in tokenize.generate_tokens(io.StringIO(lines[node.lineno - 1] + "\n").readline)
                if tok.type == tokenize.COMMENT
            ]
            trailing = tokens[0].string.lstrip("#").strip() if tokens else ""
            comments[node.target.id] = " ".join(part for part in (*above, trailing) if part)
    return comments


def record_table(cls: type) -> list[str]:
    """The fields of a dataclass (or class attributes of a plain class), their type, default and comment."""
    comments = field_comments(cls)
    fields = dataclasses.is_dataclass(cls) or inspect.get_annotations(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"] if fields else []
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f"`{f.default!r}`"
            elif f.default_factory is not dataclasses.MISSING:
                default = f"`{f.default_factory()!r}`"
            else:
                default = "required"
            rows.append(row(f"`{f.name}`", f"`{f.type}`", default, comments.get(f.name, "")))
    else:
        for name, kind in inspect.get_annotations(cls).items():
            rows.append(row(f"`{name}`", f"`{kind}`", f"`{getattr(cls, name)!r}`", comments.get(name, "")))
    members = [
        (n, m)
        for n, m in vars(cls).items()
        if not n.startswith("_") and (isinstance(m, property) or (inspect.isfunction(m) and not n.startswith("accel_")))
    ]
    if members:
        rows += ["", "| member | what it is |", "|---|---|"] if rows else ["| member | what it is |", "|---|---|"]
        for name, member in members:
            call = "" if isinstance(member, property) else "()"
            rows.append(row(f"`{name}{call}`", first_paragraph(member) or "—"))
    return rows


def record_classes() -> list[type]:
    from accel.contract import Collectives, Component, HardwareInfo, ItemRecord, LaunchPlan, Question, Topology
    from accel.options import Settings

    return [Settings, Component, LaunchPlan, HardwareInfo, Topology, ItemRecord, Question, Collectives]


def public_name(obj: Any) -> str:
    """``accel.spi.Name`` when the plugin API exports it (the only place plugins import from), else its module's
    dotted name."""
    import accel.spi

    exported = obj.__name__ in accel.spi.__all__ and getattr(accel.spi, obj.__name__) is obj
    return f"accel.spi.{obj.__name__}" if exported else f"{obj.__module__}.{obj.__name__}"


def records_block() -> str:
    out: list[str] = []
    for cls in record_classes():
        out += [f"### `{public_name(cls)}`", "", inspect.getdoc(cls) or "", ""]
        out += record_table(cls)
        out.append("")
    return "\n".join(out)


#: What each ``type=`` of ``Options.add`` accepts, by source. The generator fails when accel.options.TYPES has a
#: type this table lacks, so a new type cannot go undocumented.
TYPE_MEANINGS = {
    "str": 'a string (the default type). YAML\'s unquoted `no` is read as `"no"` when `no` is one of the choices.',
    "int": 'a whole number; a flag or variable `"8"` is converted, `true`/`false` are refused.',
    "float": "a number; ints and numeric strings are converted, booleans refused.",
    "bool": '`true`/`false`; strings `1 true yes on y` and `0 false no off n` (any case, `""` is false). On the '
    "command line: `--name` sets it, `--name false` too.",
    "list": "a list; a string is split on commas (`--plugin a,b`), YAML lists are kept.",
    "mapping": "a mapping; a string is read as a JSON object (`--ddp_comm_state_option '{\"a\": 1}'`).",
}


def options_block() -> str:
    from accel.options import TYPES, Option, Options

    missing = [t for t in TYPES if t not in TYPE_MEANINGS]
    if missing:
        raise SystemExit(
            f"docs/generate.py: option types {missing} (accel.options.TYPES) have no entry in "
            "TYPE_MEANINGS: describe them there"
        )
    add = Options.add
    params = [
        f"{p.name}: {p.annotation} = {p.default!r}"
        if p.default is not inspect.Parameter.empty
        else f"{p.name}: {p.annotation}"
        for p in list(inspect.signature(add).parameters.values())[1:]
    ]
    out = [
        "```python",
        "options.add(",
        *[f"    {p}," for p in params],
        ") -> None",
        "```",
        "",
        inspect.getdoc(add) or "",
        "",
        "`type=` is one of (`accel.options.TYPES`):",
        "",
        "| `type=` | accepts |",
        "|---|---|",
    ]
    out += [row(f'`"{t}"`', TYPE_MEANINGS[t]) for t in TYPES]
    out += ["", "Every argument of `add` becomes a field of the declared `accel.options.Option`:", ""]
    out += record_table(Option)
    return "\n".join(out) + "\n"


def plugin_sources() -> Iterator[tuple[str, ast.Module]]:
    for name in known_plugin_names():
        for path in sorted((ROOT / "plugins" / name / "src").rglob("*.py")):
            yield name, ast.parse(path.read_text(encoding="utf-8"))


def kernel_members_block() -> str:
    """Every member of :class:`accel.spi.KernelView` (what a runtime hook may use of the kernel it is handed), with
    the plugins of this repository that use it (``kernel.X`` in their source) and the member's own docstring or
    comment. A plugin using a member the view lacks fails the generator."""
    from accel.spi import KernelView

    used: dict[str, set[str]] = {}
    for plugin, tree in plugin_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernel":
                used.setdefault(node.attr, set()).add(plugin)
    comments = field_comments(KernelView)
    members = {name: "" for name in comments}
    members |= {
        name: "" if isinstance(m, property) else "(...)"
        for name, m in vars(KernelView).items()
        if not name.startswith("_") and (isinstance(m, property) or inspect.isfunction(m))
    }
    if outside := sorted(set(used) - set(members)):
        raise SystemExit(
            "docs/generate.py: plugins use "
            + ", ".join(f"kernel.{n} ({', '.join(sorted(used[n]))})" for n in outside)
            + ", which accel.spi.KernelView does not have: add it there (with a docstring) or do without"
        )
    rows = ["| member | used by | what it is |", "|---|---|---|"]
    for name, call in sorted(members.items()):
        member = vars(KernelView).get(name)
        doc = first_paragraph(member) if member is not None else comments[name]
        rows.append(row(f"`kernel.{name}{call}`", ", ".join(sorted(used.get(name, ()))) or "—", doc or "—"))
    return "\n".join(rows) + "\n"


def constant_comment(module: str, name: str) -> str:
    """The ``#:`` comment above ``name = ...`` in ``module`` (for constants, which have no docstring), or the
    module that defines ``name`` when ``module`` only re-exports it."""
    source = inspect.getsource(importlib.import_module(module))
    if match := re.search(rf"((?:^#:.*\n)+)^{name}\b", source, re.M):
        return " ".join(line[2:].strip() for line in match.group(1).splitlines())
    for block in re.finditer(r"^\s*from (accel[.\w]*) import (\([^)]*\)|.*)", source, re.M):
        if re.search(rf"\b{name}\b", block.group(2)):
            return constant_comment(block.group(1), name)
    return ""


def kernel_imports_block() -> str:
    """Every name of :mod:`accel.spi` (the only module plugins import from accel), with the plugins of this
    repository that import it and its docstring's first paragraph. A plugin importing from accel a name that
    accel.spi lacks fails the generator."""
    import accel.spi as spi

    used: dict[str, set[str]] = {}
    for plugin, tree in plugin_sources():
        for node in ast.walk(tree):
            # accel.spi's own names; its submodules (accel.spi.sharded) have sections of their own
            if isinstance(node, ast.ImportFrom) and node.module in ("accel", "accel.spi"):
                for alias in node.names:
                    if importlib.util.find_spec(f"accel.spi.{alias.name}") is None:
                        used.setdefault(alias.name, set()).add(plugin)
    if outside := sorted(set(used) - set(spi.__all__)):
        raise SystemExit(
            f"docs/generate.py: plugins import {outside} from accel, which accel.spi does not export: add them there"
        )
    rows = ["| name | used by | what it is |", "|---|---|---|"]
    for name in spi.__all__:
        obj = getattr(spi, name)
        doc = first_paragraph(obj) if inspect.isclass(obj) or inspect.isroutine(obj) else ""
        if obj.__class__.__name__ == "HookimplMarker":
            doc = "pluggy's marker of a hook implementation of project `accel` (see hooks.md)"
        elif obj.__class__.__name__ == "HookspecMarker":
            doc = "pluggy's marker of a hook specification of project `accel` (for a plugin that adds hooks)"
        elif not doc:
            doc = constant_comment(spi._LAZY.get(name, "accel.spi"), name)
        rows.append(row(f"`{name}`", ", ".join(sorted(used.get(name, ()))) or "—", doc or "—"))
    return "\n".join(rows) + "\n"


#: The kernel's launch settings an ``accel_launch`` answer must carry out or refuse, with the values that ask the
#: launcher for nothing (a launcher that cannot honour a setting refuses it unless it has such a value).
LAUNCH_SETTINGS = {
    "num_processes": "— (every launcher honours it: processes over all machines)",
    "num_machines": "`1`",
    "machine_rank": "`0`",
    "main_process_ip": "unset",
    "main_process_port": "unset (the launcher picks a free port)",
    "rdzv_backend": "`static`",
    "rdzv_conf": "unset",
    "max_restarts": "`0`",
    "monitor_interval": "— (how often the launcher polls; any value may be honoured or ignored)",
    "gpu_ids": "unset or `all`",
    "num_cpu_threads_per_process": "unset",
    "enable_cpu_affinity": "`false` (`accel launch` already turns it off, with a notice, without a GPU)",
    "tee": "unset or `0`",
    "log_dir": "unset",
    "role": "`default`",
    "main_training_function": "`main` (only launchers that spawn a function rather than run the script use it)",
}


def launch_settings_block() -> str:
    from accel.options import Options, core_options

    options = Options()
    core_options(options)
    rows = [
        "| setting (`plan.settings[...]`) | type | default | what it asks | asks nothing when |",
        "|---|---|---|---|---|",
    ]
    from accel.contract import LAUNCH_UNSET

    if missing := sorted(set(LAUNCH_UNSET) - set(LAUNCH_SETTINGS)):
        raise SystemExit(f"docs/generate.py: LAUNCH_SETTINGS lacks {missing} (in accel.contract.LAUNCH_UNSET)")
    for name, unset in LAUNCH_SETTINGS.items():
        if name not in options:
            raise SystemExit(f"docs/generate.py: LAUNCH_SETTINGS names {name!r}, which is not a kernel option")
        opt = options[name]
        rows.append(row(f"`{name}`", opt.type, f"`{opt.default!r}`", opt.help, unset))
    return "\n".join(rows) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "launch-settings": launch_settings_block,
    "hooks": hooks_block,
    "records": records_block,
    "options": options_block,
    "kernel-members": kernel_members_block,
    "kernel-imports": kernel_imports_block,
}


def render(text: str, cache: dict[str, str]) -> str:
    """``text`` with every generated block replaced by its current content."""

    def fill(match: re.Match[str]) -> str:
        key = match.group(2)
        if key not in BLOCKS:
            raise SystemExit(f"docs/generate.py: unknown generated block {key!r} (known: {', '.join(BLOCKS)})")
        if key not in cache:
            cache[key] = BLOCKS[key]()
        return match.group(1) + "\n" + cache[key].rstrip("\n") + "\n\n" + match.group(4)

    return MARK.sub(fill, text)


def pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if MARK.search(p.read_text(encoding="utf-8")))


def stale_pages() -> dict[Path, str]:
    """Pages whose generated blocks are not what the generator makes now -> the text they should have."""
    cache: dict[str, str] = {}
    stale = {}
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = render(text, cache)
        if new != text:
            stale[page] = new
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page, text in stale.items():
        rel = page.relative_to(ROOT)
        if args.check:
            print(f"{rel} is out of date: run `{COMMAND}`", file=sys.stderr)
        else:
            page.write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
