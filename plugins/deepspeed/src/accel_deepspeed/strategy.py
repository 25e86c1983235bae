"""The DeepSpeed strategy component. torch and deepspeed are imported inside methods, so ``accel launch`` can plan a
run without them.

How the kernel's training loop maps onto the engine (user code stays the DDP script):

- ``prepare(model, optimizer, dataloader, scheduler)`` builds one ``DeepSpeedEngine`` from the model and the
  script's own torch optimizer (the engine steps it on its partitions); the scheduler stays the script's and is
  stepped by the kernel once per optimizer step (it changes the learning rate of that same optimizer).
- ``kernel.backward(loss)`` tells the engine whether this micro-batch ends an accumulation cycle (the kernel's
  ``sync_gradients``: every ``gradient_accumulation_steps``-th step and at the end of an epoch) and runs
  ``engine.backward``, which divides by the same number of steps and reduces/partitions gradients on the last one.
- ``optimizer.step()`` (called by the kernel only on sync steps) is ``engine.step()``; ``zero_grad`` clears the
  engine's gradient partitions. So the kernel's counting decides, and the engine never counts on its own.
- ``clip_grad_norm_(params, max_norm)`` sets the engine's clipping threshold for that step; the engine clips
  inside ``step()`` with the global norm of the same gradients. The tensor returned holds that norm once the step
  ran (the engine computes it there); with ZeRO disabled and fp32 it is computed and clipped right away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.spi import (
    ItemRecord,
    LaunchPlan,
    ProcessGroupComponent,
    Settings,
    UsageError,
    destroy_process_group,
    hookimpl,
    launch_with_torchrun,
    restart_store_args,
    world_of_one,
)
from accel_deepspeed import config as dsconfig
from accel_deepspeed import launcher, ops

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView

#: Launcher variables of MPI-style and SLURM starts: (rank, world size, local rank, local world size).
RANK_VARIABLES = (
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)

LIMIT = (
    "DeepSpeed trains one model per Kernel: its engine owns backward() and the optimizer step of that model, "
    "and accel cannot tell which engine a loss belongs to. Prepare the trained model with its optimizer once; "
    "other models (a teacher, an EMA copy) may be prepared without an optimizer: they are frozen (partitioned "
    "under ZeRO-3). To train two models (a GAN), use the ddp or fsdp plugin"
)


def distributed_env(env: os._Environ[str] | dict[str, str]) -> None:
    """Make sure RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are set (DeepSpeed would otherwise try
    MPI discovery through mpi4py): from torchrun/DeepSpeed's launcher as they are, translated from SLURM or MPI
    variables, or a world of one process for a plain ``python script.py``."""
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", env["RANK"])
        env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
        return
    for rank, size, local_rank, local_size in RANK_VARIABLES:
        if rank in env:
            env.setdefault("RANK", env[rank])
            env.setdefault("WORLD_SIZE", env.get(size, "1"))
            env.setdefault("LOCAL_RANK", env.get(local_rank, "0"))
            env.setdefault("LOCAL_WORLD_SIZE", env.get(local_size, "1").split("(")[0])
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise UsageError(
                    f"started by {rank.split('_')[0]} without MASTER_ADDR/MASTER_PORT: launch with "
                    "`accel launch --plugin deepspeed` (it exports them) or set them"
                )
            return
    world_of_one(env)


def forget_groups() -> None:
    """After the default process group is destroyed: DeepSpeed keeps the groups it built from it (a clone of the
    world group, expert, sequence-parallel and ZeRO++ groups), and the next engine of this process would use them
    ("Group ... is not registered"). DeepSpeed's own reset, the one ``deepspeed.comm.destroy_process_group`` makes
    after destroying the world group (accel destroys it itself, with the pauses of ``destroy_process_group``)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(group=None)


