"""Config files: where the default one is looked up (accel's, then Accelerate's), reading a YAML file, renaming
legacy keys, and validating a file's keys and values against the declared options (used by ``accel launch`` and
``accel config``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from accel.errors import UsageError
from accel.options import Options, did_you_mean, known_plugins


def default_config_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where the default config file is looked up, in order: $ACCEL_HOME, $XDG_CACHE_HOME/accel, ~/.cache/accel."""
    env = os.environ if env is None else env
    dirs = []
    if env.get("ACCEL_HOME"):
        dirs.append(Path(env["ACCEL_HOME"]))
    if env.get("XDG_CACHE_HOME"):
        dirs.append(Path(env["XDG_CACHE_HOME"]) / "accel")
    dirs.append(Path(env.get("HOME", str(Path.home()))) / ".cache" / "accel")
    return dirs


def find_default_config(env: Mapping[str, str] | None = None) -> Path | None:
    for directory in default_config_dirs(env):
        for name in ("default_config.yaml", "default_config.yml", "default_config.json"):
            if (directory / name).is_file():
                return directory / name
    return None


def find_accelerate_config(env: Mapping[str, str] | None = None) -> Path | None:
    """Accelerate's default config file, where ``accelerate config`` writes it: ``$HF_HOME/accelerate``, else
    ``$XDG_CACHE_HOME/huggingface/accelerate``, else ``~/.cache/huggingface/accelerate``; ``default_config.yaml``
    (or the older ``default_config.json`` when it is the only one)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME", str(Path.home())))
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    hf_home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else cache / "huggingface"
    for name in ("default_config.yaml", "default_config.json"):
        if (hf_home / "accelerate" / name).is_file():
            return hf_home / "accelerate" / name
    return None


#: The largest config file read. Accelerate's and accel's are a few KiB; YAML parsing of tens of MiB takes minutes
#: even with libyaml, so a file this large is a mistake (a data or log file passed as the config), said at once.
MAX_CONFIG_BYTES = 4 * 2**20


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (or JSON) config file with YAML's safe loader (libyaml's C one when PyYAML has it), at most
    :data:`MAX_CONFIG_BYTES`; raise ``UsageError`` with one clear line."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {str(p)!r} does not exist; fix the path")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise UsageError(
            f"config file {p} is {size / 2**20:.1f} MiB; an accel or Accelerate config is a few KiB (at most "
            f"{MAX_CONFIG_BYTES // 2**20} MiB is read): is this the right file? pass another --config_file"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{p}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"config file {p} cannot be read: {exc.strerror or exc}; fix its permissions or pass another --config_file"
        ) from None
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=loader)  # noqa: S506 (safe)
    except RecursionError:
        raise UsageError(
            f"{p}: nested too deeply to be a config file (Python's recursion limit was reached "
            "reading it; accel's keys are at most two levels deep); fix the file"
        ) from None
    except yaml.MarkedYAMLError as exc:
        if "nesting depth" in str(exc.problem):  # libyaml's own limit (the C loader)
            raise UsageError(
                f"{p}: nested too deeply to be a config file ({exc.problem}; accel's keys are at most two levels "
                "deep); fix the file"
            ) from None
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{p}: malformed YAML{where}: {exc.problem}") from None
    except (yaml.YAMLError, ValueError) as exc:
        raise UsageError(f"{p}: cannot be parsed: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{p}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    return data


def migrate_legacy(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Read the keys older Accelerate versions wrote as Accelerate reads them today: ``fp16: true`` is
    ``mixed_precision: fp16`` and a top-level ``dynamo_backend`` goes to ``dynamo_config``. Returns the new
    mapping and one line per change."""
    new: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    changes: list[str] = []
    if "fp16" in new:
        legacy = new.pop("fp16")
        if legacy in (True, "true", "True", "yes") and new.get("mixed_precision") in (None, "no", False):
            new["mixed_precision"] = "fp16"
            changes.append("legacy `fp16: true` -> `mixed_precision: fp16`")
        else:
            changes.append(f"removed legacy `fp16: {legacy}`")
    if "dynamo_backend" in new:
        backend = new.pop("dynamo_backend")
        section = new.setdefault("dynamo_config", {})
        if isinstance(section, dict):
            section.setdefault("dynamo_backend", backend)
        changes.append(f"top-level `dynamo_backend: {backend}` -> `dynamo_config.dynamo_backend`")
    return new, changes


