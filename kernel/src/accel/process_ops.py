"""The Kernel's process control and collectives on nested data (the part :class:`ProcessOps`, a Kernel's ``_ops``):
``wait_for_everyone``, ``main_process_first``, ``on_*process``, ``split_between_processes``, ``gather``,
``gather_object``, ``gather_for_metrics``, ``reduce``, ``pad_across_processes``, ``broadcast``, and Accelerate's
``profile``, ``set_trigger``, ``check_trigger``."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from accel.active import ProcessKernel
from accel.data_arguments import check_bool
from accel.debug import CheckedCollectives
from accel.errors import DistributedOperationError, UsageError
from accel.nested import map_tensors
from accel.utils.random import rng_kinds

if TYPE_CHECKING:
    from accel.contract import Collectives, Topology
    from accel.gradient_state import GradientState
    from accel.preparing import Prepared


class NotTensorsError(UsageError, TypeError):
    """``gather`` of something that is not tensors: a UsageError (one line) and the TypeError Accelerate raises."""


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def refuse_unpicklable(value: Any) -> None:
    """A UsageError for a ``gather_for_metrics`` value that is neither tensors nor picklable, raised on every process
    before any collective (a pickling error inside ``all_gather_object`` would leave the other processes waiting)."""
    import pickle

    try:
        pickle.dumps(value)
    except Exception as exc:  # PicklingError, TypeError, AttributeError: whatever pickle says, one line
        raise UsageError(
            f"kernel.gather_for_metrics() got {type(value).__name__} {value!r:.60}, which is neither tensors (in "
            f"lists, tuples or dicts) nor an object that can be pickled ({exc}); pass tensors, or picklable "
            "objects (numbers, strings, lists of them)"
        ) from None


def split_share(inputs: Any, num_processes: int, index: int, apply_padding: bool = False) -> Any:
    """Process ``index``'s share of ``inputs`` among ``num_processes`` (see ``Kernel.split_between_processes``)."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values() if hasattr(v, "__len__")}
        if len(lengths) > 1:
            raise UsageError(
                f"split_between_processes: the dict's values have different lengths {sorted(lengths)}; "
                "give values of one length (they are split alike)"
            )
        return type(inputs)(  # type: ignore[call-arg]  # dict, OrderedDict...
            {k: split_share(v, num_processes, index, apply_padding) for k, v in inputs.items()}
        )
    datasets = sys.modules.get("datasets")  # a Dataset's module is imported by whoever made one
    is_dataset = datasets is not None and isinstance(inputs, datasets.Dataset)
    if not (is_dataset or isinstance(inputs, (list, tuple, torch.Tensor))):
        raise UsageError(
            f"split_between_processes got {type(inputs).__name__}, which it does not split (Accelerate hands it "
            "to every process whole); pass a list, tuple, tensor, datasets.Dataset or a dict of them"
        )
    total = len(inputs)
    size, extra = divmod(total, num_processes)
    start = min(index * size + min(index, extra), total)
    end = min(start + size + (1 if index < extra else 0), total)
    pad = (size + (1 if extra else 0) - (end - start)) if apply_padding and total else 0
    if is_dataset:  # rows selected, as Accelerate does (slicing a Dataset gives a dict of columns)
        return inputs.select([*range(start, end), *[total - 1] * pad])
    part = inputs[start:end]
    if not pad:
        return part
    if isinstance(part, torch.Tensor):
        return torch.cat([part, inputs[-1:].expand(pad, *inputs.shape[1:])])
    return part + inputs[-1:] * pad


class OpsKernel(ProcessKernel, Protocol):
    """What :class:`ProcessOps` reads of its Kernel (the run's facts of :class:`accel.active.ProcessKernel`, and
    these)."""

    collectives: Collectives
    gradient_state: GradientState
    device: torch.device
    topology: Topology
    profile_handler: Any  # an accel.utils.ProfileKwargs from kwargs_handlers, or None
    _loader_check_due: bool  # the Kernel's one look for DataLoaders that did not go through prepare
    _prepared: Prepared

    @property
    def is_main_process(self) -> bool: ...
    @property
    def is_local_main_process(self) -> bool: ...
    def gather(self, tensor: Any) -> Any: ...
    def gather_object(self, obj: Any) -> list[Any]: ...
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any: ...


