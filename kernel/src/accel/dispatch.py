"""How the kernel calls hooks: always through pluggy's hook callers, so every hook obeys the contract's calling rules.

- ``pm.hook.<name>(**kwargs)``: pluggy's own call (first answer wins, or every answer), wrappers included.
- :func:`each_implementation`: for the hooks where the kernel must know *which* plugin answered, or must keep going
  when one implementation raises (discovery hooks, tracking, teardown, checkpoint state): one pluggy call per
  implementation, made through ``pm.subset_hook_caller`` with every other non-wrapper implementation left out. So
  each implementation runs once, the kernel knows whose answer (or exception) it holds, and every wrapper of the
  hook (``@hookimpl(wrapper=True)``) runs around each of those calls and sees its result (a list of at most one
  answer for a broadcast hook).
- Per-step hooks (:class:`HotHooks`): see below.

:class:`PluginManager` is pluggy's manager, counting the call monitors added to it (``add_hookcall_monitoring``,
``enable_tracing``): no private attribute of pluggy is read. ``ACCEL_TRACE_PLUGINS=1`` turns on pluggy's tracing
(:func:`trace_to_stderr`), which prints every hook call, its arguments and its result to stderr.

Per-step hooks resolved once: the kernel calls ``accel_backward``, ``accel_optimizer_step``, ``accel_zero_grad``,
``accel_no_sync``, ``accel_clip_grad_norm`` and ``accel_unscale_gradients`` on (nearly) every training step. Which
implementations answer them cannot change after the components are registered (at ``Kernel()``), so the kernel
looks them up once (again at each ``prepare``) and calls them directly instead of going through pluggy's dispatch
every step (bench/hook_cost.py measures the difference). The semantics are pluggy's: implementations in pluggy's
call order (tryfirst ... trylast, the latest registered first within each group), each given only the arguments it
names; for ``firstresult`` hooks the first non-``None`` answer wins, ``accel_unscale_gradients`` calls every
implementation. A hook with a wrapper implementation keeps pluggy's own dispatch, and so does every hook while a
call monitor is on (tracing included) when the hooks are resolved, so tools that watch hook calls see every one.

Where only the kernel's own default answers ``accel_backward``, ``accel_optimizer_step`` and ``accel_zero_grad``
(no plugin takes part, nobody watches), the kernel skips the hook altogether and makes the default's plain PyTorch
call itself (``HotHooks.plain_backward``/``plain_optimizer``): one Python call fewer on each of those per step; the
same for ``accel_clip_grad_norm`` (``plain_clip``) on each step that clips.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from accel import hookspecs
from accel.errors import user_stacklevel
from accel.options import KERNEL

HOT_HOOKS = ("accel_backward", "accel_optimizer_step", "accel_zero_grad", "accel_no_sync", "accel_clip_grad_norm")
HOT_BROADCAST_HOOKS = ("accel_unscale_gradients",)  # everyone answers; results unused


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``accel`` hooks, which knows whether someone watches hook calls (``monitors``: the
    call monitors added with ``add_hookcall_monitoring``/``enable_tracing`` and not undone yet)."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.monitors = 0
        #: the hook specifications plugins added (``accel_hookspecs``), after the contract's own
        self.plugin_specs: list[Any] = []
        super().add_hookspecs(hookspecs)

    def add_hookspecs(self, module_or_class: Any) -> None:
        """pluggy's ``add_hookspecs``, remembering the specifications (so component classes are checked against
        them too, :func:`accel.plugins.class_problem`)."""
        try:
            super().add_hookspecs(module_or_class)
        except pluggy.PluginValidationError:  # the specs are added; an implementation registered earlier is invalid
            self.plugin_specs.append(module_or_class)
            raise
        self.plugin_specs.append(module_or_class)

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Callable[[], None]:
        undo = super().add_hookcall_monitoring(before, after)
        self.monitors += 1
        done = False

        def undo_and_count() -> None:
            nonlocal done
            undo()
            if not done:
                done = True
                self.monitors -= 1

        return undo_and_count


def trace_to_stderr(pm: pluggy.PluginManager) -> Callable[[], None]:
    """pluggy's tracing of every hook call (name, arguments, result), written to stderr. Returns the undo."""
    pm.trace.root.setwriter(sys.stderr.write)
    return pm.enable_tracing()


