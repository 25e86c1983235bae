"""Move test modules beside their code: a plugin's own tests to ``plugins/<name>/tests``, the kernel's to
``kernel/tests``; cross-plugin and end-to-end suites stay in ``tests/``.

    python tools/relayout.py          # git mv + rewrites; prints what it did
    python tools/relayout.py --check  # exit 1 if anything is left to do (nothing is changed)

Idempotent: a file already at its destination is left alone, and every rewrite matches only the old text, so the
script can be re-run after merging branches that edited (or added references to) the moved files. A module is
listed here when it needs exactly one plugin (+ the kernel) or none; ``make test-plugin-alone`` checks that each
folder passes with only its plugin installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: destination folder -> files of tests/ that move there (test modules, and the helpers and scripts only they use).
MOVES: dict[str, list[str]] = {
    "kernel/tests": [
        "test_accelerate_compat.py",
        "test_accelerate_names.py",
        "test_checkpoint.py",
        "test_checkpoint_hooks.py",
        "test_custom_batch_sampler.py",
        "test_device_loader.py",
        "test_dispatch.py",
        "test_hardware.py",
        "test_hooks_doc.py",
        "test_kernel_api.py",
        "test_kernel_single.py",
        "test_plugin_unavailable.py",
        "test_send_to_device.py",
        "test_step_fast_paths.py",
        "test_testing_runs.py",
    ],
    "plugins/amp/tests": ["test_amp.py"],
    "plugins/bigmodel/tests": [
        "test_big_model.py",
        "test_big_model_docs.py",
        "test_big_model_hostile.py",
        "big_model_defs.py",
        "scripts/big_model_probe.py",
    ],
    "plugins/ddp/tests": ["test_ddp_torchrun_args.py", "test_launchers.py"],
    "plugins/deepspeed/tests": [
        "test_deepspeed.py",
        "test_deepspeed_dummy.py",
        "scripts/deepspeed_dummy.py",
        "scripts/deepspeed_dummy_refusals.py",
        "scripts/deepspeed_matrix.py",
        "scripts/deepspeed_resume.py",
        "scripts/deepspeed_single.py",
    ],
    "plugins/dynamo/tests": ["test_dynamo.py"],
    "plugins/fsdp/tests": [
        "test_fsdp.py",
        "test_fsdp_checkpoint.py",
        "fsdp_worker.py",
        "fsdp_ckpt_worker.py",
        "fsdp_single_worker.py",
    ],
    "plugins/ipex/tests": ["test_ipex_plugin.py"],
    "plugins/mlflow/tests": ["test_tracker_mlflow.py", "mlflow_server.py"],
    "plugins/parallel/tests": [
        "test_parallel.py",
        "test_parallel_config.py",
        "test_parallel_cuda.py",
        "parallel_worker.py",
        "parallel_cp_worker.py",
        "test_pipeline.py",
        "pipeline_worker.py",
    ],
    "plugins/tensorboard/tests": ["test_tracker_tensorboard.py"],
    "plugins/wandb/tests": ["test_tracker_wandb.py", "wandb_records.py"],
    "plugins/xla/tests": ["test_xla_plugin.py"],
}

#: Kernel-generic helpers that move into the public testing package (``accel.testing``): old file -> new file, and the
#: module name the tests import (old -> new).
TO_KERNEL = {"tests/plugin_shadow.py": "kernel/src/accel/testing/shadow.py"}
IMPORTS = [(r"\bfrom plugin_shadow import\b", "from accel.testing.shadow import")]

#: Text rewrites in one moved file (path relative to the repository, after the move): (old regex, new text).
EDITS: dict[str, list[tuple[str, str]]] = {
    "plugins/deepspeed/tests/test_deepspeed.py": [("from clitools import", "from dstools import")],
    "plugins/deepspeed/tests/test_deepspeed_dummy.py": [("from clitools import", "from dstools import")],
    # The cross-plugin suite reuses the fsdp suite's worker and reference (tests/conftest.py puts that folder on
    # sys.path).
    "tests/test_parallel_fsdp.py": [
        (r'WORKER = HERE / "fsdp_worker\.py"', "WORKER = test_fsdp.WORKER"),
    ],
    # tests/test_tracker_jsonl.py ran plugins/jsonl/tests through an import while only tests/ was collected; pytest
    # collects that folder now, so the import would run them twice. (The module itself stays in tests/: it checks that
    # plugins/jsonl holds exactly the template's files.)
    "tests/test_tracker_jsonl.py": [
        (r" Its own tests \(the tracker conformance suite\) run here too\.", ""),
        (r"import importlib\.util\n", ""),
        (r"\n_spec = importlib\.util\.spec_from_file_location\(.*?test_a_run_is_init_logs_end\n", ""),
    ],
    # DeepSpeed's launch environment moves to plugins/deepspeed/tests/dstools.py; clitools re-exports it for the
    # cross-plugin suites.
    "tests/clitools.py": [
        (r"#: Where DeepSpeed builds its CPU ops[^\n]*\nEXTENSIONS = [^\n]*\n", ""),
        (r"\n\ndef deepspeed_env\(.*?\n    return env\n", ""),
        (
            # once: the import may sit anywhere above TESTS after later edits (isort moves it)
            r"\A(?!.*from dstools import)(.*?)\n\nTESTS = Path",
            "\\1\n\nfrom dstools import EXTENSIONS, deepspeed_env  # noqa: F401  (plugins/deepspeed/tests, see conftest.py)"
            "\n\nTESTS = Path",
        ),
    ],
}

#: Tests of a moved module that also need a second plugin: marked ``requires_plugins`` (accel.testing.fixtures), so
#: the folder passes with only its own plugin installed; the full suite, where every plugin is installed, runs them.
NEEDS: dict[str, dict[str, tuple[str, ...]]] = {
    "plugins/deepspeed/tests/test_deepspeed.py": {"test_zero_stages_match_ddp": ("ddp",)},
    "plugins/deepspeed/tests/test_deepspeed_dummy.py": {
        "test_the_same_script_under_ddp_has_the_same_learning_rates": ("ddp",)
    },
    "plugins/dynamo/tests/test_dynamo.py": {
        "test_compile_with_fp16_autocast_and_scaler": ("amp",),
        "test_compiled_under_ddp_in_two_processes": ("ddp",),
    },
    "plugins/fsdp/tests/test_fsdp.py": {"test_fsdp_selected_over_ddp_and_launched_by_torchrun": ("ddp",)},
    # One case (--use_fsdp with tensor parallel) needs fsdp: the whole parametrized test is marked.
    "plugins/parallel/tests/test_parallel_config.py": {
        "test_bad_parallelism_settings_are_one_line_at_launch": ("fsdp",)
    },
    "plugins/mlflow/tests/test_tracker_mlflow.py": {
        "test_server_gone_is_warned_once_and_training_goes_on": ("tensorboard",)
    },
    "plugins/wandb/tests/test_tracker_wandb.py": {
        "test_bad_credentials_are_warned_once_and_the_others_go_on": ("tensorboard",)
    },
}

#: Files whose text may name a moved file by its old path (``tests/test_x.py``): rewritten to the new path.
REFERENCE_GLOBS = (
    "README.md",
    "Makefile",
    "docs/*.md",
    "docs/*.py",
    "plugins/*/README.md",
    "plugins/*/src/**/*.py",
    "kernel/src/**/*.py",
    "kernel/tests/**/*.py",
    "plugins/*/tests/**/*.py",
    "tests/**/*.py",
    "tests/**/*.md",
    "bench/**/*.py",
    "bench/**/*.md",
    "examples/**/*.py",
    "tools/*.py",
    "pyproject.toml",
    "requirements-dev.txt",
    "kernel/src/**/*.json",
)


def depth_fix(dest: str, name: str) -> list[tuple[str, str]]:
    """``Path(__file__)...parents[K]`` was the repository root from ``tests/`` (K=1) or ``tests/scripts`` (K=2);
    from ``dest`` it is further up."""
    was = len(Path(name).parts)  # test_x.py -> 1, scripts/x.py -> 2
    up = len(Path(dest).parts) + was - 1  # kernel/tests -> 2, plugins/x/tests -> 3 (+1 in scripts/)
    old = rf"(Path\(__file__\)(?:\.resolve\(\))?\.parents)\[{was}\]"
    return [(old, rf"\g<1>[{up}]")] + (
        [(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent\.parent\b", rf"\g<1>.parents[{up}]")] if was == 1 else []
    )


def mark(path: Path, tests: dict[str, tuple[str, ...]], apply: bool) -> bool:
    """Put ``@pytest.mark.requires_plugins(...)`` right above each named test function (once)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    changed = False
    for name, plugins in tests.items():
        for i, line in enumerate(lines):
            if re.match(rf"\s*(async )?def {name}\(", line):
                indent = line[: len(line) - len(line.lstrip())]
                decorator = f"{indent}@pytest.mark.requires_plugins({', '.join(map(repr, plugins))})\n".replace(
                    "'", '"'
                )
                if decorator not in lines[max(0, i - 5) : i]:
                    lines.insert(i, decorator)
                    changed = True
                break
    if changed and apply:
        path.write_text("".join(lines), encoding="utf-8")
    return changed


