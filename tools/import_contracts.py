"""accel's import rules as import-linter contract types (``[tool.importlinter]`` in pyproject.toml; ``make lint``).

- ``only_through``: modules of ``importers`` import from ``target`` nothing but ``allowed`` (and their submodules).
  Plugins import only the plugin API: importers ``accel_*``, target ``accel``, allowed ``accel.spi``. With
  ``allowed`` empty it forbids ``target`` outright (the kernel library never imports ``accel.commands``).
- ``acyclic_modules``: no import cycle among the modules of ``packages``, imports under ``TYPE_CHECKING`` counted
  (grimp records them like any other). import-linter's own ``acyclic_siblings`` compares packages, not modules,
  and does not see a cycle through a package's ``__init__`` (``accel.kernel`` -> ``accel`` -> ``accel.kernel``).

A broken contract lists each offending import as ``importer -> imported (l.N)``.
"""

from __future__ import annotations

from typing import Any

import grimp
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils
from importlinter.domain import helpers


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _names(contract: Contract, field: str) -> list[str]:
    """The module names a contract's module field or list of modules holds (after parsing, a Module or a list)."""
    value: Any = getattr(contract, field) or []
    return [m.name for m in value] if isinstance(value, list) else [value.name]


def _lines(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    return ", ".join(f"l.{d['line_number']}" for d in details) or "?"


class _IgnoringContract(Contract):
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(
        contract_utils.AlertLevel, default=contract_utils.AlertLevel.ERROR
    )

    def _remove_ignored(self, graph: grimp.ImportGraph) -> contract_utils.ImportRemoval:
        return contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=self.unmatched_ignore_imports_alerting,  # type: ignore[arg-type]
        )

    def _check(self, removal: contract_utils.ImportRemoval, found: list[Any], key: str) -> ContractCheck:
        return ContractCheck(
            kept=not found,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={key: found},
        )


class OnlyThroughContract(_IgnoringContract):
    """Modules of ``importers`` (packages; ``excluded`` and its submodules left out) import from ``target`` only
    ``allowed`` and their submodules."""

    type_name = "only_through"

    importers = fields.ListField(subfield=fields.ModuleExpressionField())
    excluded = fields.ListField(subfield=fields.ModuleField(), required=False)
    target = fields.ModuleField()
    allowed = fields.ListField(subfield=fields.ModuleField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = self._remove_ignored(graph)
        [target], allowed, excluded = _names(self, "target"), _names(self, "allowed"), _names(self, "excluded")
        sources = helpers.module_expressions_to_modules(graph, self.importers, as_packages=True)  # type: ignore[arg-type]
        found = []
        for importer in sorted(m.name for m in sources):
            if any(_within(importer, e) for e in excluded):
                continue
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if _within(imported, target) and not any(_within(imported, a) for a in allowed):
                    found.append((importer, imported, _lines(graph, importer, imported)))
        return self._check(removal, found, "imports")

    def render_broken_contract(self, check: ContractCheck) -> None:
        [target], allowed = _names(self, "target"), _names(self, "allowed")
        what = f"only {', '.join(allowed)} of {target}" if allowed else f"nothing of {target}"
        output.print_error(f"These modules may import {what}:")
        output.new_line()
        for importer, imported, lines in check.metadata["imports"]:
            output.print_error(f"-   {importer} -> {imported} ({lines})", bold=False)
        output.new_line()


def import_cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``modules`` (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: no recursion limit on long import chains
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & modules)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


class AcyclicModulesContract(_IgnoringContract):
    """No import cycle among the modules of ``packages`` (type-only imports included)."""

    type_name = "acyclic_modules"

    packages = fields.ListField(subfield=fields.ModuleField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        removal = self._remove_ignored(graph)
        roots = _names(self, "packages")
        modules = {m for m in graph.modules if any(_within(m, r) for r in roots)}
        found = []
        for cycle in import_cycles(graph, modules):
            members = set(cycle)
            edges = [
                (a, b, _lines(graph, a, b))
                for a in cycle
                for b in sorted(graph.find_modules_directly_imported_by(a) & members)
            ]
            found.append(edges)
        return self._check(removal, found, "cycles")

    def render_broken_contract(self, check: ContractCheck) -> None:
        for edges in check.metadata["cycles"]:
            modules = sorted({a for a, _, _ in edges})
            output.print_error(f"Import cycle among {len(modules)} modules ({', '.join(modules)}); its imports:")
            output.new_line()
            for importer, imported, lines in edges:
                output.print_error(f"-   {importer} -> {imported} ({lines})", bold=False)
            output.new_line()
        output.print("Break it: import only what the module uses, or type against a Protocol (accel.contract).")
