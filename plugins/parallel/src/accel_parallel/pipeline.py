"""Pipeline parallelism for accel-plugin-parallel, with ``torch.distributed.pipelining``.

Each process of a ``pp`` group keeps only the layers of its stage(s): the model the script built is pruned in place
(layers of other stages become parameter-free :class:`Skip` placeholders, so every kept parameter keeps its name, and
checkpoints written on any mesh load on any other). Each stage is a :class:`StageModule` over the kept modules,
driven by a ``PipelineStage`` and one of torch's schedules. The prepared model (:class:`PipelineModel`) runs the
schedule's whole step (forward and backward of every microbatch) when called with ``labels=``, and returns an output
whose ``.loss`` is the batch loss; ``kernel.backward(loss)`` then has nothing left to do (see docs/parallelism.md).

Split helpers (:func:`split_layers`, :func:`stage_ids`) import no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from accel.spi import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: ``parallelism_config_pp_schedule`` values -> torch's schedule classes (torch.distributed.pipelining).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "zerobubble": "ScheduleZBVZeroBubble",
}
#: Schedules that run two stages on each process (interleaved: stages r and r+pp; zero-bubble V: r and 2pp-1-r).
MULTI_STAGE = ("interleaved1f1b", "zerobubble")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages process ``pp_rank`` of a pipeline of ``pp`` processes runs, in order."""
    if schedule == "interleaved1f1b":
        return [pp_rank, pp_rank + pp]
    if schedule == "zerobubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank]