def git_files() -> list[str]:
    """The repository's tracked and untracked-but-not-ignored files, relative to ROOT."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.splitlines()


def glob_regex(pattern: str) -> str:
    """``Path.glob``'s meaning of a pattern (``**/`` = any folders, ``*`` = within one name) as a regex."""
    parts = re.split(r"(\*\*/|\*)", pattern)
    return "".join({"**/": "(?:.*/)?", "*": "[^/]*"}.get(part, re.escape(part)) for part in parts)


def git(*args: str, check: bool = True) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=check)


def rewrite(path: Path, edits: list[tuple[str, str]], apply: bool) -> bool:
    text = path.read_text(encoding="utf-8")
    new = text
    for old, repl in edits:
        new = re.sub(old, repl, new, flags=re.DOTALL)
    if new != text and apply:
        path.write_text(new, encoding="utf-8")
    return new != text


def main() -> int:
    parser = argparse.ArgumentParser(description="Move test modules beside their code.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is left to do")
    apply = not parser.parse_args().check
    todo: list[str] = []

    renamed: dict[str, str] = {}  # old path -> new path, for the references
    for dest, names in MOVES.items():
        for name in names:
            old, new = f"tests/{name}", f"{dest}/{Path(name).name if not name.startswith('scripts/') else name}"
            renamed[old] = new
            if (ROOT / old).exists() and not (ROOT / new).exists():
                todo.append(f"git mv {old} {new}")
                if apply:
                    (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
                    git("mv", old, new)
            if (ROOT / new).exists() and name.endswith(".py"):
                if rewrite(ROOT / new, depth_fix(dest, name) + EDITS.get(new, []), apply):
                    todo.append(f"rewrite {new}")

    for old, new in TO_KERNEL.items():
        renamed[old] = new
        if (ROOT / old).exists() and not (ROOT / new).exists():
            todo.append(f"git mv {old} {new}")
            if apply:
                git("mv", old, new)

    for path, tests in NEEDS.items():
        if (ROOT / path).exists() and mark(ROOT / path, tests, apply):
            todo.append(f"mark {path}")

    for path, edits in EDITS.items():
        if path not in renamed.values() and (ROOT / path).exists() and rewrite(ROOT / path, edits, apply):
            todo.append(f"rewrite {path}")

    # Old paths named in docs, comments and Makefiles; the lookbehind keeps the rewrite from matching a new path.
    refs = [(rf"(?<![\w/.-]){re.escape(old)}\b", new) for old, new in renamed.items()] + IMPORTS
    seen: set[Path] = set()
    tracked = sorted(git_files())  # not ROOT.glob: that walks ignored venvs (bench/.venv-accelerate is 1 GB)
    for pattern in REFERENCE_GLOBS:
        matches = re.compile(glob_regex(pattern)).fullmatch
        for file in (ROOT / name for name in tracked if matches(name)):
            skip = file == Path(__file__).resolve() or "fixtures" in file.parts
            if file in seen or skip or not file.is_file():
                continue
            seen.add(file)
            if rewrite(file, refs, apply):
                todo.append(f"references in {file.relative_to(ROOT)}")

    changed = [line.split()[-1] for line in todo if line.startswith(("references in", "rewrite", "mark"))]
    if apply and changed:  # import blocks the rewrites reordered
        ruff = Path(sys.executable).parent / "ruff"
        if ruff.exists():
            subprocess.run([str(ruff), "check", "-q", "--fix", "--select", "I,F401", *changed], cwd=ROOT, check=False)

    for line in todo:
        print(("" if apply else "to do: ") + line)
    return 1 if todo and not apply else 0


if __name__ == "__main__":
    sys.exit(main())
