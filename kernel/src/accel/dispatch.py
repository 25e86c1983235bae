"""Per-step hooks resolved once: the kernel calls ``accel_backward``, ``accel_optimizer_step``, ``accel_zero_grad``,
``accel_no_sync``, ``accel_clip_grad_norm`` and ``accel_unscale_gradients`` on (nearly) every training step. Which
implementations answer them cannot change after the components are registered (at ``Kernel()``), so the kernel
looks them up once (again at each ``prepare``) and calls them directly instead of going through pluggy's dispatch
every step (bench/hook_cost.py measures the difference).

The semantics are pluggy's: implementations in pluggy's call order (tryfirst ... trylast, the latest registered
first within each group), each given only the arguments it names; for ``firstresult`` hooks the first non-``None``
answer wins, ``accel_unscale_gradients`` calls every implementation. A hook with a wrapper implementation keeps pluggy's own dispatch, and so does any hook while pluggy's call
monitoring or tracing is on (``PluginManager.add_hookcall_monitoring``/``enable_tracing``), so tools that watch hook
calls still see every one.

Where only the kernel's own default answers ``accel_backward``, ``accel_optimizer_step`` and ``accel_zero_grad``
(no plugin takes part, nobody watches), the kernel skips the hook altogether and makes the default's plain PyTorch
call itself (``HotHooks.plain_backward``/``plain_optimizer``): one Python call fewer on each of those per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from accel.options import KERNEL

HOT_HOOKS = ("accel_backward", "accel_optimizer_step", "accel_zero_grad", "accel_no_sync", "accel_clip_grad_norm")
HOT_BROADCAST_HOOKS = ("accel_unscale_gradients",)  # everyone answers; results unused


def _monitored(pm: pluggy.PluginManager) -> bool:
    """Whether someone watches hook calls (pluggy swaps the manager's inner executor for that)."""
    inner = getattr(pm, "_inner_hookexec", None)
    return inner is not None and getattr(inner, "__name__", "") != "_multicall"


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

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.no_sync_needed = not _kernel_only(pm, "accel_no_sync")
        self.plain_backward = _kernel_only(pm, "accel_backward")
        self.plain_optimizer = _kernel_only(pm, "accel_optimizer_step") and _kernel_only(pm, "accel_zero_grad")
        for name in HOT_HOOKS:
            setattr(self, name.removeprefix("accel_"), resolve_firstresult(pm, name))
        for name in HOT_BROADCAST_HOOKS:
            setattr(self, name.removeprefix("accel_"), resolve_each(pm, name))
