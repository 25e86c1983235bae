"""``accel estimate-memory MODEL``: per-process training memory (model states, no activations) for each installed
strategy and its options, from a model built on the meta device (nothing is allocated, nothing is downloaded).

MODEL is a Python import path (``pkg.module:factory`` or ``pkg.module:ClassName``, called with no arguments
inside ``with torch.device("meta")``) or a Hugging Face ``config.json`` (the file or its directory; built with
transformers' ``from_config`` on the meta device, offline). Every plugin answers ``accel_estimate_memory`` with its
own rows; the kernel adds the single-process row. torch is imported only after the arguments are parsed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accel.builtin import is_builtin
from accel.commands.info import load_plugins
from accel.commands.launch import Parser
from accel.errors import UsageError
from accel.memory import (
    DTYPES,
    OPTIMIZER_STATES,
    MemoryQuery,
    MemoryRow,
    ModelSummary,
    ParameterInfo,
    format_bytes,
    sorted_rows,
)
from accel.plugins import Plugins, describe_exception, one_line

if TYPE_CHECKING:
    import torch

#: Accelerate's and torch's dtype names for the ``--dtypes`` values.
DTYPE_ALIASES = {"float32": "fp32", "no": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8": "fp8"}
#: Config keys that give a number of layers, and the most accepted (the largest published models have ~100-200):
#: a typo such as ``1e6`` would build a million layers on the meta device for minutes.
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers")
MAX_LAYERS = 4096
#: A model build that takes longer than this says so on stderr (and how long it took).
ANNOUNCE_AFTER_S = 2.0
UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parser() -> Parser:
    p = Parser(
        prog="accel estimate-memory",
        description="Estimate the memory each process needs to train MODEL (parameters, gradients, optimizer "
        "state; activations not included) under every installed strategy and its options. The "
        "model is built on the meta device: nothing is allocated or downloaded.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="pkg.module:factory or pkg.module:ClassName (called with no arguments), or a Hugging Face "
        "config.json file or the directory holding it",
    )
    p.add_argument(
        "-n",
        "--num_processes",
        "--num-processes",
        type=int,
        default=None,
        help="processes that share the training [default: this machine's accelerator count, 1 without one]",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["fp32", "bf16"],
        metavar="DTYPE",
        help="mixed_precision values to estimate: fp32 (no mixed precision), bf16, fp16, fp8 "
        "(space- or comma-separated) [default: fp32 bf16]",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZER_STATES),
        help="adam/adamw keep 2 fp32 states per parameter, sgd_momentum 1, sgd none [default: adamw]",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p  # load_plugins adds -p no:NAME


def dtypes_from(values: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for value in (v for item in values for v in item.split(",") if v):
        dtype = DTYPE_ALIASES.get(value.lower(), value.lower())
        if dtype not in DTYPES:
            raise UsageError(
                f"--dtypes: unknown dtype {value!r}; choose from {', '.join(DTYPES)} (training memory; "
                "int8/int4 are inference formats)"
            )
        if dtype not in out:
            out.append(dtype)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# Building the model on the meta device


def _import(module_name: str, model: str) -> Any:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the current directory's modules are importable
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UsageError(
                f"MODEL {model!r}: no module named {exc.name!r} (run from the directory that holds it, "
                "or set PYTHONPATH)"
            ) from None
        raise UsageError(f"MODEL {model!r}: importing {module_name!r} failed: {_where(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise UsageError(f"MODEL {model!r}: importing {module_name!r} failed: {_where(exc)}") from None


def _where(exc: BaseException) -> str:
    """``ValueError: bad (at models.py:12)``: the exception and the last frame of the user's code it came from."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "importlib" not in f.filename and os.sep + "accel" + os.sep + "commands" not in f.filename
    ]
    at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return one_line(describe_exception(exc)) + at


def from_import_path(model: str) -> torch.nn.Module:
    import torch

    module_name, _, attr = model.partition(":")
    if not module_name or not attr:
        raise UsageError(f"MODEL {model!r}: expected pkg.module:factory or pkg.module:ClassName")
    obj: Any = _import(module_name, model)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"MODEL {model!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, torch.nn.Module):
        return obj
    if not callable(obj):
        raise UsageError(f"MODEL {model!r}: {attr!r} is a {type(obj).__name__}, not a model class or factory")
    try:
        with announce(f"building {attr}() on the meta device"), torch.device("meta"):
            built = obj()
    except (Exception, SystemExit) as exc:
        raise UsageError(f"MODEL {model!r}: calling {attr}() on the meta device failed: {_where(exc)}") from None
    if not isinstance(built, torch.nn.Module):
        raise UsageError(f"MODEL {model!r}: {attr}() returned a {type(built).__name__}, not a torch.nn.Module")
    return built