def refuse_fp16_on_cpu(mixed_precision: str, cpu_only: bool) -> None:
    """DeepSpeed accepts fp16 on an accelerator, or on a CPU with AVX512-FP16/AMX; say so before it fails."""
    if mixed_precision != "fp16":
        return
    import torch

    acc = getattr(torch, "accelerator", None)
    on_accelerator = not cpu_only and acc is not None and acc.is_available()
    if not on_accelerator and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        raise UsageError(
            "DeepSpeed refuses fp16 on this CPU (it needs AVX512-FP16 or AMX); use --mixed_precision "
            "bf16, or no mixed precision"
        )


@dataclass
class Prepared:
    """One model this component prepared."""

    module: Any  # the user's module
    wrapper: Any  # what prepare() returned for it (a DeepSpeedModel)
    engine: Any = None  # DeepSpeedEngine, or None for a frozen model left as it is
    optimizer: Any = None  # the user's torch optimizer (the engine's base optimizer), None when frozen
    clip: float = 0.0  # the clipping threshold of the config
    pending_norms: list[Any] = field(default_factory=list)  # tensors returned by clip_grad_norm_, filled at step


class DeepSpeedStrategy(ProcessGroupComponent):
    """Processes, device, engine, training step, checkpoints and launch for DeepSpeed runs."""

    role = "strategy"
    provides = frozenset({"distributed", "sharding", "precision:bf16", "precision:fp16"})  # realised by the engine

    def __init__(self, settings: Settings):
        self.settings = settings
        self.owns_process_group = False
        self.prepared: list[Prepared] = []

    # ---- launching ----------------------------------------------------------------------------------------

    def launch_handoff(self, settings: Settings) -> dict[str, str]:
        """Check the DeepSpeed config against the settings before any process starts; return the environment
        variables that hand the config's gradient accumulation / precision to the Kernel when the Kernel was
        not given its own (as Accelerate does)."""
        config, where = dsconfig.base_config(settings)
        env: dict[str, str] = {}
        gas = settings["gradient_accumulation_steps"]
        ds_gas = dsconfig.explicit_accumulation(config)
        if ds_gas is not None and settings.sources.get("gradient_accumulation_steps") == "default":
            gas = ds_gas
            env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] = str(ds_gas)
        precision = settings.mixed_precision
        ds_precision = dsconfig.explicit_precision(config)
        if ds_precision is not None and settings.sources.get("mixed_precision") == "default":
            precision = ds_precision
            env["ACCEL_MIXED_PRECISION"] = ds_precision
        facts = dsconfig.KernelFacts(gas, precision, settings["num_processes"], dsconfig.placeholder_micro(config))
        dsconfig.fill(config, facts, where)
        refuse_fp16_on_cpu(precision, bool(settings["cpu"]))
        return env

    @hookimpl
    def accel_launch(self, plan: LaunchPlan) -> int:
        settings = plan.settings
        launcher.check_filters(settings)
        ops.check_build_locks(plan.env)  # a stale build lock would make every process wait forever
        env = plan.env
        handoff = self.launch_handoff(settings)
        env.update(handoff)
        if plan.dry_run and handoff:
            print("from the DeepSpeed config to the Kernel: " + " ".join(f"{k}={v}" for k, v in handoff.items()))
        gpu_ids = settings.get("gpu_ids")
        if gpu_ids and str(gpu_ids).lower() != "all":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
        if settings.get("num_cpu_threads_per_process"):
            env["OMP_NUM_THREADS"] = str(settings["num_cpu_threads_per_process"])
        if launcher.uses_runner(settings):
            return self._launch_runner(plan)
        return launch_with_torchrun(plan, "deepspeed")

    def _launch_runner(self, plan: LaunchPlan) -> int:
        from accel.spi import run_process

        settings = plan.settings
        run = launcher.runner_plan(
            settings, plan.command, plan.python or sys.executable, plan.env, no_python=not plan.python
        )
        name = settings["deepspeed_multinode_launcher"]
        if plan.dry_run:
            print(f"launcher: deepspeed ({name} through DeepSpeed's runner): {shlex.join(run.argv)}")
            print("exported to every worker (DS_ENV_FILE):")
            for line in run.env_file_text().splitlines():
                print(f"  {line}")
            return 0
        with tempfile.TemporaryDirectory(prefix="accel-deepspeed-") as tmp:
            env_file = Path(tmp) / "deepspeed_env"
            env_file.write_text(run.env_file_text(), encoding="utf-8")
            env = dict(run.env, DS_ENV_FILE=os.fspath(env_file))
            return run_process(run.argv, env, "DeepSpeed's runner and its processes")

    # ---- process start-up ---------------------------------------------------------------------------------

    @hookimpl
    def accel_setup(self, kernel: KernelView) -> None:
        import torch
        import torch.distributed as dist

        distributed_env(os.environ)
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        acc = getattr(torch, "accelerator", None)
        if not self.settings["cpu"] and acc is not None and acc.is_available():
            kind = acc.current_accelerator().type
            self.device = torch.device(kind, self.local_rank % acc.device_count())
            acc.set_device_index(self.device.index)
        else:
            self.device = torch.device("cpu")
        refuse_fp16_on_cpu(kernel.mixed_precision, self.device.type == "cpu")
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        if ds_logger.getEffectiveLevel() <= logging.INFO and not os.environ.get("ACCEL_DEEPSPEED_VERBOSE"):
            ds_logger.setLevel(
                logging.WARNING
            )  # its config dump and per-step notes; ACCEL_DEEPSPEED_VERBOSE=1 keeps them
        if not dist.is_initialized():
            ops.announce_build(self.local_rank)  # a first run builds an op for minutes: say so, show its output
            backend = "gloo" if self.device.type == "cpu" else None  # None: DeepSpeed's choice for the accelerator
            from deepspeed.accelerator import get_accelerator
            from deepspeed.constants import default_pg_timeout

            restart = restart_store_args(os.environ, default_pg_timeout, "accel-deepspeed")
            if restart:  # a group after an earlier one of this launch: store keys of its own, DeepSpeed adopts it
                backend = backend or get_accelerator().communication_backend_name()
                dist.init_process_group(backend=backend, timeout=default_pg_timeout, **restart)
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
            self.owns_process_group = True

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Any:
        # The engine realises bf16/fp16 itself (low-precision weights, fp32 master weights; declared in provides,
        # so the kernel left the precision plugin out): no autocast, but prepared models still return fp32 outputs.
        return contextlib.nullcontext if f"precision:{kernel.mixed_precision}" in self.provides else None

    @hookimpl
    def accel_teardown(self, kernel: KernelView) -> None:
        for rec in self.prepared:
            if rec.engine is not None:
                rec.engine.destroy()
        self.prepared.clear()
        if self.owns_process_group:
            destroy_process_group()
            forget_groups()

    # ---- building models ----------------------------------------------------------------------------------

    def _facts(self, kernel: KernelView, micro: int | None, model: Any) -> dsconfig.KernelFacts:
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "hidden_size", None) or max(getattr(cfg, "hidden_sizes", None) or [0]) or None
        return dsconfig.KernelFacts(
            kernel.gradient_accumulation_steps, kernel.mixed_precision, kernel.num_processes, micro, hidden
        )

    def _config(self, kernel: KernelView, micro: int | None, model: Any, trained: bool) -> dict[str, Any]:
        config, where = dsconfig.base_config(self.settings)
        if not trained:  # a frozen model's engine never sees a batch size: do not check one
            micro = dsconfig.placeholder_micro(config)
        return dsconfig.fill(config, self._facts(kernel, micro, model), where)

    @hookimpl
    def accel_model_init_context(self, kernel: KernelView) -> Any:
        if not self.settings["zero3_init_flag"]:
            return None
        config, where = dsconfig.base_config(self.settings)
        if dsconfig.stage_of(config) != 3:
            return contextlib.nullcontext()  # zero.Init only partitions under ZeRO-3
        import deepspeed

        facts = self._facts(kernel, dsconfig.placeholder_micro(config), None)
        return deepspeed.zero.Init(config_dict_or_path=dsconfig.fill(config, facts, where))

    @staticmethod
    def _batch_size(dataloaders: list[Any]) -> int | None:
        for loader in dataloaders:
            size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
            if size:
                return int(size)
        return None

    def _leaf_modules(self, model: Any, config: Mapping[str, Any]) -> None:
        names = self.settings.get("deepspeed_moe_layer_cls_names") or []
        if not names or dsconfig.stage_of(config) != 3:
            return
        from deepspeed.utils import set_z3_leaf_modules

        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = set(names) - {c.__name__ for c in classes}
        if missing:
            raise UsageError(
                f"deepspeed_moe_layer_cls_names: no module of class {', '.join(sorted(missing))} in the model"
            )
        set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__name__))

    @hookimpl
    def accel_prepare_training(
        self,
        kernel: KernelView,
        models: list[Any],
        optimizers: list[Any],
        schedulers: list[Any],
        dataloaders: list[Any],
    ) -> tuple[list[Any], list[Any], list[Any]]:
        import torch

        from accel_deepspeed import dummy
        from accel_deepspeed.model import DeepSpeedModel

        params_of = {id(m): {id(p) for p in m.parameters()} for m in models}
        owner: dict[int, Any] = {}  # id(model) -> optimizer
        for opt in optimizers:
            ids = {id(p) for group in opt.param_groups for p in group["params"]}
            homes = [m for m in models if ids <= params_of[id(m)]]
            if not homes:
                raise UsageError(
                    "with DeepSpeed, prepare each trained model together with its optimizer in one "
                    "prepare() call (this optimizer's parameters belong to no model of the call)"
                )
            if id(homes[0]) in owner:
                raise UsageError(
                    "with DeepSpeed, a model has exactly one optimizer (this prepare() call gives two for one model)"
                )
            owner[id(homes[0])] = opt
        trained = [rec for rec in self.prepared if rec.optimizer is not None]
        if len(trained) + len(owner) > 1:
            raise UsageError(LIMIT)
        micro = self._batch_size(dataloaders)
        wrapped: list[Any] = []
        out_opts, out_scheds = list(optimizers), list(schedulers)
        for model in models:
            opt = owner.get(id(model))
            config = self._config(kernel, micro, model, trained=opt is not None)
            dtype = (
                torch.bfloat16 if config["bf16"]["enabled"] else torch.float16 if config["fp16"]["enabled"] else None
            )
            stage = dsconfig.stage_of(config)
            if opt is None and stage != 3:
                # A frozen model needs no engine below ZeRO-3: it only runs forward, in its own precision.
                rec = Prepared(module=model, wrapper=DeepSpeedModel(model.to(self.device), None))
            else:
                self._leaf_modules(model, config)
                mine = [s for s in schedulers if opt is not None and getattr(s, "optimizer", None) is opt]
                engine = self._initialize(kernel, model, opt, mine, config)
                basic = engine.basic_optimizer if opt is not None else None
                rec = Prepared(
                    module=model,
                    wrapper=DeepSpeedModel(engine, dtype),
                    engine=engine,
                    optimizer=basic,
                    clip=float(config.get("gradient_clipping") or 0.0),
                )
                if opt is not None and basic is not opt:  # a DummyOptim: the engine built the optimizer
                    out_opts[optimizers.index(opt)] = basic
                    for sched in mine:
                        out_scheds[schedulers.index(sched)] = dummy.EngineScheduler(engine)
            self.prepared.append(rec)
            wrapped.append(rec.wrapper)
        return wrapped, out_opts, out_scheds

    def _initialize(
        self, kernel: KernelView, model: Any, opt: Any, schedulers: list[Any], config: dict[str, Any]
    ) -> Any:
        """``deepspeed.initialize`` for one trained (or ZeRO-3 frozen) model. A DummyOptim/DummyScheduler stands for
        the config's optimizer/scheduler sections (as in Accelerate); with the script's own torch optimizer, the
        empty parameter groups DeepSpeed drops are dropped from its schedulers too, so they keep stepping."""
        import deepspeed

        from accel_deepspeed import dummy

        where = "DeepSpeed config"
        if opt is None:  # a frozen ZeRO-3 model: the engine must not build an optimizer or scheduler for it
            config = {k: v for k, v in config.items() if k not in dsconfig.SECTIONS}
        is_dummy = isinstance(opt, dummy.DummyOptim)
        dummy_sched = next((s for s in schedulers if isinstance(s, dummy.DummyScheduler)), None)
        if opt is not None:
            if "optimizer" in config and not is_dummy:
                raise UsageError(
                    f"{where} defines an optimizer section and the script passes its own optimizer; "
                    "remove the section, or pass accel_deepspeed.DummyOptim(params, lr=...) to prepare()"
                )
            if "optimizer" not in config and is_dummy:
                raise UsageError(
                    f"DummyOptim needs an optimizer section in the {where}; add one, or pass a torch optimizer"
                )
        real_scheds = [s for s in schedulers if not isinstance(s, dummy.DummyScheduler)]
        if "scheduler" in config and real_scheds:
            raise UsageError(
                f"{where} defines a scheduler section and the script passes its own scheduler; remove "
                "the section, or pass accel_deepspeed.DummyScheduler(optimizer, ...) to prepare()"
            )
        if dummy_sched is not None and "scheduler" not in config and dummy_sched.lr_scheduler_callable is None:
            raise UsageError(f"DummyScheduler needs a scheduler section in the {where}, or lr_scheduler_callable=")
        if not is_dummy:
            if dummy_sched is not None:
                raise UsageError(
                    "DummyScheduler goes with DummyOptim (the engine builds the scheduler over the "
                    "optimizer it builds); pass DummyOptim, or a torch scheduler"
                )
            groups = list(opt.param_groups) if opt is not None else []
            kept = [i for i, g in enumerate(groups) if g["params"]]
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            if opt is not None and len(opt.param_groups) < len(groups):
                for sched in schedulers:
                    dummy.prune_scheduler(sched, kept, len(groups))
            return engine
        values: dict[str, dict[str, Any]] = {"optimizer": {"lr": opt.lr, "weight_decay": opt.weight_decay}}
        if dummy_sched is not None:
            values["scheduler"] = dummy_sched.auto_values(kernel.num_processes)
        dsconfig.fill_sections(config, values, where)
        callable_ = dummy_sched.lr_scheduler_callable if dummy_sched is not None else None
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=opt.params, lr_scheduler=callable_, config=config
        )
        return engine

    # ---- lookups ------------------------------------------------------------------------------------------

    def _trained(self) -> Prepared | None:
        return next((rec for rec in self.prepared if rec.optimizer is not None), None)

    def _by_optimizer(self, optimizer: Any) -> Prepared | None:
        return next((rec for rec in self.prepared if rec.optimizer is optimizer and rec.engine is not None), None)

    def _by_model(self, kernel: KernelView, model: Any) -> Prepared | None:
        user = kernel.unwrap_model(model)
        return next((rec for rec in self.prepared if rec.wrapper is model or rec.module is user), None)

    # ---- training step ------------------------------------------------------------------------------------

    @hookimpl
    def accel_backward(self, kernel: KernelView, loss: torch.Tensor, backward_kwargs: dict[str, Any]) -> bool | None:
        rec = self._trained()
        if rec is None:
            return None
        # scale_wrt_gas=False: the loss is already divided for accumulation (transformers' Trainer does it itself)
        unsupported = sorted(set(backward_kwargs) - {"retain_graph", "scale_wrt_gas"})
        if unsupported:
            raise UsageError(
                f"kernel.backward({', '.join(unsupported)}=...) is not supported with DeepSpeed (its "
                "engine's backward takes retain_graph and scale_wrt_gas only); leave it out"
            )
        rec.engine.set_gradient_accumulation_boundary(kernel.sync_gradients)
        rec.engine.backward(loss, **backward_kwargs)
        return True

    @hookimpl
    def accel_optimizer_step(self, kernel: KernelView, optimizer: torch.optim.Optimizer) -> bool | None:
        rec = self._by_optimizer(optimizer)
        if rec is None:
            return None
        engine = rec.engine
        engine.set_gradient_accumulation_boundary(True)  # the kernel steps only at the end of a cycle
        try:
            engine.step()
        finally:
            self._set_clip(rec, rec.clip)
        norm = engine.get_global_grad_norm()
        for pending in rec.pending_norms:
            pending.fill_(float("nan") if norm is None else float(norm))
        rec.pending_norms.clear()
        return bool(engine.was_step_applied())

    @hookimpl
    def accel_zero_grad(self, kernel: KernelView, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool | None:
        rec = self._by_optimizer(optimizer)
        if rec is None:
            return None
        rec.engine.optimizer.zero_grad(set_to_none=set_to_none)
        return True

    @hookimpl
    def accel_no_sync(self, kernel: KernelView, model: torch.nn.Module) -> Any:
        # The engine reduces only at the end of an accumulation cycle (accel_backward told it when that is).
        return contextlib.nullcontext() if any(rec.wrapper is model for rec in self.prepared) else None

    @staticmethod
    def _set_clip(rec: Prepared, value: float) -> None:
        rec.engine._config.gradient_clipping = value
        if hasattr(rec.engine.optimizer, "clip_grad"):
            rec.engine.optimizer.clip_grad = value

    @hookimpl
    def accel_clip_grad_norm(
        self, kernel: KernelView, parameters: list[torch.nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor | None:
        import torch

        rec = self._trained()
        if rec is None:
            return None
        mine = {id(p) for p in rec.module.parameters()}
        given = {id(p) for p in parameters}
        if not given & mine:
            return None
        if given != mine:
            raise UsageError(
                "with DeepSpeed, clip_grad_norm_ clips all parameters of the trained model together "
                "(pass model.parameters())"
            )
        if norm_type != 2.0:
            raise UsageError(f"DeepSpeed clips by the 2-norm only (norm_type={norm_type:g} was asked)")
        if rec.clip > 0 and abs(rec.clip - max_norm) > 1e-12 * max(1.0, max_norm):
            raise UsageError(
                f"clip_grad_norm_(max_norm={max_norm:g}) but the DeepSpeed config clips at "
                f"gradient_clipping={rec.clip:g}; the engine clips once per step: make them equal, or "
                "remove gradient_clipping from the config"
            )
        engine = rec.engine
        if not (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled()):
            # Plain fp32 data parallelism: after the last backward of the cycle every process holds the averaged
            # gradients, so clip them here and return the norm now.
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=2.0)
        self._set_clip(rec, float(max_norm))
        norm = torch.full((), float("nan"))
        rec.pending_norms.append(norm)
        return norm

    # ---- weights and checkpoints --------------------------------------------------------------------------

    @hookimpl
    def accel_model_state_dict(self, kernel: KernelView, model: torch.nn.Module) -> dict[str, Any] | None:
        from accel_deepspeed.state import full_state_dict

        rec = self._by_model(kernel, model)
        if rec is None or rec.engine is None:
            return None
        return full_state_dict(rec.engine, bool(self.settings.get("zero3_save_16bit_model")))

    def _items(self, kernel: KernelView, items: Mapping[str, Any]) -> list[tuple[Prepared, str, str | None]]:
        """(record, model key, optimizer key) for each engine whose model is a checkpoint item."""
        import torch

        out = []
        for rec in self.prepared:
            if rec.engine is None:
                continue
            model_key = next(
                (
                    k
                    for k, obj in items.items()
                    if isinstance(obj, torch.nn.Module)
                    and (obj is rec.wrapper or kernel.unwrap_model(obj) is rec.module)
                ),
                None,
            )
            opt_key = next(
                (
                    k
                    for k, obj in items.items()
                    if rec.optimizer is not None and getattr(obj, "optimizer", None) is rec.optimizer
                ),
                None,
            )
            if model_key is not None:
                out.append((rec, model_key, opt_key))
        return out

    @hookimpl
    def accel_save_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path, asynchronous: bool
    ) -> dict[str, ItemRecord]:
        from accel_deepspeed import state

        records: dict[str, ItemRecord] = {}
        found = self._items(kernel, items)
        if found and asynchronous:
            raise UsageError(
                "save_state(asynchronous=True) is not supported with --plugin deepspeed: the DeepSpeed "
                "engine writes its checkpoint itself, with collectives, on the training thread; call "
                "save_state() without asynchronous=True (and async_save: false)"
            )
        if found and not kernel.sync_gradients:
            raise UsageError(
                "save_state in the middle of gradient accumulation: DeepSpeed keeps the gradients of the "
                "unfinished cycle inside its engine, where no checkpoint can hold them; save after a step "
                "that synchronises (if kernel.sync_gradients: kernel.save_state(...))"
            )
        for rec, model_key, opt_key in found:
            sub = f"deepspeed_{model_key}"
            extra = {
                "dir": sub,
                "tag": state.TAG,
                "zero_stage": int(rec.engine.zero_optimization_stage()),
                "world_size": kernel.num_processes,
                "model_key": model_key,
                "optimizer_key": opt_key,
            }
            if rec.optimizer is None:  # a frozen ZeRO-3 model: its gathered weights
                files = state.save_frozen(rec.engine, Path(directory), sub)
                records[model_key] = ItemRecord(plugin=self.name, format=state.FROZEN_FORMAT, files=files, extra=extra)
                continue
            files = state.save(rec.engine, Path(directory), sub)
            for key in (model_key, opt_key):
                if key is not None:
                    records[key] = ItemRecord(plugin=self.name, format=state.FORMAT, files=files, extra=extra)
        return records

    @hookimpl
    def accel_load_state(
        self, kernel: KernelView, items: Mapping[str, Any], directory: Path, records: Mapping[str, ItemRecord]
    ) -> Iterable[str]:
        from accel_deepspeed import state

        restored: list[str] = []
        for rec, model_key, opt_key in self._items(kernel, items):
            found = records.get(model_key)
            if found is None:
                continue
            if rec.optimizer is None and found.format == state.FROZEN_FORMAT:
                state.load_frozen(rec.engine, Path(directory), str(found.extra["dir"]))
                restored.append(model_key)
                continue
            if found.format != state.FORMAT:
                raise UsageError(
                    f"checkpoint item {model_key!r} was written by {found.plugin!r} ({found.format}), not "
                    "by DeepSpeed; a DeepSpeed engine resumes only from its own checkpoints (to start "
                    "from plain weights, load them into the model before prepare())"
                )
            stage = int(found.extra.get("zero_stage", -1))
            if stage != rec.engine.zero_optimization_stage():
                raise UsageError(
                    f"checkpoint item {model_key!r} was saved with ZeRO stage {stage}, this run uses "
                    f"stage {rec.engine.zero_optimization_stage()}; resume with the same stage"
                )
            with_opt = opt_key is not None and opt_key in records
            state.load(rec.engine, Path(directory), str(found.extra["dir"]), with_opt)
            restored.append(model_key)
            if with_opt and opt_key is not None:
                restored.append(opt_key)
        return restored
