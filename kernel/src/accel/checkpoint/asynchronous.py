"""Asynchronous ``save_state``: the kernel's items are copied to CPU memory on the calling thread (into buffers
kept from one save to the next), then written, fsynced and published on a background thread (:class:`_AsyncSave`);
the processes agree on the outcome at the next sync point (:func:`finish_pending`).

With the ``async_save_overlap`` option, the copy of what only a prepared optimizer's step changes (the CPU tensors
of the parameters the optimizers train, and their state) is made by the background thread instead, while the
training loop runs the next forward and backward; every prepared optimizer's ``step`` waits for it (a step pre-hook)
and then checks that none of those tensors was changed in place meanwhile (their version counters, read on the
training thread, where every in-place op it issued has finished). A change found fails the save in one line, never
a torn checkpoint. The contract, documented: do not write to those tensors through ``.data`` (which has a version
counter of its own) between ``save_state`` and the next ``optimizer.step()`` or ``wait_for_save()``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel.checkpoint.files import _Packer, _write_packed, fsync_all, read_json, write_json
from accel.checkpoint.items import Item, _file_stem, _state_of
from accel.checkpoint.manifest import _one_line, _publish
from accel.checkpoint.solo import _until
from accel.contract import ItemRecord
from accel.errors import CheckpointError

if TYPE_CHECKING:
    from accel.checkpoint.items import CheckpointKernel
    from accel.contract import KernelView

#: (after its own are written) before it abandons the save; and, at a sync point where every process reported its
#: files written, how long it waits to see them on the shared file system.
PEER_WAIT_S = 60.0
_MARKER = ".accel-async-rank{}.json"  # in the temporary directory: what a process wrote (or its error)
#: Targets of asynchronous saves that failed at interpreter exit: :func:`exit_if_lost` makes the exit code 1.
_LOST: list[Path] = []


class _Staging:
    """CPU copies of the tensors of asynchronous saves. Kept from one save to the next and refilled in place: a
    fresh allocation is touched page by page on first write, which costs several times the copy itself; the
    price is one checkpoint's worth of CPU memory held while the run saves asynchronously."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.used: set[tuple[str, str]] = set()
        #: overlap mode: the tensors whose copy may be left to the background thread, by data pointer
        self.deferrable: dict[int, torch.Tensor] = {}
        #: (file stem, name, CPU copy, source, owner, owner's version at the call) of the copies left to the thread
        self.pending: list[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []

    def copy(self, stem: str, name: str, t: torch.Tensor) -> torch.Tensor:
        key = (stem, name)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = None
            if t.device.type != "cpu":  # pinned memory: the copy off the device is a direct transfer
                try:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                except RuntimeError:
                    buf = None
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self.buffers[key] = buf
        src = t.detach()
        owner = self.deferrable.get(src.data_ptr()) if src.device.type == "cpu" else None
        if owner is not None and owner.shape == src.shape and owner.dtype == src.dtype and src.is_contiguous():
            self.pending.append((stem, name, buf, src, owner, owner._version))
        else:
            _copy_into(buf, src)
        self.used.add(key)
        return buf

    def forget_unused(self) -> None:
        """Drop buffers this save did not use (an item that went away), so memory follows the current state."""
        self.buffers = {k: v for k, v in self.buffers.items() if k in self.used}
        self.used = set()


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors, one plain memcpy of the bytes (numpy): torch's copy is
    split over its intra-op threads, which on a machine with busy cores wait for each other (bench: 1.5 GiB in
    0.37 s with one thread against 1.5-2.6 s with two on 2 loaded cores)."""
    if src.device.type == "cpu" and src.is_contiguous() and src.numel() and not (src.is_conj() or src.is_neg()):
        try:
            import numpy as np

            np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
            return
        except (RuntimeError, TypeError, ValueError):  # a dtype or layout without a byte view: torch copies it
            pass
    dst.copy_(src)


class _Saver:
    """A Kernel's asynchronous saving: its staging buffers, the save in flight, if any, and (overlap mode) the step
    pre-hooks that make the optimizers wait for its deferred copies."""

    def __init__(self) -> None:
        self.staging = _Staging()
        self.job: _AsyncSave | None = None
        self.hooks: list[Any] = []

    def remove_hooks(self) -> None:
        """On the training thread, never inside a step (torch iterates over the hooks while it runs them)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


def _optimizers(kernel: CheckpointKernel) -> list[torch.optim.Optimizer] | None:
    """The torch optimizers under the kernel's prepared ones; None if one is not a torch optimizer (a plugin's
    engine: its step may not run through torch's step hooks, so nothing is deferred)."""
    out = []
    for prepared in getattr(kernel, "_optimizers", ()):
        inner = getattr(prepared, "optimizer", prepared)
        if not isinstance(inner, torch.optim.Optimizer):
            return None
        out.append(inner)
    return out


def _trained_tensors(optimizers: list[torch.optim.Optimizer]) -> dict[int, torch.Tensor]:
    """What only these optimizers' steps change, by data pointer: their parameters and state tensors (CPU)."""
    found: dict[int, torch.Tensor] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            found.update((p.data_ptr(), p) for p in group["params"] if p.device.type == "cpu")
        for state in opt.state.values():
            found.update(
                (v.data_ptr(), v) for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
            )
    return found


_SAVERS: weakref.WeakKeyDictionary[Any, _Saver] = weakref.WeakKeyDictionary()


class _AsyncSave:
    """One asynchronous save, after the copy off the device. A background thread on every process writes and
    fsyncs that process's files into the temporary directory; a process other than the main one then writes a
    marker file listing them (or its error). The main process's thread waits for every marker, then writes the
    manifest and renames the directory into place exactly as a synchronous save does. The thread issues no
    collective: processes agree on the outcome at the next sync point (:func:`finish_pending`), on the main thread."""

    def __init__(
        self,
        kernel: CheckpointKernel,
        items: Mapping[str, Item],
        records: Mapping[str, ItemRecord],
        target: Path,
        tmp: Path,
        index: int | None,
        packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]],
    ):
        self.kernel, self.items, self.records = kernel, items, records
        self.target, self.tmp, self.index = target, tmp, index
        self.rank, self.world = kernel.process_index, kernel.num_processes
        self.packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] | None = packed
        #: overlap mode: the copies left to this thread (see the module's doc), until :meth:`verify` has checked
        #: them; empty: everything was copied
        self.deferred: list[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self.copied = threading.Event()  # the deferred copies are made: optimizer steps may go on
        self.verified = threading.Event()  # the training thread checked the sources were not changed meanwhile
        self.changed: str | None = None  # what it found changed in place (the save fails)
        self.step_waited = 0.0  # seconds optimizer steps waited for the copies (bench/checkpoint.py reports it)
        self.written = threading.Event()  # this process's files are on disk (or failed: write_error)
        self.write_error: BaseException | None = None
        self.publish_error: BaseException | None = None
        self.published = False
        self.deadline: float | None = None  # the main process stops waiting for the others' markers then
        self.thread = threading.Thread(target=self._run, name=f"accel-save-{target.name}", daemon=True)

    def _run(self) -> None:
        own: dict[str, list[str]] = {}
        time.sleep(0)  # hand the GIL back at once: save_state's thread.start() waits for it (else up to 5 ms)
        try:
            try:
                for _stem, _name, buf, src, _owner, _version in self.deferred:
                    _copy_into(buf, src)
            finally:
                self.copied.set()
            assert self.packed is not None
            for key, (stem, doc, tensors) in self.packed.items():
                own[key] = _write_packed(self.tmp, stem, doc, tensors, sync=False)
            fsync_all(self.tmp / f for files in own.values() for f in files)
            self.verified.wait()
            if self.changed is not None:
                raise CheckpointError(
                    f"{self.changed} was changed in place (not by a prepared optimizer's step) while the asynchronous "
                    "save copied it (async_save_overlap); call kernel.wait_for_save() before changing parameters or "
                    "optimizer states outside optimizer.step()"
                )
            if self.rank != 0:
                write_json(self.tmp / _MARKER.format(self.rank), {"files": own})
        except BaseException as exc:
            self.write_error = exc
            if self.rank != 0:
                try:  # best effort: lets the main process give up early; the sync point agrees anyway
                    write_json(self.tmp / _MARKER.format(self.rank), {"error": _one_line(exc)})
                except Exception:
                    pass
        finally:
            self.packed = None
            self.written.set()
        if self.rank != 0:
            return
        try:
            if self.write_error is not None:
                return
            self._wait_for_peers()
            _publish(self.kernel, self.items, self.records, self.target, self.tmp, self.index)
            self.published = True
        except BaseException as exc:
            self.publish_error = exc

    def discard(self, peers_done: bool) -> None:
        """On the main process, once its thread has ended: remove the temporary directory of a save that was not
        published, but only after every other process has stopped writing into it (a process still writing would
        otherwise re-create files there, or fail on the missing directory). ``peers_done``: a collective said every
        process's files are written or failed; else (at exit) wait for their markers until the deadline."""
        if self.published:
            return
        if not peers_done:
            markers = [self.tmp / _MARKER.format(rank) for rank in range(1, self.world)]
            deadline = self.deadline if self.deadline is not None else time.monotonic() + PEER_WAIT_S
            _until(lambda: not self.tmp.is_dir() or all(m.is_file() for m in markers), deadline - time.monotonic())
        shutil.rmtree(self.tmp, ignore_errors=True)

    def verify(self) -> None:
        """On the training thread (every in-place op it issued has finished, so their version counters are up to
        date): wait for the deferred copies, then check that no source was changed in place since ``save_state``.
        Idempotent; the background thread publishes nothing before it."""
        if self.verified.is_set():
            return
        start = time.perf_counter()
        self.copied.wait()
        self.step_waited += time.perf_counter() - start
        for stem, name, _buf, _src, owner, version in self.deferred:
            if owner._version != version:
                self.changed = f"{stem}: tensor {name!r}"
                break
        self.deferred = []
        self.verified.set()

    def _wait_for_peers(self) -> None:
        """Wait for every other process's marker (its files are written); raise the error one reports."""
        found: dict[int, dict[str, list[str]]] = {}
        while len(found) < self.world - 1:
            for rank in range(1, self.world):
                path = self.tmp / _MARKER.format(rank)
                if rank in found or not path.is_file():
                    continue
                try:
                    data = read_json(path)
                except CheckpointError:
                    continue  # being written
                if "error" in data:
                    raise CheckpointError(f"process {rank} failed: {data['error']}")
                found[rank] = {str(k): [str(f) for f in v] for k, v in data["files"].items()}
            if len(found) < self.world - 1:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    missing = sorted(set(range(1, self.world)) - set(found))
                    raise CheckpointError(
                        f"the files of process(es) {missing} did not appear in {self.tmp} within "
                        f"{PEER_WAIT_S:g} s (the processes must share the file system, and be alive)"
                    )
                time.sleep(0.01)
        for rank in found:
            os.unlink(self.tmp / _MARKER.format(rank))

    def finish_at_exit(self) -> None:
        """At interpreter exit (no collectives any more): wait for this process's files; the main process also
        for the other processes' files (at most :data:`PEER_WAIT_S`), then publishes or abandons. A failure is
        one line on stderr."""
        self.verify()
        self.written.wait()
        if self.rank == 0:
            self.deadline = time.monotonic() + PEER_WAIT_S
            self.thread.join()
            self.discard(peers_done=False)
        error = self.write_error or self.publish_error
        if error is not None:
            _LOST.append(self.target)
            print(
                f"accel: asynchronous save_state to {self.target} failed on process {self.rank}: {_one_line(error)}; "
                "it was not published (the previous checkpoints are unchanged); exit code 1",
                file=sys.stderr,
                flush=True,
            )


def exit_if_lost() -> None:
    """At interpreter exit, once every Kernel is torn down: if an asynchronous save was lost there, end the process
    with exit code 1, so a job that lost its last checkpoint does not look successful. Python gives an exit
    handler no way to change the exit code, so this flushes the standard streams and logging and calls
    ``os._exit(1)``; exit handlers registered before the Kernel was created do not run."""
    if not _LOST:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    logging.shutdown()
    os._exit(1)


def snapshot(
    kernel: CheckpointKernel, items: Mapping[str, Item]
) -> dict[str, tuple[str, Any, dict[str, torch.Tensor]]]:
    """The kernel's items of this process (the main process's, and every process's per-process ones) encoded, with
    CPU copies of their tensors in the kernel's staging buffers: ``{key: (file stem, document, tensors)}``."""
    saver = _SAVERS.setdefault(kernel, _Saver())
    saver.remove_hooks()  # the previous save's (finished: save_state waited for it)
    optimizers = _optimizers(kernel) if kernel.settings.get("async_save_overlap", False) else None
    saver.staging.deferrable = _trained_tensors(optimizers) if optimizers else {}
    saver.staging.pending = []
    packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]] = {}
    for key, item in items.items():
        mine = item.per_rank or kernel.is_main_process
        if item.kind == "model" or mine:
            state = _state_of(kernel, item)  # a model on every process: a sharding strategy may gather here
        if mine:
            stem = _file_stem(item, kernel.process_index)
            packer = _Packer(stage=functools.partial(saver.staging.copy, stem))
            packed[key] = (stem, packer.encode(state), packer.tensors)
    saver.staging.forget_unused()
    return packed