def read_config(model: str) -> dict[str, Any]:
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            f"MODEL {model!r}: directory has no config.json (give a Hugging Face config.json file or its directory)"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"MODEL {model!r}: {file} is not valid JSON: {one_line(exc)}") from None
    except RecursionError:
        raise UsageError(
            f"MODEL {model!r}: {file} is nested too deeply to be a model config (Python's recursion limit was "
            "reached reading it); give the model's own config.json"
        ) from None
    except OSError as exc:
        raise UsageError(f"MODEL {model!r}: {file} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UsageError(f'MODEL {model!r}: {file} has no "model_type"; is it a Hugging Face model config.json?')
    check_config_values(model, file, data)
    return data


def check_config_values(model: str, file: Path, data: dict[str, Any]) -> None:
    """Refuse, in one line, values that would make the meta-device build fail obscurely or run for minutes."""
    archs = data.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise UsageError(
            f'MODEL {model!r}: {file}: "architectures" must be a list of class names (e.g. ["LlamaForCausalLM"]), '
            f"got {archs!r}"
        )
    for key in LAYER_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYERS:
            raise UsageError(
                f'MODEL {model!r}: {file}: "{key}" must be a whole number of layers from 0 to {MAX_LAYERS}, '
                f"got {value!r}"
            )


@contextlib.contextmanager
def announce(what: str, after: float = ANNOUNCE_AFTER_S) -> Iterator[None]:
    """Work that may take long says so: after ``after`` seconds one line on stderr, and when it ends its time."""
    start = time.monotonic()
    said = threading.Event()

    def say() -> None:
        said.set()
        print(f"accel estimate-memory: {what} (can take a while for a large model) ...", file=sys.stderr, flush=True)

    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            print(f"accel estimate-memory: {what}: done in {time.monotonic() - start:.0f} s", file=sys.stderr)


def from_hf_config(model: str) -> torch.nn.Module:
    data = read_config(model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    try:
        import transformers
    except ImportError:
        raise UsageError(
            f"MODEL {model!r}: reading a Hugging Face config needs transformers: pip install transformers"
        ) from None
    import torch

    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **kwargs)
    except (Exception, SystemExit) as exc:
        raise UsageError(f"MODEL {model!r}: transformers cannot read this config: {_where(exc)}") from None
    archs = [a for a in data.get("architectures") or [] if hasattr(transformers, a)]
    candidates: list[Any] = [getattr(transformers, a) for a in archs]
    candidates += [transformers.AutoModelForCausalLM, transformers.AutoModel]
    error: BaseException | None = None
    for cls in candidates:
        try:
            with announce(f"building transformers' {cls.__name__} on the meta device"), torch.device("meta"):
                return cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
        except ValueError as exc:  # an Auto class that does not know this config type: try the next one
            error = exc
        except (Exception, SystemExit) as exc:
            raise UsageError(
                f"MODEL {model!r}: building {cls.__name__} on the meta device failed: {_where(exc)}"
            ) from None
    raise UsageError(
        f"MODEL {model!r}: transformers has no model for this config: {_where(error)}"
        if error
        else f"MODEL {model!r}: transformers has no model for this config"
    )


def build(model: str) -> torch.nn.Module:
    if os.path.exists(model) or model.endswith(".json"):
        import logging

        logging.disable(logging.WARNING)  # optional backends transformers probes log their own absence
        try:
            return from_hf_config(model)
        finally:
            logging.disable(logging.NOTSET)
    if ":" in model:
        return from_import_path(model)
    raise UsageError(
        f"MODEL {model!r} is neither an import path (pkg.module:factory) nor an existing config.json file or directory"
    )


def summarize(name: str, model: torch.nn.Module) -> ModelSummary:
    """Each parameter once (tied weights are shared), the module type that owns it, and DeepSpeed's "largest
    layer": the module with the most parameters of its own."""
    owners: dict[int, str] = {}
    largest, largest_numel = "", 0
    for mod_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        for p in own:
            owners.setdefault(id(p), type(module).__name__)
        numel = sum(p.numel() for p in own)
        if numel > largest_numel:
            largest, largest_numel = mod_name or "(root)", numel
    params = tuple(
        ParameterInfo(n, tuple(p.shape), p.requires_grad, owners.get(id(p), type(model).__name__))
        for n, p in model.named_parameters()
    )
    return ModelSummary(name, params, largest, largest_numel)


# ---------------------------------------------------------------------------------------------------------------
# The command


def estimate(model: ModelSummary, query: MemoryQuery, plugins: Plugins) -> list[MemoryRow]:
    """Every plugin's rows (the built-in single-process rows first), grouped by dtype in the order asked."""
    answers = plugins.call_each("accel_estimate_memory", model=model, query=query)
    answers.sort(key=lambda pair: (not is_builtin(pair[0]), pair[0]))
    return sorted_rows([row for _name, answer in answers for row in answer or ()], query.dtypes)


def short_bytes(value: int) -> str:
    """``1.86G``, ``32.0M``, ``160M``, ``512``: three significant digits, binary units, for table cells."""
    for unit, size in UNITS:
        if value >= size:
            scaled = value / size
            digits = 2 if scaled < 10 else 1 if scaled < 100 else 0
            return f"{scaled:.{digits}f}{unit[0]}"
    return str(value)


def _count(n: int) -> str:
    """A parameter count in words (``8.39 million``): the table's K/M/G letters are binary byte units."""
    for unit, size in (("billion", 10**9), ("million", 10**6), ("thousand", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def print_table(model: ModelSummary, query: MemoryQuery, rows: list[MemoryRow], processes_note: str = "") -> None:
    """One plain-text table per dtype: the strategy and its options left-aligned, the byte counts right-aligned,
    columns two spaces apart (so ``re.split(r"\\s{2,}", line)`` reads a row back)."""
    print(
        f"`{model.name}`: {_count(model.numel)} parameters ({_count(model.trainable_numel)} trainable), "
        f"{format_bytes(4 * model.numel)} in fp32; largest layer `{model.largest_layer}`: "
        f"{_count(model.largest_layer_numel)}"
    )
    print(
        f"Memory per process for {query.num_processes} process(es){processes_note} with {query.optimizer}: "
        "parameters + gradients + optimizer state, activations not included."
    )
    columns = ("strategy", "params", "grads", "optim", "total", "CPU", "gathered")
    for dtype in query.dtypes:
        title = "fp32 (no mixed precision)" if dtype == "fp32" else f"mixed precision {dtype}"
        table: list[tuple[str, ...]] = [columns]
        for row in (r for r in rows if r.supported and r.dtype == dtype):
            label = row.strategy if row.options == "-" else f"{row.strategy}: {row.options}"
            values = (row.parameters, row.gradients, row.optimizer, row.total, row.cpu, row.gathered)
            table.append((label, *(short_bytes(v) if v or i < 4 else "-" for i, v in enumerate(values))))
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        print(f"\n{title}; bytes per process (K, M, G, T: KiB, MiB, GiB, TiB)")
        for n, line in enumerate(table):
            cells = [line[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(line[1:], widths[1:], strict=True)]
            print("  ".join(cells).rstrip())
            if n == 0:
                print("  ".join("-" * w for w in widths))
    refused: dict[tuple[str, str, str], list[str]] = {}
    for row in rows:
        if not row.supported:
            refused.setdefault((row.strategy, row.options, row.note), []).append(row.dtype)
    if refused:
        print()
    for (strategy, options, note), dtypes in refused.items():
        what = strategy if options == "-" else f"{strategy} {options}"
        print(f"not supported: {what} ({','.join(dtypes)}): {note}")
    print(
        "\nCPU: moved to host memory by offloading. gathered: the largest layer a sharding strategy gathers at "
        "once in forward/backward (on top of the total). Precision: bf16/fp16/fp8 train under autocast with fp32 "
        "weights (the master weights), fp32 gradients and optimizer state, except where a strategy trains 16-bit "
        "weights (16-bit weights and gradients + fp32 master weights, counted under optimizer)."
    )


def estimate_memory_command(argv: Sequence[str]) -> int:
    plugins, args = load_plugins(argv, parser())
    dtypes = dtypes_from(args.dtypes)
    processes_note = ""
    if args.num_processes is None:
        hardware = plugins.detect_hardware(os.environ)
        args.num_processes = hardware.device_count if hardware.name != "cpu" else 1
        where = (
            f"this machine's {hardware.name} devices" if hardware.name != "cpu" else "this machine has no accelerator"
        )
        processes_note = f" (-n not given: {args.num_processes}, {where}; pass -n N for another count)"
    if args.num_processes < 1:
        raise UsageError(f"--num_processes must be at least 1, got {args.num_processes}")
    summary = summarize(args.model, build(args.model))
    query = MemoryQuery(args.num_processes, dtypes, args.optimizer)
    rows = estimate(summary, query, plugins)
    if args.json:
        print(
            json.dumps(
                {
                    "model": summary.name,
                    "parameters": summary.numel,
                    "trainable": summary.trainable_numel,
                    "largest_layer": summary.largest_layer,
                    "largest_layer_parameters": summary.largest_layer_numel,
                    "num_processes": query.num_processes,
                    "optimizer": query.optimizer,
                    "rows": [r.as_dict() for r in rows],
                },
                indent=2,
            )
        )
    else:
        print_table(summary, query, rows, processes_note)
    return 0


__all__ = ["estimate_memory_command", "estimate", "summarize", "build"]