class Implementation:
    """One non-wrapper implementation of a hook, callable on its own through pluggy (with the hook's wrappers)."""

    __slots__ = ("impl", "caller", "firstresult")

    def __init__(self, impl: pluggy.HookImpl, caller: pluggy.HookCaller, firstresult: bool) -> None:
        self.impl, self.caller, self.firstresult = impl, caller, firstresult

    @property
    def plugin(self) -> Any:
        """The plugin object (a module or a component) that implements the hook."""
        return self.impl.plugin

    @property
    def plugin_name(self) -> str:
        """The name the plugin is registered under (``"ddp"``, ``"ddp:strategy"``, ``"accel"`` for the kernel)."""
        return self.impl.plugin_name

    def __call__(self, **kwargs: Any) -> Any:
        """This implementation's answer, or ``None`` when it answered nothing (or a wrapper took its answer away).
        Exceptions propagate (through the wrappers, which see them as pluggy throws them)."""
        result = self.caller(**kwargs)
        if self.firstresult:
            return result
        return result[0] if result else None


def each_implementation(pm: pluggy.PluginManager, name: str) -> Iterator[Implementation]:
    """Every non-wrapper implementation of hook ``name`` in pluggy's call order, each callable on its own through
    pluggy: ``for one in each_implementation(pm, "accel_save_state"): answer = one(kernel=k, ...)``. Every wrapper of
    the hook runs around each call; pluggy's tracing and call monitors see each call. Use it where the kernel needs
    to know which plugin answered or must isolate one plugin's failure; call ``pm.hook.<name>`` otherwise."""
    caller = getattr(pm.hook, name)
    firstresult = bool(caller.spec is not None and caller.spec.opts.get("firstresult"))
    impls = [impl for impl in reversed(caller.get_hookimpls()) if not (impl.wrapper or impl.hookwrapper)]
    for impl in impls:
        others = [other.plugin for other in impls if other.plugin is not impl.plugin]
        yield Implementation(impl, pm.subset_hook_caller(name, others), firstresult)


# ---------------------------------------------------------------------------------------------------------------
# Per-step hooks


def _monitored(pm: pluggy.PluginManager) -> bool:
    """Whether someone watches hook calls (only accel's :class:`PluginManager` can tell)."""
    return getattr(pm, "monitors", 0) > 0


def _plan(pm: pluggy.PluginManager, caller: Any) -> list[tuple[Callable[..., Any], tuple[str, ...]]] | None:
    """(function, argument names) of each implementation in pluggy's call order; None where pluggy must dispatch
    (a wrapper implementation, or call monitoring/tracing on)."""
    impls = caller.get_hookimpls()
    if _monitored(pm) or any(impl.hookwrapper or impl.wrapper for impl in impls):
        return None
    return [(impl.function, tuple(impl.argnames)) for impl in reversed(impls)]


def resolve_firstresult(pm: pluggy.PluginManager, name: str) -> Callable[..., Any]:
    """A callable taking the hook's keyword arguments and returning its first non-None answer."""
    caller = getattr(pm.hook, name)
    plan = _plan(pm, caller)
    if plan is None:
        return caller
    if len(plan) == 1:
        function, argnames = plan[0]
        if set(argnames) == set(caller.spec.argnames):  # takes every argument: call it as it is
            return function

        def call_one(**kwargs: Any) -> Any:
            return function(*[kwargs[a] for a in argnames])

        return call_one

    def call_first(**kwargs: Any) -> Any:
        for function, argnames in plan:
            result = function(*[kwargs[a] for a in argnames])
            if result is not None:
                return result
        return None

    return call_first


