"""Records what a compat example did, without touching the example: on ``PYTHONPATH`` with ``COMPAT_RECORD=<dir>``,
every process writes ``<dir>/rank<RANK>.json`` at exit with

- ``lrs``: the learning rate of every parameter group at each real optimizer step (a global optimizer pre-step
  hook on the user's ``torch.optim`` optimizer; the wrappers of accel and its plugins, Accelerate and DeepSpeed's ZeRO are not
  counted, their inner optimizer is), so a step skipped for inf/NaN gradients or an accumulation step is absent;
- ``losses``: the ``loss`` of every training forward that returns one (transformers' model outputs), through a
  global module forward hook;
- ``params`` (only with ``COMPAT_RECORD_MODULE=<class name>``): a SHA-256 of every parameter of the last module of
  that class that ran a forward, as it is when the process exits (what training left in it).

The same file is used under accel and under Accelerate, so the two runs are recorded the same way.
"""

from __future__ import annotations

import atexit
import json
import os

_DIR = os.environ.get("COMPAT_RECORD")

if _DIR:
    _record: dict[str, list] = {"lrs": [], "losses": []}
    _WRAPPERS = ("accel.", "accel_", "accelerate.", "deepspeed.runtime.")
    _last = {"output": None}
    _MODULE = os.environ.get("COMPAT_RECORD_MODULE", "")
    _seen: dict[str, object] = {}

    def _on_step(optimizer, args, kwargs):  # noqa: ANN001
        if type(optimizer).__module__.startswith(_WRAPPERS):
            return None
        _record["lrs"].append([float(g["lr"]) for g in optimizer.param_groups])
        return None

    def _on_forward(module, args, output):  # noqa: ANN001
        if _MODULE and type(module).__name__ == _MODULE:
            _seen["module"] = module
        loss = getattr(output, "loss", None) if not isinstance(output, dict) or "loss" in output else None
        if loss is None or not module.training or output is _last["output"]:
            return None
        _last["output"] = output
        try:
            _record["losses"].append(float(loss.detach().float()))
        except (RuntimeError, TypeError, ValueError):
            pass
        return None

    def _install() -> None:
        from torch.nn.modules.module import register_module_forward_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_on_step)
        register_module_forward_hook(_on_forward)

    def _write() -> None:
        if not _DIR:
            return  # flushed by several.py: nothing left for the exit
        if "RANK" not in os.environ and not (_record["lrs"] or _record["losses"]):
            return  # a launcher process (accel/accelerate launch): nothing of its own to record
        rank = os.environ.get("RANK", "0")
        if _seen:
            import hashlib

            _record["params"] = {
                name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
                for name, p in _seen["module"].named_parameters()
            }
        os.makedirs(_DIR, exist_ok=True)
        with open(os.path.join(_DIR, f"rank{rank}.json"), "w") as f:
            json.dump(_record, f)

    def start(directory: str) -> None:
        """A fresh record, written to ``directory`` by :func:`flush` (``several.py``: several examples in one
        process, each with its own record)."""
        global _DIR
        _DIR = directory
        _record["lrs"].clear()
        _record["losses"].clear()
        _record.pop("params", None)
        _last["output"] = None
        _seen.clear()

    def flush() -> None:
        """Write the record now (``several.py``, after each example); nothing is left for the exit."""
        global _DIR
        _write()
        _DIR = ""

    # Imported here (every process of a recorded run pays torch's import once): hooks exist before the example runs.
    _install()
    atexit.register(_write)

# With COMPAT_TORCHVISION_STANDIN=<dir> (set by test_upstream_ports.py where torchvision does not import), a script's
# `import torchvision` gets the pure-torch stand-in in <dir>/torchvision; probes (importlib.util.find_spec, used by
# transformers and diffusers to decide what is installed) still find no torchvision, so libraries do not use it:
# their cached answers are computed here, before the stand-in exists and before the script's import puts it in
# sys.modules (where find_spec would see it).
_STANDIN = os.environ.get("COMPAT_TORCHVISION_STANDIN")

if _STANDIN:
    import importlib.machinery
    import sys

    import diffusers.utils.import_utils  # noqa: F401  (caches _torchvision_available = False)
    import transformers.utils.import_utils

    transformers.utils.import_utils.is_torchvision_available()  # lru_cache: False

    class _TorchvisionStandin:
        @staticmethod
        def find_spec(name, path=None, target=None):  # noqa: ANN001, ANN205
            if name != "torchvision" and not name.startswith("torchvision."):
                return None
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.endswith(os.path.join("importlib", "util.py")):
                    return None
                frame = frame.f_back
            return importlib.machinery.PathFinder.find_spec(name, [_STANDIN] if name == "torchvision" else path)

    sys.meta_path.insert(0, _TorchvisionStandin)
