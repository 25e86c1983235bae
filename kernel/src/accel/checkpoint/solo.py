"""``save_state`` reached by the main process alone: Accelerate's (and every diffusers training script's)
``if accelerator.is_main_process: accelerator.save_state(path)``.

Every process entering ``save_state`` first meets the others through the process group's key-value store (the
c10d store behind ``torch.distributed``'s default group; no collective). Meetings are numbered by *slot*: the
number of meetings every process has settled so far (a collective save, or a process that came too late), the same
on every process whatever each passes as the target and however many saves the main process made alone in between.
Each process other than the main one sets its key in the current slot and waits for the slot's decision; the main
process waits at most ``save_join_timeout`` seconds for those keys (:data:`REFUSE_FACTOR` times as long where its
being alone is refused) and then:

- every process came: it decides :data:`ALL` (one ``compare_set`` on the slot's decision key); the collective save
  follows (atomic publish, kill -9 safety, asynchronous saves) and the slot is settled;
- it is alone and the run's state is replicated (no plugin implements ``accel_save_state``): :data:`SOLO`, it writes
  everything shared plus its own per-process items and publishes, with no collective. The slot stays open (a save
  the main process makes alone is not one the others make), and the main process marks it "passed alone";
- it is alone and a plugin writes state itself (a sharded strategy, whose save is a collective), or the save
  numbers its checkpoint automatically (collective in Accelerate too): refused, one line; the slot stays open and
  is marked the same way.

A process that finds the slot marked "passed alone" waits :data:`REFUSE_FACTOR` join windows for the main process
to come back to it (a save on every process right after one the main process made alone), then settles the slot as
:data:`LATE` itself: it came too late for the save the main process made without it. After a solo save it logs
that its random states are not in the checkpoint and goes on; after a refusal it raises the same line. Either way
no process is left waiting: the one that came late is released within those windows, and the main process skips
the settled slot at its next save. A process that waits for a main process that never comes raises after the
store's timeout.

A run without a c10d store (one process, or a strategy whose collectives are not torch.distributed's) skips the
meeting and saves collectively, as before.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import sys
import time
import types
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from accel.checkpoint.items import _component_name, builtin_names
from accel.errors import UsageError
from accel.options import KERNEL

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel

ALL, SOLO, LATE, REFUSED = "all", "solo", "late", "refused:"
#: where being alone is refused, the main process waits this many join windows before it says so; a process that
#: finds its slot passed by the main process alone waits as long for it to come back
REFUSE_FACTOR = 10
#: meetings settled on this process (module-wide: slots stay unique across Kernels of one process group)
_SLOT = [0]


def state_writers(kernel: CheckpointKernel) -> list[str]:
    """The active components other than the kernel that implement ``accel_save_state``: they may claim items and
    write them collectively, so the run's state is not known to be replicated."""
    impls = kernel.plugins.pm.hook.accel_save_state.get_hookimpls()
    builtin = builtin_names(kernel)
    return sorted({_component_name(i, builtin) for i in impls if not (i.wrapper or i.hookwrapper)} - {KERNEL})