def resolve_each(pm: pluggy.PluginManager, name: str) -> Callable[..., Any]:
    """A callable taking the hook's keyword arguments that calls every implementation in pluggy's order (for hooks
    whose results are not used)."""
    caller = getattr(pm.hook, name)
    plan = _plan(pm, caller)
    if plan is None:
        return caller
    if not plan:
        return _nothing

    def call_each(**kwargs: Any) -> None:
        for function, argnames in plan:
            function(*[kwargs[a] for a in argnames])

    return call_each


def _kernel_only(pm: pluggy.PluginManager, name: str) -> bool:
    """Whether only the kernel's own default implements hook ``name`` (and nobody watches hook calls): the kernel
    may then skip the hook and make the default's plain PyTorch call itself."""
    impls = getattr(pm.hook, name).get_hookimpls()
    return not _monitored(pm) and all(impl.plugin_name == KERNEL for impl in impls)


def _nothing(**kwargs: Any) -> None:
    """A broadcast hook nobody implements."""


class HotHooks:
    """The resolved per-step hooks of one kernel (attributes named after the hooks, without ``accel_``)."""

    backward: Callable[..., Any]
    optimizer_step: Callable[..., Any]
    zero_grad: Callable[..., Any]
    no_sync: Callable[..., Any]
    clip_grad_norm: Callable[..., Any]
    unscale_gradients: Callable[..., Any]
    #: False when only the kernel's own ``accel_no_sync`` (a null context) answers: ``accumulate()`` then enters
    #: nothing on the steps that skip synchronisation.
    no_sync_needed: bool
    #: True when only the kernel's own ``accel_backward`` answers: ``Kernel.backward`` then makes the default's
    #: call (``kernel.scale_for_accumulation(loss).backward()``) itself, one function call fewer per step.
    plain_backward: bool
    #: True when only the kernel's own ``accel_optimizer_step`` and ``accel_zero_grad`` answer: a prepared
    #: optimizer then calls the user's ``optimizer.step()``/``zero_grad()`` itself.
    plain_optimizer: bool
    #: True when only the kernel's own ``accel_clip_grad_norm`` answers: ``Kernel.clip_grad_norm_`` then calls
    #: ``torch.nn.utils.clip_grad_norm_`` itself.
    plain_clip: bool
    #: False when nothing implements ``accel_unscale_gradients`` (and nobody watches hook calls): the kernel then
    #: calls nothing for it (``clip_grad_norm_`` on every sync step).
    unscale_needed: bool

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.no_sync_needed = not _kernel_only(pm, "accel_no_sync")
        self.plain_backward = _kernel_only(pm, "accel_backward")
        self.plain_optimizer = _kernel_only(pm, "accel_optimizer_step") and _kernel_only(pm, "accel_zero_grad")
        self.plain_clip = _kernel_only(pm, "accel_clip_grad_norm")
        for name in HOT_HOOKS:
            setattr(self, name.removeprefix("accel_"), resolve_firstresult(pm, name))
        for name in HOT_BROADCAST_HOOKS:
            setattr(self, name.removeprefix("accel_"), resolve_each(pm, name))
        self.unscale_needed = self.unscale_gradients is not _nothing


def call_isolated(
    pm: pluggy.PluginManager,
    hook_name: str,
    failed: set[Any],
    is_main_process: bool,
    trackers: bool | None,
    kwargs: dict[str, Any],
) -> None:
    """``kernel.call_isolated``: every implementation of ``hook_name`` called on its own (see there); ``failed``
    holds the tracker names and (plugin, hook) pairs that raised, skipped from then on."""
    for one in each_implementation(pm, hook_name):
        tracker = getattr(one.plugin, "role", None) == "tracker"
        if trackers is not None and tracker != trackers:
            continue
        key: Any = one.plugin_name if tracker else (one.plugin_name, hook_name)
        if key in failed:
            continue
        if tracker and getattr(one.plugin, "main_process_only", True) and not is_main_process:
            continue
        try:
            one(**kwargs)
        except Exception as exc:  # logging and teardown must never stop training
            failed.add(key)
            who = f"tracker {one.plugin.name!r}" if tracker else f"plugin {one.plugin_name!r}"
            warnings.warn(
                f"{who} failed in {hook_name} and is skipped from now on: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