def start_async(
    kernel: CheckpointKernel,
    items: Mapping[str, Item],
    records: Mapping[str, ItemRecord],
    target: Path,
    tmp: Path,
    index: int | None,
    packed: dict[str, tuple[str, Any, dict[str, torch.Tensor]]],
) -> None:
    """Start the background write of what :func:`snapshot` copied, and its publication with ``records``."""
    job = _AsyncSave(kernel, items, records, target, tmp, index, packed)
    saver = _SAVERS.setdefault(kernel, _Saver())
    saver.job = job
    job.deferred = saver.staging.pending
    saver.staging.pending, saver.staging.deferrable = [], {}
    if job.deferred:
        saver.hooks = [opt.register_step_pre_hook(lambda *_: job.verify()) for opt in _optimizers(kernel) or ()]
    else:
        job.copied.set()
        job.verified.set()
    job.thread.start()


def pending_save(kernel: KernelView) -> Path | None:
    """The target of this kernel's asynchronous save in flight (not yet agreed on), or None."""
    saver = _SAVERS.get(kernel)
    return None if saver is None or saver.job is None else saver.job.target


def finish_pending(kernel: KernelView, at_exit: bool = False, release: bool = False) -> None:
    """Finish this kernel's asynchronous save in flight, if any: every process waits for its own files, the
    processes agree (one collective), the main process publishes; a failure anywhere raises the same one-line
    :class:`CheckpointError` on every process, after the temporary directory is removed. Called on every process
    by ``save_state``, ``load_state``, ``latest_checkpoint``, ``end_training`` and ``wait_for_save``; at
    interpreter exit (``at_exit``) without collectives (see :meth:`_AsyncSave.finish_at_exit`). ``release``: also
    free the CPU copies kept for the next save (``end_training``)."""
    saver = _SAVERS.get(kernel)
    job = None if saver is None else saver.job
    if saver is not None and (release or at_exit):
        del _SAVERS[kernel]
    if saver is None or job is None:
        return
    saver.job = None
    if at_exit:
        job.finish_at_exit()
        return
    job.verify()
    saver.remove_hooks()
    job.written.wait()
    messages = kernel.collectives.all_gather_object(None if job.write_error is None else _one_line(job.write_error))
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if job.rank == 0:
        job.deadline = time.monotonic() + (0.0 if failed else PEER_WAIT_S)  # failed: stop waiting for markers
        job.thread.join()
        job.discard(peers_done=True)  # the gather above: every process's background write has ended
    publish = None if failed or job.publish_error is None else _one_line(job.publish_error)
    publish = kernel.collectives.broadcast_object(publish, 0)
    where = f"asynchronous save_state to {job.target} failed on process"
    if failed:
        rank, message = failed[0]
        raise CheckpointError(
            f"{where} {rank}: {message}; it was not published (the previous checkpoints are unchanged)"
        )
    if publish is not None:
        raise CheckpointError(f"{where} 0: {publish}; it was not published (the previous checkpoints are unchanged)")