class ProcessOps:
    """A Kernel's part for process control and collectives on nested data (its ``_ops``; the Kernel offers each
    public method under the same name). Calls to members a Kernel subclass may override (``gather``,
    ``wait_for_everyone``...) go through the Kernel."""

    def __init__(self, kernel: OpsKernel) -> None:
        self.kernel = kernel
        self._leaders: list[int] | None = None  # gather_for_metrics: the first process of each data shard, learnt once
        self._trigger: torch.Tensor | None = None  # set_trigger/check_trigger's flag

    @property
    def data_parallel_index(self) -> int:
        """Which data shard this process reads (its process index unless the strategy's topology says otherwise:
        processes of one tensor/context-parallel group read the same shard)."""
        index = self.kernel.topology.data_parallel_index
        return self.kernel.process_index if index is None else index

    @property
    def data_parallel_size(self) -> int:
        """How many data shards there are (the number of processes unless the strategy's topology says otherwise)."""
        size = self.kernel.topology.data_parallel_size
        return self.kernel.num_processes if size is None else size

    @property
    def is_last_process(self) -> bool:
        return self.kernel.process_index == self.kernel.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.kernel.num_processes > 1

    @property
    def debug(self) -> bool:
        """Whether debug mode checks each collective first (accel/debug.py): the ``debug`` setting, and settable
        (Accelerate's ``state.debug = True``). Only a run of several processes has anything to check."""
        return isinstance(self.kernel.collectives, CheckedCollectives)

    @debug.setter
    def debug(self, value: bool) -> None:
        kernel = self.kernel
        if check_bool("kernel.debug", value) and kernel.num_processes > 1 and not self.debug:
            kernel.collectives = CheckedCollectives(kernel.collectives, kernel.process_index)
        elif not value and isinstance(kernel.collectives, CheckedCollectives):
            kernel.collectives = kernel.collectives.inner

    # ---- processes ----------------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Wait until every process reaches this call (a barrier; nothing happens on one process)."""
        self.kernel.collectives.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.kernel.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. downloads), then the others."""
        yield from self._first(self.kernel.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """The main process of each machine runs the block first (e.g. a per-machine cache), then the others."""
        yield from self._first(self.kernel.is_local_main_process)

    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.kernel.wait_for_everyone()
        yield
        if leader:
            self.kernel.wait_for_everyone()

    def on_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``fn`` on the main process only (returns None elsewhere)."""
        return self.on_process(fn, process_index=0)

    def on_local_main_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``fn`` on the main process of each machine only (returns None elsewhere)."""
        return self.on_local_process(fn, local_process_index=0)

    def on_last_process(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``fn`` on the last process only (returns None elsewhere)."""
        return self.on_process(fn, process_index=self.kernel.num_processes - 1)

    def on_process(self, fn: Callable[..., Any] | None = None, *, process_index: int = 0) -> Any:
        """Decorator: run ``fn`` on process ``process_index`` only (returns None elsewhere); usable with or without
        arguments (``@kernel.on_process(process_index=1)``)."""
        if fn is None:
            return functools.partial(self.on_process, process_index=process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.kernel.process_index == process_index else None

        return run

    def on_local_process(self, fn: Callable[..., Any] | None = None, *, local_process_index: int = 0) -> Any:
        """Decorator: run ``fn`` on the process of local index ``local_process_index`` of each machine only (returns
        None elsewhere)."""
        if fn is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.kernel.local_process_index == local_process_index else None

        return run

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of ``inputs`` (the first ``len % N`` processes get one more), as
        Accelerate's: a list, tuple, tensor (along dim 0), ``datasets.Dataset`` (rows, with ``.select()``) or a dict
        of those (each value split alike; the input dict is not modified). A process with no share (more processes
        than elements) gets an empty one. ``apply_padding`` repeats the input's last element so all shares have the
        same length. Other types are refused (Accelerate hands them to every process whole)."""
        yield split_share(inputs, self.kernel.num_processes, self.kernel.process_index, apply_padding)

    def synchronize_rng_states(self, rng_types: Iterable[Any], generator: torch.Generator | None = None) -> None:
        """Every process takes process 0's state of the generators named in ``rng_types`` (Accelerate's names or
        ``RNGType``): ``"torch"`` (the CPU generator), ``"generator"`` (``generator``, which must be given), or the
        run's device type such as ``"cuda"`` (this process's device generator; another device type is refused, as
        Accelerate fails on it). Call it on every process; on one process it changes nothing.
        Also :func:`accel.utils.synchronize_rng_states`."""
        kinds = rng_kinds(rng_types)
        if "generator" in kinds and generator is None:
            raise UsageError('synchronize_rng_states(["generator"]) needs the generator: pass generator=...')
        device = self.kernel.device.type
        other = [kind for kind in kinds if kind not in ("torch", "generator", device)]
        if other:
            raise UsageError(
                f"synchronize_rng_states: rng_types {other} name a device this run does not use (it runs on "
                f'{device}); use "torch", "generator" or "{device}"'
            )
        if self.kernel.num_processes == 1:
            return

        def from_main(state: torch.Tensor) -> torch.Tensor:  # a CPU byte tensor, sent over the run's device
            return self.kernel.collectives.broadcast(state.to(self.kernel.device), 0).cpu()

        for kind in kinds:
            if kind == "torch":
                torch.set_rng_state(from_main(torch.get_rng_state()))
            elif kind == "generator":
                assert generator is not None
                generator.set_state(from_main(generator.get_state()))
            else:
                module = torch.get_device_module(kind)
                module.set_rng_state(from_main(module.get_rng_state()))

    # ---- collectives on nested data -----------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Gather tensors (or nested structures of them) from all processes and concatenate on dim 0, in process
        order. Works when processes hold different numbers of rows."""
        try:
            map_tensors(_same, tensor, strict=True)  # checked whole before any collective
        except TypeError as exc:
            raise NotTensorsError(
                f"kernel.gather() takes tensors (or lists, tuples and dicts of them), {exc.args[0].split(', ')[-1]}; "
                "use kernel.gather_object() for other picklable objects"
            ) from None
        if self.kernel.num_processes == 1:
            return tensor
        return map_tensors(self._gather_one, tensor, strict=True)

    def _shard_leaders(self) -> list[int]:
        """The first process of each data shard, in shard order (collective the first time)."""
        if self._leaders is None:
            shards = self.kernel.collectives.all_gather_object(self.data_parallel_index)
            self._leaders = [shards.index(i) for i in range(self.data_parallel_size)]
        return list(self._leaders)

    def _gather_one(self, tensor: torch.Tensor, keep: list[int] | None = None) -> torch.Tensor:
        if tensor.ndim == 0:
            tensor = tensor[None]
        tensor = tensor.contiguous()
        sizes = [
            int(s.item())
            for s in self.kernel.collectives.all_gather(torch.tensor([tensor.shape[0]], device=tensor.device))
        ]
        top = max(sizes)
        if top != tensor.shape[0]:
            pad = tensor.new_zeros((top - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = self.kernel.collectives.all_gather(tensor)
        pairs = list(zip(parts, sizes, strict=True))
        return torch.cat([p[:s] for p, s in (pairs if keep is None else [pairs[i] for i in keep])])

    def gather_object(self, obj: Any) -> list[Any]:
        """Gather picklable objects; lists are concatenated, other objects collected in a list."""
        parts = self.kernel.collectives.all_gather_object(obj)
        if all(isinstance(p, list) for p in parts):
            return [x for p in parts for x in p]
        return parts

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` for evaluation: on the last batch of an epoch, drops the samples that even batching
        duplicated, so the result over an epoch has exactly ``len(dataset)`` items."""
        if self.kernel._loader_check_due:
            self.kernel._prepared.warn_unprepared_loaders()
        tensors_only = True
        try:
            map_tensors(lambda t: t, input_data, strict=True)
        except TypeError:
            tensors_only = False
        if use_gather_object or not tensors_only:
            refuse_unpicklable(input_data)
        if self.data_parallel_size != self.kernel.num_processes:  # one process's values per data shard
            keep = self._shard_leaders()
            parts = (
                self.kernel.collectives.all_gather_object(input_data)
                if (use_gather_object or not tensors_only)
                else None
            )
            if parts is not None:
                parts = [parts[i] for i in keep]
                data = [x for p in parts for x in p] if all(isinstance(p, list) for p in parts) else parts
            else:
                data = map_tensors(lambda t: self._gather_one(t, keep), input_data, strict=True)
        else:
            data = (
                self.kernel.gather_object(input_data)
                if (use_gather_object or not tensors_only)
                else self.kernel.gather(input_data)
            )
        state = self.kernel.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if isinstance(data, list) and not tensors_only:
                return data[: state.remainder]
            return map_tensors(lambda t: t[: state.remainder], data, strict=True)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce (``"sum"``, ``"mean"``, ``"max"`` or ``"none"``) tensors of a nested structure, then
        multiply by ``scale``. Returns new tensors; inputs are not modified."""
        if reduction not in ("sum", "mean", "max", "none"):
            raise ValueError(f"reduction must be sum, mean, max or none, got {reduction!r}")

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            if reduction != "none" and self.kernel.num_processes > 1:
                self.kernel.collectives.all_reduce(t, "max" if reduction == "max" else "sum")
                if reduction == "mean":
                    t = t / self.kernel.num_processes
            return t * scale if scale != 1.0 else t

        return map_tensors(one, tensor, strict=True)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad tensors along ``dim`` to the largest size over all processes, so they can be gathered."""

        def one(t: torch.Tensor) -> torch.Tensor:
            if self.kernel.num_processes == 1 or t.ndim == 0:
                return t
            d = dim % t.ndim
            sizes = self.kernel.collectives.all_gather(torch.tensor([t.ndim, t.shape[d]], device=t.device))
            ndims = [int(s[0]) for s in sizes]
            if len(set(ndims)) > 1:  # every process sees the same sizes, so every process raises: no hang
                raise DistributedOperationError(
                    f"pad_across_processes: process {self.kernel.process_index} of {self.kernel.num_processes} got tensors of "
                    f"{ndims} dims (by process): every process must pass tensors with the same number of dims"
                )
            top = max(int(s[1]) for s in sizes)
            if top == t.shape[d]:
                return t
            shape = list(t.shape)
            shape[d] = top - t.shape[d]
            pad = t.new_full(shape, pad_index)
            return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

        return map_tensors(one, tensor, strict=True)

    def broadcast(self, data: Any, from_process: int = 0) -> Any:
        """Tensors of process ``from_process`` on every process (in place); other objects via pickling."""
        if self.kernel.num_processes == 1:
            return data
        try:
            return map_tensors(
                lambda t: self.kernel.collectives.broadcast(t.contiguous(), from_process), data, strict=True
            )
        except TypeError:
            return self.kernel.collectives.broadcast_object(data, from_process)

    # ---- profiling and triggers (Accelerate's utilities) --------------------------------------------------

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """``torch.profiler.profile`` built from ``profile_handler`` (an :class:`accel.utils.ProfileKwargs`), else
        the one given in ``kwargs_handlers``, else defaults; yields the profiler (call ``prof.step()`` per step when
        a schedule is set). With ``output_trace_dir`` every process writes ``profile_<process index>.json``
        there at the end, then waits for the others."""
        from accel.utils.handlers import PROFILE_PATTERN_NAME, ProfileKwargs

        handler = profile_handler or self.kernel.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(
            os.path.join(handler.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=self.kernel.process_index))
        )
        self.kernel.wait_for_everyone()

    def set_trigger(self) -> None:
        """Raise this process's flag; the next ``check_trigger`` on every process sees it (no barrier needed)."""
        self._trigger = torch.tensor(1, device=self.kernel.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` since the last check (an all-reduce: call it on every
        process). Resets the flag when it was set."""
        flag = self._trigger
        if flag is None:
            flag = self._trigger = torch.tensor(0, device=self.kernel.device)
        if int(self.kernel.reduce(flag).item()) >= 1:
            self._trigger = torch.tensor(0, device=self.kernel.device)
            return True
        return False
