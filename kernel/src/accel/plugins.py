"""Plugin discovery, control and resolution.

- Built-in plugins (:mod:`accel.builtin`, pytest's ``default_plugins``): the kernel's own features, registered
  by name before anything else and listed with status ``built-in``; they answer hooks through pluggy as any plugin.
- Discovery: entry points of group ``accel``, read lazily (on first use, not on ``import accel``). A plugin that
  fails to import is recorded with its error and the rest keep working; it becomes an error only when that
  plugin is asked for. Two distributions claiming one name are both refused, naming both. A plugin whose
  ``accel_unavailable_reason`` answers (backend missing or built for another torch) is ``unavailable``: listed with
  the reason, its options declared, asked only ``accel_activate`` (where it may still take part, e.g. a TPU pod
  launch); asking for it when it does not take part is a UsageError with the reason.
- Control: ``-p no:NAME`` / ``ACCEL_DISABLE_PLUGINS=a,b`` disable plugins; ``ACCEL_PLUGINS=a,b`` loads only those
  (an allow-list; empty means none). ``accel launch`` hands its choices to the workers through the same variables.
- Resolution: each plugin's ``accel_activate`` may return a component; exclusive roles are settled by the user's
  explicit choice or reported as a conflict; what the settings need (``distributed``, ``precision:bf16``,
  ``compile``) must be provided by an active component, or the error says which plugin to install.

No torch import here.

Why one module of this size: discovery, control and resolution work on the same plugin records and name them in
the same error lines (a failed import is reported when that plugin is asked for, a conflict names both
distributions); split, each part would reach into the others' state.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from accel import hookspecs
from accel.builtin import BUILTIN_PLUGINS, DISTRIBUTION, is_builtin
from accel.contract import EXCLUSIVE_ROLES, Component, HardwareInfo
from accel.deprecations import deprecated_hooks_note, hook_suggestion, removed_hooks
from accel.dispatch import PluginManager, each_implementation, trace_to_stderr
from accel.errors import PluginError, UsageError
from accel.options import (
    KERNEL,
    Options,
    Settings,
    core_options,
    did_you_mean,
    install_hint,
    known_capabilities,
    known_plugins,
    providers_of,
    provides,
)
from accel.version import kernel_version

GROUP = "accel"


@dataclass
class PluginRecord:
    """What ``accel plugins`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    value: str
    #: loaded | unavailable (registered; its backend cannot run here) | disabled | failed | built-in
    status: str = "loaded"
    reason: str = ""
    module: Any = None
    hooks: list[str] = field(default_factory=list)
    #: what its component classes (``accel_components``) provide: ``precision:<mode>``, ``compile:<backend>``, ...
    provides: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "module"}


def _csv(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def plugin_filter(env: Mapping[str, str], blocked: Iterable[str] = ()) -> tuple[set[str], set[str] | None]:
    """(disabled names, allow-list or None) from ``-p no:`` values and the environment."""
    disabled = set(blocked) | set(_csv(env.get("ACCEL_DISABLE_PLUGINS")))
    allow = set(_csv(env.get("ACCEL_PLUGINS"))) if "ACCEL_PLUGINS" in env else None
    return disabled, allow


def unknown_plugin_names(env: Mapping[str, str], blocked: Iterable[str], installed: Iterable[str]) -> list[str]:
    """One warning line for each name in ``-p no:NAME``, ``ACCEL_DISABLE_PLUGINS`` or ``ACCEL_PLUGINS`` that is neither
    an installed plugin nor a published one (a typo there would otherwise silently keep the plugin on, or load
    nothing). A published plugin that is not installed here is no mistake: one environment may serve machines with
    different plugins."""
    names = sorted(set(installed))
    published = known_plugins()["plugins"]
    where = [(f"-p no:{name}", name) for name in blocked]
    where += [(f"ACCEL_DISABLE_PLUGINS={name}", name) for name in _csv(env.get("ACCEL_DISABLE_PLUGINS"))]
    where += [(f"ACCEL_PLUGINS={name}", name) for name in _csv(env.get("ACCEL_PLUGINS"))]
    return [
        f"{given} names no plugin, so it does nothing{did_you_mean(name, sorted({*names, *published}))} "
        f"(installed: {', '.join(names) or 'none'})"
        for given, name in dict.fromkeys(where)
        if name not in names and name not in published
    ]


_MODULES: dict[str, Any] = {}  # entry-point value -> imported module (imports happen once per process)


def scan_entry_points() -> list[PluginRecord]:
    """All entry points of group ``accel``, one record per (name, distribution), without importing anything."""
    records: dict[tuple[str, str], PluginRecord] = {}
    # one parse of each distribution's METADATA (``dist.version`` would read and parse the file again), shared by
    # its entry points: they hold the same Distribution object
    metas: dict[int, Any] = {}
    for ep in md.entry_points(group=GROUP):
        dist = ep.dist
        meta = None if dist is None else metas.get(id(dist))
        if dist is not None and meta is None:
            meta = metas[id(dist)] = dist.metadata
        dist_name = meta["Name"] if meta is not None else "?"
        version = meta["Version"] if meta is not None else "?"
        records.setdefault((ep.name, dist_name), PluginRecord(ep.name, dist_name, version, ep.value))
    return sorted(records.values(), key=lambda r: r.name)


class Plugins:
    """The plugins of this process and the pluggy manager they are registered in."""

    def __init__(
        self, records: list[PluginRecord], pm: pluggy.PluginManager, builtin: Iterable[PluginRecord] = ()
    ) -> None:
        #: the built-in plugins (:mod:`accel.builtin`), in registration order
        self.builtin = list(builtin)
        #: every entry point found, including both sides of a name claimed by two distributions
        self.all_records = list(records)
        #: by name (for a duplicated name, one of the two failed records)
        self.records: dict[str, PluginRecord] = {}
        for rec in records:
            self.records.setdefault(rec.name, rec)
        self.pm = pm
        self.components: list[Component] = []
        self._options: Options | None = None
        #: warnings about the plugin selection (names that match no installed plugin), for the caller to show
        self.warnings: list[str] = []

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        blocked: Iterable[str] = (),
        extra: Iterable[tuple[str, Any]] = (),
    ) -> Plugins:
        """Discover and import plugins. ``extra`` registers (name, module-or-object) pairs directly (tests)."""
        env = os.environ if env is None else env
        blocked = list(blocked)
        disabled, allow = plugin_filter(env, blocked)
        pm = PluginManager()
        if env.get("ACCEL_TRACE_PLUGINS", "").strip().lower() not in ("", "0", "false", "no"):
            trace_to_stderr(pm)
        version = kernel_version()
        builtin = [cls._register_builtin(pm, name, module, version) for name, module in BUILTIN_PLUGINS]
        scanned = scan_entry_points()
        by_name: dict[str, list[PluginRecord]] = {}
        for rec in scanned:
            by_name.setdefault(rec.name, []).append(rec)
        records: list[PluginRecord] = []
        registered: list[tuple[PluginRecord, Any]] = []
        from_env = set(_csv(env.get("ACCEL_DISABLE_PLUGINS")))
        for name, recs in by_name.items():
            records.extend(recs)
            if name in disabled or (allow is not None and name not in allow):
                for rec in recs:
                    rec.status = "disabled"
                    rec.reason = (
                        "disabled by ACCEL_DISABLE_PLUGINS"
                        if name in from_env
                        else f"disabled by -p no:{name}"
                        if name in disabled
                        else "not in ACCEL_PLUGINS"
                    )
                continue
            if len(recs) > 1:  # pluggy would silently keep one: refuse both, naming both
                dists = " and ".join(f"{r.distribution} {r.version}" for r in recs)
                for rec in recs:
                    rec.status, rec.reason = "failed", f"the name {name!r} is claimed by both {dists}; uninstall one"
                continue
            rec = recs[0]
            try:
                module = _MODULES.get(rec.value)
                if module is None:
                    module = md.EntryPoint(name, rec.value, GROUP).load()
                    _MODULES[rec.value] = module
            except (Exception, SystemExit) as exc:  # any import failure of a third-party plugin is isolated
                rec.status, rec.reason = "failed", one_line(f"import failed: {describe_exception(exc)}")
                continue
            registered.append((rec, module))
        for name, obj in extra:
            rec = PluginRecord(name, "(registered directly)", "", "")
            records.append(rec)
            registered.append((rec, obj))
        registered = [(rec, module) for rec, module in registered if cls._register(pm, rec, module)]
        cls._add_hookspecs(pm, registered)  # before any implementation is checked: plugins may implement them
        # one manager for every component class checked below (making one costs more than checking a class)
        scratch = scratch_manager(pm) if any(getattr(m, "accel_components", ()) for _, m in registered) else None
        for rec, module in registered:
            if rec.status == "loaded":
                cls._check_module(pm, rec, module, scratch)
        plugins = cls(records, pm, builtin)
        plugins.warnings = unknown_plugin_names(env, blocked, [r.name for r in records])
        return plugins

    @staticmethod
    def _register_builtin(pm: pluggy.PluginManager, name: str, module_name: str, version: str) -> PluginRecord:
        """Register a built-in plugin module by name, as an installed one is registered (a broken one is a bug
        of accel: its error propagates)."""
        module = importlib.import_module(module_name)
        pm.register(module, name=name)
        pm.trace.root.get("register")(f"built-in plugin {name} ({module_name})")
        hooks = sorted(caller.name for caller in pm.get_hookcallers(module) or [])
        return PluginRecord(name, DISTRIBUTION, version, module_name, "built-in", module=module, hooks=hooks)

    @staticmethod
    def _refuse(pm: pluggy.PluginManager, rec: PluginRecord, module: Any, reason: str) -> None:
        """Unregister a plugin module that breaks the contract and mark its record failed with ``reason``."""
        if pm.get_plugin(rec.name) is module:  # not another plugin that pluggy finds equal to this one
            pm.unregister(name=rec.name)
        rec.status, rec.reason = "failed", one_line(reason)

    @classmethod
    def _register(cls, pm: pluggy.PluginManager, rec: PluginRecord, module: Any) -> bool:
        """Register a plugin module in pluggy (which checks the arguments of the hooks it knows already)."""
        try:
            pm.register(module, name=rec.name)
        except Exception as exc:  # pluggy rejects wrong argument names, duplicate names, ...
            cls._refuse(pm, rec, module, f"invalid hook implementation: {exc}")
            return False
        return True

    @classmethod
    def _add_hookspecs(cls, pm: pluggy.PluginManager, registered: list[tuple[PluginRecord, Any]]) -> None:
        """Add the hooks each registered module names in ``accel_hookspecs`` (``"package.module[:Class]"``). An
        entry that fails to import or holds no hook fails its plugin; an implementation registered earlier that an
        added spec finds invalid fails the implementing plugin."""
        for rec, module in registered:
            listed = getattr(module, "accel_hookspecs", ())
            if isinstance(listed, str):
                cls._refuse(
                    pm,
                    rec,
                    module,
                    f"accel_hookspecs must be a list of strings, got the string {listed!r}; "
                    f"write accel_hookspecs = [{listed!r}]",
                )
                continue
            for spec in listed:
                if rec.status != "loaded":
                    break
                try:
                    mod_name, _, attr = str(spec).partition(":")
                    target = importlib.import_module(mod_name)
                    target = getattr(target, attr) if attr else target
                    problem = hook_names_problem(rec.name, target)
                    if problem:
                        cls._refuse(pm, rec, module, f"accel_hookspecs {spec!r}: {problem}")
                        break
                    pm.add_hookspecs(target)
                except pluggy.PluginValidationError as exc:
                    bad_rec, bad_module = next(((r, m) for r, m in registered if m is exc.plugin), (rec, module))
                    cls._refuse(pm, bad_rec, bad_module, f"invalid hook implementation: {exc}")
                except (Exception, SystemExit) as exc:
                    cls._refuse(pm, rec, module, f"accel_hookspecs {spec!r}: {describe_exception(exc)}")

    @classmethod
    def _check_module(
        cls, pm: pluggy.PluginManager, rec: PluginRecord, module: Any, scratch: PluginManager | None = None
    ) -> None:
        """Check a registered plugin module against the contract (its hooks and its component classes) and ask it
        ``accel_unavailable_reason``; on any violation unregister it and mark the record failed. ``scratch``: the
        manager its classes are checked in (:func:`class_problem`)."""

        def refuse(reason: str) -> None:
            cls._refuse(pm, rec, module, reason)

        problem = contract_problem(pm, module, "")
        if problem:
            refuse(problem)
            return
        hooks = sorted(caller.name for caller in pm.get_hookcallers(module) or [])
        runtime = [h for h in hooks if h not in hookspecs.DISCOVERY_HOOKS]
        if runtime:
            refuse(
                f"implements runtime hook(s) {', '.join(runtime)} at module level; implement them on the "
                "Component returned by accel_activate"
            )
            return
        classes = component_classes(module)
        for component in classes:  # checked now, as Kernel() would, so `accel plugins` shows the plugin failed
            problem = class_problem(component, pm, scratch)
            if problem:
                refuse(problem)
                return
        rec.module = module
        rec.hooks = hooks + component_hooks(classes)
        rec.reason = deprecated_hooks_note(rec.hooks)  # shown next to its status in `accel plugins`
        rec.provides = sorted({cap for component in classes for cap in getattr(component, "provides", ())})
        for one in each_implementation(pm, "accel_unavailable_reason"):
            if one.plugin is not module:
                continue
            try:
                reason = one()
            except (Exception, SystemExit) as exc:
                refuse(f"accel_unavailable_reason failed: {describe_exception(exc)}")
                return
            if reason:
                rec.status, rec.reason = "unavailable", one_line(reason)

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def loaded(self) -> list[str]:
        return [n for n, r in self.records.items() if r.status == "loaded"]

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.all_records if r.status == "failed"]

    def unavailable(self) -> dict[str, str]:
        """Why each installed plugin that is not loaded cannot be used, by name (for config-file notes)."""
        return {r.name: f"{r.status}: {r.reason}" for r in self.all_records if r.status != "loaded"}

    def describe_installed(self) -> str:
        """``"ddp, hello, broken (failed)"``: every installed plugin, with its status when it is not loaded."""
        names = [r.name if r.status == "loaded" else f"{r.name} ({r.status})" for r in self.all_records]
        return ", ".join(names) or "none"

    def call_each(
        self, hook: str, isolate: Callable[[str], bool] | None = None, skip: Iterable[str] = (), **kwargs: Any
    ) -> list[tuple[str, Any]]:
        """Call every implementation of a discovery hook one at a time; return (plugin name, result) pairs.
        An exception is re-raised as a PluginError naming the plugin (a UsageError keeps its type), except for
        plugins ``isolate`` answers true for: those are marked failed and left out (``self.fail``). Unavailable
        plugins are asked only ``accel_activate`` (they may take part without their backend, e.g. a TPU pod
        launch that runs only gcloud here). Plugins named in ``skip`` are not asked."""
        results = []
        unusable = {r.name for r in self.all_records if r.status == "unavailable" and hook != "accel_activate"}
        unusable.update(skip)
        for one in each_implementation(self.pm, hook):
            name = one.plugin_name
            if name in unusable:
                continue
            try:
                results.append((name, one(**kwargs)))
            except UsageError as exc:
                raise UsageError(f"{exc}" if is_builtin(name) else f"plugin {name!r}: {exc}") from None
            except KeyboardInterrupt:
                raise
            except (Exception, SystemExit) as exc:
                if not is_builtin(name) and isolate is not None and isolate(name):
                    self.fail(name, f"{hook} failed: {describe_exception(exc)}")
                    continue
                if isinstance(exc, PluginError):
                    raise
                raise PluginError(f"plugin {name!r} failed in {hook}: {describe_exception(exc)}") from exc
        return results

    def fail(self, name: str, reason: str) -> None:
        """Leave plugin ``name`` out of this process: unregister it, drop its options, record it as failed with
        ``reason`` (shown by ``accel plugins``, in launch notices, and in the error when it is asked for)."""
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        if self._options is not None:
            self._options.remove_plugin(name)
        for rec in self.all_records:
            if rec.name == name and rec.status in ("loaded", "unavailable"):
                rec.status, rec.reason = "failed", one_line(reason)

    def options(self) -> Options:
        """The kernel's options plus every loaded plugin's. A plugin whose ``accel_add_options`` raises (other than
        a PluginError such as declaring a name another plugin declared) is left out (``fail``): it must not block
        runs that do not use it; asking for it names the error."""
        if self._options is None:
            options = Options(declared={r.name: frozenset(r.provides) for r in self.all_records})
            core_options(options)
            failures: list[tuple[str, str]] = []
            for one in each_implementation(self.pm, "accel_add_options"):
                name = options.current_plugin = one.plugin_name
                try:
                    one(options=options)
                except PluginError:
                    raise
                except KeyboardInterrupt:
                    raise
                except (Exception, SystemExit) as exc:
                    if is_builtin(name) or name not in self.records:
                        raise PluginError(
                            f"plugin {name!r} failed in accel_add_options: {describe_exception(exc)}"
                        ) from exc
                    failures.append((name, f"accel_add_options failed: {describe_exception(exc)}"))
                    options.remove_plugin(name)
            options.current_plugin = KERNEL
            self._options = options
            for name, reason in failures:
                self.fail(name, reason)
        return self._options

    def detect_hardware(self, env: Mapping[str, str] | None = None) -> HardwareInfo:
        env = os.environ if env is None else env
        answers = [r for _, r in self.call_each("accel_detect_hardware", env=env) if r is not None]
        return max(answers, key=lambda h: h.priority)

    def require(self, name: str, why: str = "") -> PluginRecord:
        """The record of a plugin the user asked for by name, or a UsageError saying how to get it. ``why`` names
        what asked for it when that was not ``--plugin`` (``"distributed_type FSDP"``)."""
        rec = self.records.get(name)
        if rec is None:
            hint = install_hint(name)
            lead = f"{why} needs plugin {name!r}, which is not installed" if why else f"unknown plugin {name!r}"
            tail = f"; install it with `{hint}`" if hint else did_you_mean(name, self.records)
            raise UsageError(f"{lead} (installed: {self.describe_installed()}){tail}")
        if rec.status not in ("loaded", "unavailable"):  # an unavailable plugin refuses in accel_activate itself
            who = f"plugin {name!r} ({rec.distribution} {rec.version})"
            lead = f"{why} needs {who}, which cannot be used" if why else f"{who} cannot be used"
            raise UsageError(f"{lead}: {rec.reason}")
        return rec

    # ---- resolution ----------------------------------------------------------------------------------------

    def activate(self, settings: Settings) -> list[Component]:
        """Ask every plugin whether it takes part, settle roles, check capabilities, register the components."""
        explicit = set(settings.get("plugins") or ())
        for name in settings.selected:
            self.require(name, "" if name in explicit else f"distributed_type {settings.get('distributed_type')}")
        found: list[Component] = []
        # An unselected plugin that raises is left out (it must not block runs that do not ask for it);
        # a selected one's failure is the run's error. A UsageError (a deliberate refusal) always stops the run.
        for name, comp in self.call_each(
            "accel_activate",
            settings=settings,
            isolate=lambda plugin: not settings.is_selected(plugin),
            skip=self._generic_only(settings),
        ):
            if comp is None:
                continue
            if not isinstance(comp, Component):
                raise PluginError(f"plugin {name!r}: accel_activate must return an accel.Component or None")
            comp.name = comp.name or name
            found.append(comp)
        for role in EXCLUSIVE_ROLES:
            claims = [c for c in found if c.role == role]
            if len(claims) > 1:
                chosen = [c for c in claims if settings.is_selected(c.name) or c.requested]
                if len(chosen) != 1:
                    who = " and ".join(f"{c.name!r} ({self._dist(c.name)})" for c in claims)
                    raise PluginError(
                        f"plugins {who} both want to be the {role}; choose one with --plugin NAME "
                        f"or disable the other with -p no:NAME"
                    )
                found = [c for c in found if c.role != role or c is chosen[0]]
        active = {c.name for c in found}
        self._refuse_unavailable_options(settings, active)
        for name in settings.selected:
            if name not in active:
                rec = self.records.get(name)
                if rec is not None and rec.status == "unavailable":
                    raise UsageError(
                        f"plugin {name!r} ({rec.distribution} {rec.version}) cannot be used here: {rec.reason}"
                    )
                raise UsageError(f"plugin {name!r} was selected but does not take part with these settings")
        strategy = next((c for c in found if c.role == "strategy"), None)
        if strategy is not None and f"precision:{settings.mixed_precision}" in strategy.provides:
            found = [c for c in found if c.role != "precision"]  # the strategy realises this precision itself
        self._check_capabilities(settings, found)
        order = {role: i for i, role in enumerate(EXCLUSIVE_ROLES)}
        found.sort(key=lambda c: order.get(c.role, len(order)), reverse=True)  # LIFO: strategy asked first
        for comp in found:
            try:
                self.pm.register(comp, name=f"{comp.name}:{comp.role}")
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"plugin {comp.name!r}: {one_line(exc)}") from None
            problem = contract_problem(self.pm, comp, type(comp).__name__)
            if problem:
                raise PluginError(f"plugin {comp.name!r}: {problem}")
        try:  # anything else registered with a hook the contract lacks (objects registered directly, in tests)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {self.pm.get_name(exc.plugin)!r}: {one_line(exc)}") from None
        self.components = list(reversed(found))
        return self.components

    def _refuse_unavailable_options(self, settings: Settings, active: set[str]) -> None:
        """A UsageError when the settings set an option of an unavailable plugin that does not take part to
        something other than its default (setting a plugin's own option in a config file asks for that plugin as
        clearly as ``--plugin NAME`` does)."""
        unusable = {r.name: r for r in self.all_records if r.status == "unavailable" and r.name not in active}
        for opt in self.options() if unusable else ():
            rec = unusable.get(opt.plugin)
            if rec is None or opt.name not in settings.values or settings[opt.name] == opt.default:
                continue
            source = settings.sources.get(opt.name, "")
            labels = {
                "flag": f"--{opt.name}",
                "argument": f"Kernel({opt.name}=...)",
                "file": f"config key `{opt.dotted}`",
                "launch": f"`{opt.name}` (from accel launch)",
            }
            where = labels.get(source) or (
                f"environment variable {source[4:]}" if source.startswith("env ") else f"`{opt.name}`"
            )
            raise UsageError(
                f"{where} needs plugin {rec.name!r} ({rec.distribution} {rec.version}), which cannot "
                f"be used: {rec.reason}"
            )

    def _generic_only(self, settings: Settings) -> set[str]:
        """Plugins not asked ``accel_activate``: for a mode the settings ask for that an installed plugin declares
        by name (``compile:graphcount``), those that declare only its kind (``compile``: every backend) and were not
        selected. A mode named is its declarer's."""
        loaded = [r for r in self.all_records if r.status == "loaded"]
        skip: set[str] = set()
        for capability, _ in mode_needs(settings):
            if any(capability in r.provides for r in loaded):
                kind = capability.partition(":")[0]
                skip.update(
                    r.name
                    for r in loaded
                    if kind in r.provides and capability not in r.provides and not settings.is_selected(r.name)
                )
        return skip

    def _dist(self, name: str) -> str:
        rec = self.records.get(name)
        return f"{rec.distribution} {rec.version}".strip() if rec else "registered directly"

    def _check_capabilities(self, settings: Settings, found: list[Component]) -> None:
        needs: list[tuple[str, str]] = []
        if settings.world_size > 1:
            needs.append(("distributed", f"running {settings.world_size} processes"))
        needs += mode_needs(settings)
        for tracker in settings.get("log_with") or []:
            if tracker != "all":  # "all": whichever trackers are installed
                needs.append((f"tracker:{tracker}", f"log_with={tracker!r}"))
        for capability, why in needs:
            if any(provides(c.provides, capability) for c in found):
                continue
            names = providers_of(capability)
            names += [r.name for r in self.all_records if provides(r.provides, capability) and r.name not in names]
            own = capability.partition(":")[2]  # "tracker:x": a plugin named x that cannot be used says why
            if own in self.records and self.records[own].status != "loaded" and own not in names:
                names.append(own)
            usable = [n for n in names if n in self.records and self.records[n].status == "loaded"]
            if usable:
                hint = f"select one with --plugin {usable[0]}"
            else:
                blocked = [n for n in names if n in self.records]
                hints = [install_hint(n) for n in names if n not in self.records]
                hint = (
                    f"plugin {blocked[0]!r} is installed but {self.records[blocked[0]].status}: "
                    f"{self.records[blocked[0]].reason}"
                    if blocked
                    else (
                        "install one: " + " or ".join(f"`{h}`" for h in hints)
                        if hints
                        else "no published plugin has it" + did_you_mean(capability, known_capabilities())
                    )
                )
            raise UsageError(f"{why} needs a plugin that provides {capability!r}, and none is active; {hint}")

    def answer_order(self) -> dict[str, tuple[bool, list[str]]]:
        """For each hook: whether the first answer wins, and the plugins that implement it in the order they are
        asked (for ``accel launch --dry-run``)."""
        order = {}
        for name in sorted(n for n in dir(self.pm.hook) if n.startswith("accel_")):
            caller = getattr(self.pm.hook, name)
            firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
            order[name] = (firstresult, [i.plugin_name for i in reversed(caller.get_hookimpls())])
        return order


def mode_needs(settings: Settings) -> list[tuple[str, str]]:
    """(capability, why) for the modes the settings ask for: ``("precision:bf16", "mixed_precision=bf16")``,
    ``("compile:inductor", "dynamo_backend=inductor")``."""
    needs = []
    if settings.mixed_precision != "no":
        needs.append((f"precision:{settings.mixed_precision}", f"mixed_precision={settings.mixed_precision}"))
    backend = str(settings.get("dynamo_backend") or "no")
    if backend.lower() != "no":
        needs.append((f"compile:{backend}", f"dynamo_backend={backend}"))
    return needs


def describe_exception(exc: BaseException) -> str:
    """``"ValueError: bad"``; for ``SystemExit`` (which a plugin must never raise) what it did."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the plugin called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def one_line(text: object) -> str:
    """An error message on one line (pluggy's and some libraries' messages span several)."""
    return " ".join(str(text).split())


def hook_names() -> list[str]:
    """Every hook of the contract."""
    return [n for n in dir(hookspecs) if n.startswith("accel_")]


def contract_problem(pm: pluggy.PluginManager, plugin: Any, what: str) -> str | None:
    """What breaks the contract in a registered plugin's (a module's, ``what=""``, or a component class's, ``what`` its
    name) implementations, in one line, or ``None``: a hook removed from the contract (naming its replacement,
    accel.deprecations), a hook the contract does not have (a misspelling; said with a did-you-mean) unless marked
    ``@hookimpl(optionalhook=True)`` (a hook another plugin may add), or an argument given a default value (pluggy
    never passes those: the implementation would silently always get its default)."""
    callers = pm.get_hookcallers(plugin) or []
    removed = removed_hooks(sorted(c.name for c in callers))
    if removed:
        return (f"{what}: " if what else "") + "; ".join(entry.error_line() for entry in removed)
    unknown = sorted(
        c.name
        for c in callers
        if not c.has_spec() and not all(i.optionalhook for i in c.get_hookimpls() if i.plugin is plugin)
    )
    if unknown:
        specs = hook_names()
        lead = f"{what} implements " if what else ""
        return lead + "; ".join(f"unknown hook {n!r}{hook_suggestion(n, specs)}" for n in unknown)
    for caller in sorted(callers, key=lambda c: c.name):
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and impl.kwargnames:
                return (
                    f"{what + '.' if what else ''}{caller.name} gives argument {impl.kwargnames[0]!r} a default value, and hook "
                    "arguments with defaults are never passed (it would always get its default); remove "
                    "the default"
                )
    return None


def hook_names_problem(plugin: str, target: Any) -> str | None:
    """What is wrong with the names of the hooks ``target`` (a module or class of ``accel_hookspecs``) declares for
    plugin ``plugin``, or None: each must start with ``accel_<plugin>_``, so that it cannot collide with the
    kernel's hooks or another plugin's."""
    prefix = f"{hookspecs.PROJECT}_{plugin.replace('-', '_')}_"
    marker = f"{hookspecs.PROJECT}_spec"
    bad = sorted(n for n in dir(target) if hasattr(getattr(target, n, None), marker) and not n.startswith(prefix))
    if not bad:
        return None
    return (
        f"hook(s) {', '.join(bad)} must be named {prefix}<what> (a plugin's own hooks carry its name); rename "
        f"{bad[0]} to {prefix}{bad[0].removeprefix(hookspecs.PROJECT + '_')}"
    )


def class_problem(
    cls: type, pm: pluggy.PluginManager | None = None, scratch: PluginManager | None = None
) -> str | None:
    """:func:`contract_problem` for a component class, found by registering the class itself in a scratch manager
    (pluggy reads the same methods from the class as from its instances) that has the hooks plugins added to
    ``pm`` (``accel_hookspecs``). ``scratch``: such a manager (:func:`scratch_manager`) to reuse for several
    classes (making one costs more than checking a class); the class is unregistered from it afterwards."""
    scratch = scratch_manager(pm) if scratch is None else scratch
    try:
        scratch.register(cls, name=cls.__qualname__)
    except pluggy.PluginValidationError as exc:
        return f"{cls.__name__}: invalid hook implementation: {exc}"
    try:
        return contract_problem(scratch, cls, cls.__name__)
    finally:
        scratch.unregister(cls)


def scratch_manager(pm: pluggy.PluginManager | None = None) -> PluginManager:
    """A manager with the contract's hooks and those plugins added to ``pm``, for :func:`class_problem`."""
    scratch = PluginManager()
    for specs in getattr(pm, "plugin_specs", ()):
        scratch.add_hookspecs(specs)
    return scratch


def component_classes(module: Any) -> list[type]:
    """The component classes a plugin module lists in ``accel_components`` (optional; strings
    ``"package.module:Class"``) that import; importing them must not import torch. Used to validate them at
    discovery and list their hooks in ``accel plugins``."""
    classes: list[type] = []
    for spec in getattr(module, "accel_components", ()):
        try:
            mod_name, _, cls_name = spec.partition(":")
            classes.append(getattr(__import__(mod_name, fromlist=[cls_name]), cls_name))
        except (Exception, SystemExit):
            continue
    return classes


def component_hooks(classes: Iterable[type]) -> list[str]:
    """Runtime hooks implemented by component classes, for ``accel plugins``."""
    names: list[str] = []
    for cls in classes:
        for attr in dir(cls):
            if attr.startswith("accel_") and hasattr(getattr(cls, attr), hookspecs.PROJECT + "_impl"):
                names.append(attr)
    return sorted(set(names))