def _is_set(value: Any) -> bool:
    """Whether an ignored config value asks for something (Accelerate writes ``tpu_env: []``, ``downcast_bf16: 'no'``
    and ``false`` for features that are off: ignoring those needs no note)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "no", "none", "false")
    return bool(value)


def validate_config(
    data: Mapping[str, Any],
    options: Options,
    loaded: Iterable[str],
    where: str,
    unavailable: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Check a parsed config file against the options. Return (values by option name, notes on ignored keys).

    Keys owned by a published plugin that is not loaded (not installed, disabled or failed: ``unavailable`` gives
    the reason by plugin name) and the Accelerate keys accel does not use are ignored; a note names those that ask
    for something. Any other unknown key is an error with a did-you-mean."""
    known = known_plugins()
    loaded = set(loaded)
    unavailable = unavailable or {}
    owner = {key: name for name, info in known["plugins"].items() for key in info["config_keys"] if name not in loaded}
    by_path = options.by_path()
    sections = {path[0] for path in by_path if len(path) > 1}
    values: dict[str, Any] = {}
    ignored: dict[str, list[str]] = {}  # reason -> keys

    def ignore(key: str, raw: Any, plugin: str | None) -> None:
        if not _is_set(raw):
            return
        if plugin is None:
            reason = "not used by accel"
        elif plugin in unavailable:
            reason = f"plugin {plugin!r} is {unavailable[plugin]}"
        else:
            reason = f"needs {known['plugins'][plugin]['distribution']}, not installed"
        ignored.setdefault(reason, []).append(key)

    def unknown(key: str, candidates: Iterable[str]) -> UsageError:
        return UsageError(f"{where}: unknown key `{key}`{did_you_mean(key.split('.')[-1], candidates)}")

    for key, raw in data.items():
        key = str(key)
        if raw is None:  # `main_process_ip: null`: not set
            continue
        if (key,) in by_path:
            opt = by_path[(key,)]
            values[opt.name] = opt.coerce(raw, f"{where}: `{key}`")
        elif key in sections and isinstance(raw, Mapping):
            for sub, sub_raw in raw.items():
                path = (key, str(sub))
                if sub_raw is None:
                    continue
                if path in by_path:
                    values[by_path[path].name] = by_path[path].coerce(sub_raw, f"{where}: `{key}.{sub}`")
                elif key in owner or ".".join(path) in owner:
                    ignore(".".join(path), sub_raw, owner.get(key) or owner[".".join(path)])
                else:
                    raise unknown(
                        ".".join(path),
                        [p[1] for p in by_path if len(p) > 1 and p[0] == key]
                        + [k.split(".", 1)[1] for k in owner if k.startswith(f"{key}.")],
                    )
        elif key in sections:  # a section of a loaded plugin given as a single value (`fsdp_config: 5`)
            example = next(p[1] for p in by_path if len(p) > 1 and p[0] == key)
            raise UsageError(
                f"{where}: `{key}` must be a mapping of settings (e.g. `{key}: {{{example}: ...}}`), "
                f"got {raw!r}; put its keys under it, one per line, indented"
            )
        elif key in owner:
            ignore(key, raw, owner[key])
        elif key in known["refused"]["keys"]:
            if _is_set(raw):
                raise UsageError(f"{where}: `{key}`: {known['refused']['keys'][key]}")
        elif key in known["ignored_keys"]:
            ignore(key, raw, None)
        else:
            raise unknown(key, [p[0] for p in by_path] + list(owner) + list(known["ignored_keys"]))
    notes = [f"{', '.join(f'`{k}`' for k in keys)} ({reason})" for reason, keys in ignored.items()]
    return values, notes