def _default_store() -> Any:
    """The c10d store of torch.distributed's default process group, or None (not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def meet(kernel: CheckpointKernel, output_dir: str | os.PathLike[str] | None) -> str:
    """How this ``save_state`` goes: :data:`ALL`, :data:`SOLO` (the main process saves alone) or :data:`LATE` (this
    process came after the main process saved alone: it writes nothing); raises :class:`UsageError` (one line) where
    the main process is alone and the save must be collective, on every process that came."""
    if kernel.num_processes == 1:
        return ALL
    store = _default_store()
    if store is None:
        return ALL
    window = float(kernel.settings.get("save_join_timeout", 5.0))
    if kernel.is_main_process:
        return _main(kernel, store, window, output_dir is None)
    return _other(kernel, store, window)


def _base() -> str:
    return f"accel/save_state/{_SLOT[0]}"


def _main(kernel: CheckpointKernel, store: Any, window: float, automatic: bool) -> str:
    while store.check([f"{_base()}/decision"]):  # settled by processes that came after a save made alone
        _SLOT[0] += 1
    base = _base()
    keys = [f"{base}/{rank}" for rank in range(1, kernel.num_processes)]
    writers = state_writers(kernel)
    refuse = bool(writers) or automatic
    guard = main_only_call()
    waited = 0.0 if guard else window * (REFUSE_FACTOR if refuse else 1)
    if _arrived(store, keys, waited):
        decision = store.compare_set(f"{base}/decision", "", ALL).decode()
        _SLOT[0] += 1
        if decision == ALL:
            return ALL
        # the others gave up on this slot a moment ago (LATE): the main process is alone after all
    absent = [rank for rank, key in enumerate(keys, 1) if not store.check([key])] or list(range(1, len(keys) + 1))
    where = (
        f"save_state: called inside `{guard}`, so the other processes do not call it"
        if guard
        else f"save_state: process(es) {', '.join(map(str, absent))} did not call it within {waited:g} s "
        "(save_join_timeout)"
    )
    decision = SOLO
    if writers:
        decision = (
            f"{REFUSED}{where}; save_state is collective under {', '.join(writers)}: call it on every process, not "
            "inside `if is_main_process`"
        )
    elif automatic:
        decision = (
            f"{REFUSED}{where}; with automatic checkpoint naming save_state is collective (as in Accelerate): call "
            "it on every process, not inside `if is_main_process`"
        )
    store.set(f"{_base()}/alone", decision)
    if decision.startswith(REFUSED):
        raise UsageError(decision[len(REFUSED) :])
    return SOLO


def _other(kernel: CheckpointKernel, store: Any, window: float) -> str:
    base = _base()
    store.set(f"{base}/{kernel.process_index}", "1")
    decision_key, alone_key = f"{base}/decision", f"{base}/alone"
    timeout = getattr(store, "timeout", timedelta(minutes=30)).total_seconds()
    start = time.monotonic()
    if not _until(lambda: store.check([decision_key]) or store.check([alone_key]), timeout):
        raise UsageError(
            f"save_state: process {kernel.process_index} waited {timeout:g} s for the main process, which did not "
            "call it; call save_state on every process, or on the main process alone"
        )
    patience = min(window * REFUSE_FACTOR, max(0.0, timeout - (time.monotonic() - start)))
    if not _until(lambda: store.check([decision_key]), patience):  # the main process passed this slot alone
        store.compare_set(decision_key, "", LATE)  # settles the slot unless the main process just did
    decision = store.get(decision_key).decode()
    _SLOT[0] += 1
    if decision != LATE:
        return decision
    alone = store.get(alone_key).decode()
    if alone.startswith(REFUSED):
        raise UsageError(
            f"save_state: process {kernel.process_index} came after the main process had given up on it ("
            f"{alone[len(REFUSED) :]}); raise save_join_timeout where processes reach save_state far apart"
        )
    logging.getLogger("accel.checkpoint").warning(
        f"save_state: process {kernel.process_index} came more than {window:g} s (save_join_timeout) after the main "
        "process, which saved alone: this process's random states are not in that checkpoint; raise "
        "save_join_timeout where processes reach save_state far apart"
    )
    return LATE


#: the names a script tests the main process with (``accelerator.is_main_process``, ``state.process_index == 0``)
_MAIN_NAMES = frozenset({"is_main_process", "is_local_main_process", "on_main_process", "on_local_main_process"})
_INDEX_NAMES = frozenset({"process_index", "local_process_index"})
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_only_call() -> str | None:
    """The test for the main process that guards the script's call of ``save_state``, read from the script's source,
    or None. The caller is the first frame outside accel; its line counts as guarded when it is in the body of an
    ``if`` whose test reads ``is_main_process`` (or ``is_local_main_process``, ``process_index == 0``), or in a
    function decorated with ``on_main_process``. A decision from the source, not from a wait: the other processes
    will not come, so the main process saves alone at once."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame = frame.f_back
    if frame is None:
        return None
    return _guard(frame.f_code.co_filename, frame.f_lineno)


@functools.lru_cache(maxsize=256)
def _guard(filename: str, line: int) -> str | None:
    try:
        with open(filename, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    found: list[str] = []

    def within(nodes: list[ast.stmt]) -> bool:
        return any(n.lineno <= line <= (n.end_lineno or n.lineno) for n in nodes)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            start, end = getattr(child, "lineno", None), getattr(child, "end_lineno", None)
            if start is None or end is None or not start <= line <= end:
                continue
            if isinstance(child, ast.If) and (
                (within(child.body) and _implies(child.test, True))
                or (within(child.orelse) and _implies(child.test, False))
            ):
                found.append(f"if {ast.get_source_segment(text, child.test)}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.extend(f"@{ast.get_source_segment(text, d)}" for d in child.decorator_list if _is_main(d))
            visit(child)

    visit(tree)
    return found[-1] if found else None


def _is_main(node: ast.AST) -> bool:
    """``x.is_main_process`` (and the like), or ``x.process_index == 0``."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    if name in _MAIN_NAMES:
        return True
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        sides = [node.left, node.comparators[0]]
        index = any(_is_main_index(side) for side in sides)
        zero = any(isinstance(side, ast.Constant) and side.value == 0 for side in sides)
        return index and zero
    return False


def _is_main_index(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in _INDEX_NAMES


def _implies(test: ast.AST, main: bool) -> bool:
    """Whether ``test`` being true (``main=True``; false, ``main=False``) means this is the main process."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _implies(test.operand, not main)
    if isinstance(test, ast.BoolOp):
        each = [_implies(value, main) for value in test.values]
        return any(each) if isinstance(test.op, ast.And) == main else all(each)
    return main and _is_main(test)


def _arrived(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether every key is set within ``seconds``."""
    return _until(lambda: store.check(keys), seconds)


def _until(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled with a growing pause: a timed-out ``store.wait``
    prints c10d's socket warnings on stderr)."""
    deadline = time.monotonic() + seconds
    pause = 0.0002
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True