def split_layers(n_layers: int, n_stages: int, split_points: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges of each stage: at the given split points (indices of the first layer of stages
    1..n-1), else as even as possible, earlier stages taking the extra layers."""
    if split_points:
        points = list(split_points)
        if len(points) != n_stages - 1:
            raise UsageError(
                f"parallelism_config_pp_split_points gives {len(points)} split point(s), but {n_stages} stages "
                f"need {n_stages - 1}"
            )
        if points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_layers:
            raise UsageError(
                f"parallelism_config_pp_split_points {points}: must be increasing layer indices between 1 and "
                f"{n_layers - 1} (the model has {n_layers} layers)"
            )
        bounds = [0, *points, n_layers]
        return list(zip(bounds[:-1], bounds[1:], strict=True))
    if n_layers < n_stages:
        raise UsageError(
            f"the model has {n_layers} layers, fewer than the {n_stages} pipeline stages; lower "
            "parallelism_config_pp_size (or use a schedule with one stage per process)"
        )
    base, extra = divmod(n_layers, n_stages)
    out, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def parse_split_points(names: Sequence[str], container: str) -> list[int]:
    """Layer indices from split-point names (``"model.layers.2"`` or ``"2"``: stage boundary before that layer)."""
    out = []
    for name in names:
        tail = name.removeprefix(container + ".") if container else name
        if not tail.isdigit():
            raise UsageError(
                f"parallelism_config_pp_split_points entry {name!r}: name a layer of {container or 'the model'} "
                f"({container + '.' if container else ''}<index>, e.g. {container + '.' if container else ''}2)"
            )
        out.append(int(tail))
    return out


# ---- the model's layers -------------------------------------------------------------------------------------------


def _skip_class() -> type:
    from torch import nn

    class Skip(nn.Module):
        """A layer another pipeline stage runs: no parameters, passes its first argument through."""

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            return x

    return Skip


@dataclasses.dataclass
class Layout:
    """Where a model's layers are. ``base`` is the Hugging Face base model (None for a plain layer stack);
    ``container`` the qualified name of the layer list; ``before``/``after`` the names (in ``base``) of modules
    that run before the layers (input embedding) and after them (final norm), ``head`` the names (in the model) of
    the modules on top of the base model (the LM head)."""

    layers: Any
    container: str
    base: Any = None
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    head: tuple[str, ...] = ()


def layout(model: nn.Module) -> Layout:
    from torch import nn

    if isinstance(model, nn.Sequential):
        return Layout(model, "")
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and isinstance(getattr(base, "layers", None), nn.ModuleList):
        embed = base.get_input_embeddings()
        before = tuple(n for n, m in base.named_children() if m is embed)
        after = tuple(
            n
            for n, m in base.named_children()
            if m is not embed and n != "layers" and any(True for _ in m.parameters())
        )
        prefix = next(n for n, m in model.named_children() if m is base)
        head = tuple(n for n, m in model.named_children() if m is not base)
        return Layout(base.layers, f"{prefix}.layers", base, before, after, head)
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.Sequential, nn.ModuleList)):
        return Layout(layers, "layers")
    raise UsageError(
        f"parallelism_config_pp_size > 1, but {type(model).__name__} has no layer list to split: pipeline "
        "parallelism splits an nn.Sequential, a model with a `layers` nn.Sequential/nn.ModuleList, or a Hugging "
        "Face model whose base model has `layers`"
    )


def loss_function(model: nn.Module) -> Callable[[Any, Any], Any]:
    """The loss the last stage computes from its output and the labels: the model's ``loss_function`` (Hugging
    Face's, given ``vocab_size``, or the script's ``loss_function(output, labels)``)."""
    fn = getattr(model, "loss_function", None)
    if fn is None:
        raise UsageError(
            f"parallelism_config_pp_size > 1: {type(model).__name__} has no loss_function; the last pipeline stage "
            "computes the loss, so give the model a method loss_function(output, labels) (Hugging Face models "
            "have one)"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None:
        return lambda out, labels: fn(logits=out, labels=labels, vocab_size=vocab)
    return lambda out, labels: fn(out, labels)


def _module_class() -> type:
    from torch import nn

    class StageModule(nn.Module):
        """One pipeline stage: the layers ``[lo, hi)`` of the pruned model, with the input embedding on the first
        stage and the final norm and head on the last (registered here, so FSDP's root is the stage)."""

        def __init__(self, model: nn.Module, lay: Layout, lo: int, hi: int, first: bool, last: bool):
            super().__init__()
            self.layers = nn.ModuleList([lay.layers[i] for i in range(lo, hi)])
            self.first, self.last, self.lay = first, last, lay
            self.sequence_mesh: Any = None  # the tp mesh, with sequence parallelism: activations are Shard(1)
            self.extra = nn.ModuleDict()
            if lay.base is not None:
                for n in lay.before if first else ():
                    self.extra[n] = getattr(lay.base, n)
                for n in lay.after if last else ():
                    self.extra[n] = getattr(lay.base, n)
                for n in lay.head if last else ():
                    self.extra["head_" + n] = getattr(model, n)
            object.__setattr__(self, "model", model)  # not a submodule: its other stages' modules are not ours

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if self.lay.base is None:
                x = args[0] if args else next(iter(kwargs.values()))
                for layer in self.layers:
                    x = layer(x)
                return x
            base = self.lay.base
            # the base model runs this stage's layers, and its final norm only on the last stage (a process may
            # also hold the last stage, whose norm is then in the base model)
            swaps = {"layers": self.layers, **({} if self.last else {n: nn.Identity() for n in self.lay.after})}
            with _swapped(base, swaps):
                if self.first:
                    ids = kwargs.get("input_ids", args[0] if args else None)
                    out = base(input_ids=ids, use_cache=False)
                else:
                    out = base(inputs_embeds=self._from_previous(args[0]), use_cache=False)
            hidden = out[0]
            if self.last:
                for n in self.lay.head:
                    hidden = self.extra["head_" + n](hidden)
            elif self.sequence_mesh is not None:  # to the next stage: this process's sequence shard
                hidden = hidden.to_local()
            return hidden

        def _from_previous(self, x: Any) -> Any:
            if self.sequence_mesh is None:
                return x
            from torch.distributed.tensor import DTensor, Shard

            return DTensor.from_local(x, self.sequence_mesh, (Shard(1),), run_check=False)

    return StageModule


@contextlib.contextmanager
def _swapped(obj: Any, modules: dict[str, Any]) -> Iterator[None]:
    old = {n: obj._modules[n] for n in modules}
    obj._modules.update(modules)
    try:
        yield
    finally:
        obj._modules.update(old)


def prune(model: nn.Module, lay: Layout, keep: set[int], first: bool, last: bool) -> None:
    """Drop, in place, what no stage of this process runs (layers become :class:`Skip`, so names stay)."""
    from torch import nn

    skip = _skip_class()
    for i in range(len(lay.layers)):
        if i not in keep:
            lay.layers[i] = skip()
    if lay.base is not None:
        for n in lay.before if not first else ():
            setattr(lay.base, n, None)
        for n in lay.after if not last else ():
            setattr(lay.base, n, nn.Identity())
        for n in lay.head if not last else ():
            setattr(model, n, None)


# ---- the prepared model -----------------------------------------------------------------------------------------


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the model's LM head uses its input embedding's weight (Hugging Face's ``tie_word_embeddings``)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return False
    embed, head = get_in(), get_out()
    weight = getattr(embed, "weight", None)
    return weight is not None and weight is getattr(head, "weight", None)


class Tie:
    """Tied input/output embeddings on two processes (the first stage's and the last stage's), the Megatron way:
    each holds a copy of the weight, equal at the start (the first stage's is broadcast) and kept equal by summing
    their gradients before each optimizer step (the one-process model sums the embedding's and the head's
    gradients into its one weight). Both copies keep their names, as in a one-process state dict."""

    def __init__(self, group: Any, param: Any, copy: bool):
        self.group, self.param = group, param
        self.copy = copy  # the last stage's copy: clipping leaves it out of the norm (the weight counts once)

    def broadcast(self) -> None:
        """The first stage's weight to the last stage (before tensor parallel and FSDP: whole tensors)."""
        import torch.distributed as dist

        dist.broadcast(self.param.data, group=self.group, group_src=0)

    def reduce_grads(self) -> None:
        """Sum the two copies' gradients (their local shards: both weights are laid out alike, the vocabulary along
        dim 0; a tensor-parallel embedding's gradient comes back replicated, and is sharded like its weight first)."""
        import torch.distributed as dist

        grad, param = self.param.grad, self.param
        if grad is None:
            return
        if hasattr(grad, "to_local"):
            if tuple(grad.placements) != tuple(param.placements):
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            grad = grad.to_local()
        dist.all_reduce(grad, group=self.group)


@dataclasses.dataclass
class PipelineOutput:
    """What the prepared model returns: ``loss`` (the batch's mean loss, on every process of the pipeline); in
    evaluation also ``logits`` (the last stage's output, broadcast to every process of the pipeline)."""

    loss: torch.Tensor
    logits: Any = None


class Pipeline:
    """The schedule of one prepared model on this process, and how to run one step of it."""

    def __init__(
        self,
        schedule: Any,
        loss_fn: Callable[[Any, Any], Any],
        scale: Callable[[Any], Any],
        group: Any,
        last_rank: int,
        stages: list[Any],
    ):
        self.schedule, self.loss_fn, self.scale = schedule, loss_fn, scale
        self.group, self.last_rank, self.stages = group, last_rank, stages
        self.microbatches = 1
        self.name = ""  # the parallelism_config_pp_schedule value
        self.tie: Tie | None = None  # tied embeddings held by this process and another one
        self.sync: Callable[[], bool] = lambda: True  # whether this step ends with an optimizer step
        self.eval_logits = True  # evaluation broadcasts the last stage's logits (parallelism_config_pp_eval_logits)

    def loss(self, out: Any, labels: Any) -> Any:
        """The loss of one microbatch, scaled for the microbatches and for the kernel's gradient accumulation (the
        schedule's own ``scale_grads`` would also divide the gradients accumulated by earlier steps)."""
        return self.scale(self.loss_fn(out, labels)) / self.microbatches

    def step(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], labels: Any, device: Any, train: bool = True
    ) -> PipelineOutput:
        """One schedule step (forward and backward of every microbatch; forward only without ``train``); the batch
        loss, on every pp process, and without ``train`` the logits too."""
        import torch
        import torch.distributed as dist

        rows = labels.shape[0] if hasattr(labels, "shape") and labels.dim() else 0
        if rows % self.microbatches or rows < self.microbatches:
            raise UsageError(
                f"a batch of {rows} sample(s) cannot be split into {self.microbatches} pipeline microbatches; make "
                "the batch each process reads a multiple of parallelism_config_pp_microbatches (--pp_microbatches, "
                "default: the number of stages)"
            )
        losses: list[torch.Tensor] = []
        logits = None
        if train:
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
            if self.tie is not None and self.sync():
                self.tie.reduce_grads()
        elif self.name == "zerobubble":
            raise UsageError(
                "evaluation through the pipeline (a call under torch.no_grad() or in eval mode) is not supported "
                "with parallelism_config_pp_schedule zerobubble: torch 2.13's ScheduleZBVZeroBubble.eval fails "
                "(\"can't steal_bwd_input if this stage doesn't have backward\"); use 1f1b, gpipe or interleaved1f1b"
            )
        else:
            logits = self.schedule.eval(*args, target=labels, losses=losses, **kwargs)
        if losses:  # the loss function's values, summed over microbatches, without the accumulation scaling
            one = torch.ones((), device=device)
            mean = torch.stack([x.detach() for x in losses]).sum() * (one / self.scale(one))
        else:
            mean = torch.zeros((), device=device)
        dist.broadcast(mean, group=self.group, group_src=self.last_rank)
        if not train:
            return PipelineOutput(mean, self.broadcast(logits, device) if self.eval_logits else None)
        loss = mean.detach().requires_grad_(True)
        loss.accel_pipeline_done = True  # type: ignore[attr-defined]  # kernel.backward has nothing left to do
        return PipelineOutput(loss)

    def broadcast(self, logits: Any, device: Any) -> torch.Tensor:
        """The last stage's output (``None`` elsewhere) on every process of the pipeline: its shape and dtype,
        then the tensor, from the last stage."""
        import torch
        import torch.distributed as dist

        if logits is not None and hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        meta: list[Any] = [None if logits is None else (tuple(logits.shape), logits.dtype)]
        dist.broadcast_object_list(meta, group=self.group, group_src=self.last_rank)
        if logits is None:
            logits = torch.empty(meta[0][0], dtype=meta[0][1], device=device)
        logits = logits.detach().contiguous()
        dist.broadcast(logits, group=self.group, group_src=self.last_rank)
        return logits


def wrapper_class() -> type:
    from torch import nn

    class PipelineModel(nn.Module):
        """The model ``prepare`` returns with pp > 1: ``model(*inputs, labels=targets)`` runs one pipeline step
        (forward and backward of every microbatch; forward only under ``torch.no_grad()`` or in eval mode) and
        returns an output whose ``.loss`` is the batch loss."""

        pipeline: Pipeline
        device: Any

        def __init__(self, module: nn.Module, pipeline: Pipeline, device: Any):
            super().__init__()
            self.module = module
            object.__setattr__(self, "pipeline", pipeline)
            object.__setattr__(self, "device", device)

        def forward(self, *args: Any, labels: Any = None, **kwargs: Any) -> PipelineOutput:
            import torch

            if labels is None:
                raise UsageError(
                    "with parallelism_config_pp_size > 1 the prepared model runs the pipeline and returns the loss: "
                    "call it as model(*inputs, labels=targets) and read .loss (outputs other than the loss are not "
                    "returned)"
                )
            train = torch.is_grad_enabled() and self.training  # else forward only (evaluation)
            return self.pipeline.step(args, kwargs, labels, self.device, train)

    return PipelineModel


def build(
    model: nn.Module,
    *,
    pp_mesh: Any,
    schedule: str,
    microbatches: int,
    split_points: Sequence[str],
    device: torch.device,
    scale: Callable[[Any], Any],
    parallelize: Callable[[nn.Module, list[nn.Module]], None],
    sync: Callable[[], bool],
    pair_group: Callable[[int, int], Any],
    eval_logits: bool = True,
) -> nn.Module:
    """Prune ``model`` to this process's stages, apply ``parallelize(model, stage_modules)`` (tensor parallel,
    FSDP), and return the :class:`PipelineModel` around it. ``sync()``: whether a training step ends with an
    optimizer step (tied embeddings sum their gradients then); ``pair_group(a, b)``: this process's group of the
    pp ranks ``a`` and ``b`` of its pipeline (collective: every process calls it). **Collective** over the whole
    mesh."""
    import torch.distributed.pipelining as pipelining

    pp = pp_mesh.size()
    pp_rank = pp_mesh.get_local_rank()
    lay = layout(model)
    n_stages = pp * stages_per_rank(schedule)
    ranges = split_layers(len(lay.layers), n_stages, parse_split_points(split_points, lay.container))
    mine = stage_ids(pp_rank, pp, schedule)
    keep = {i for s in mine for i in range(*ranges[s])}
    first, last = 0 in mine, n_stages - 1 in mine
    loss_fn = loss_function(model)
    model.to(device)
    last_rank = next(r for r in range(pp) if n_stages - 1 in stage_ids(r, pp, schedule))
    tie = None  # tied embeddings on two processes (on one, the model keeps its tie)
    if tied_embeddings(model) and last_rank != 0:
        pair = pair_group(0, last_rank)  # collective: every process
        if pp_rank in (0, last_rank):
            tie = Tie(pair, model.get_input_embeddings().weight, copy=pp_rank != 0)  # type: ignore[operator]
    prune(model, lay, keep, first, last)
    if tie is not None:
        tie.broadcast()
    cls = _module_class()
    modules = [cls(model, lay, *ranges[s], s == 0, s == n_stages - 1) for s in mine]
    parallelize(model, modules)
    if tie is not None:  # the parameter tensor parallel / FSDP made of this process's copy
        embed = model.get_input_embeddings() if first else model.get_output_embeddings()  # type: ignore[operator]
        tie.param = embed.weight
    group = pp_mesh.get_group()
    stages = [pipelining.PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, mine, strict=True)]
    pipeline = Pipeline(None, loss_fn, scale, group, last_rank, stages)
    pipeline.microbatches, pipeline.name = microbatches, schedule
    pipeline.tie, pipeline.sync, pipeline.eval_logits = tie, sync, eval_logits
    sched_cls = getattr(pipelining, SCHEDULES[schedule])
    first_arg = stages if schedule in MULTI_STAGE else stages[0]
    pipeline.schedule = sched_cls(first_arg, microbatches, loss_fn=pipeline.loss, scale_grads=False)
    return wrapper_class()(model, pipeline, device)  # type: ignore[no-any-return]
