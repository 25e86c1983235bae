"""Scripts of Accelerate and of projects built on it, ported with the guide's renames only.

Each upstream file is committed unmodified under ``upstream/<project>/<path>``; its port is beside it
(``<name>_accel.py``). ``test_port_is_upstream_renamed`` shows that the port is the upstream file with the renames of
docs/migrating-from-accelerate.md (``renames.py``) and nothing else; the other tests run the ports with
``accel launch -n 2`` on CPU (``harness.run_accel``) and check what they did.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import HERE, Case, Run, accelerate_python, run_accel, run_accelerate, run_several
from renames import missing_from_guide, rename

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]
UPSTREAM = HERE / "upstream"


@dataclass(frozen=True)
class Port:
    """An upstream file and where it came from."""

    path: str  # under upstream/: <project>/<path in the project's repository>
    repo: str
    commit: str
    license: str  # the repository's license (the file's own header, where it has one, is kept as it is)
    missing: str = ""  # what accel or the guide lacks for the port to pass (its run test is xfail(strict) until then)

    @property
    def upstream(self) -> Path:
        return UPSTREAM / self.path

    @property
    def port(self) -> Path:
        return self.upstream.with_name(self.upstream.stem + "_accel.py")

    @property
    def script(self) -> str:
        """The port's path relative to tests/compat, for ``harness.Case``."""
        return str(self.port.relative_to(HERE))

    @property
    def url(self) -> str:
        path = self.path.split("/", 1)[1]
        return f"https://github.com/{self.repo}/blob/{self.commit}/{path}"


PORTS = {
    "train_unconditional": Port(
        "diffusers/examples/unconditional_image_generation/train_unconditional.py",
        "huggingface/diffusers",
        "58eb52c0803ea9af3abec60841c2a093bdf1f951",  # main of 2026-08-23, __version__ 0.40.0.dev0
        "Apache-2.0",
    ),
}
ACCELERATE = "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83"  # __version__ 1.15.0.dev0, as tests/compat/README.md
SCRIPTS = "accelerate/src/accelerate/test_utils/scripts"
PORTS.update(
    {
        # Accelerate's own multi-process test scripts (what `accelerate test` and its CI run on 2 processes)
        "test_ops": Port(f"{SCRIPTS}/test_ops.py", "huggingface/accelerate", ACCELERATE, "Apache-2.0"),
        "test_sync": Port(f"{SCRIPTS}/test_sync.py", "huggingface/accelerate", ACCELERATE, "Apache-2.0"),
        "test_distributed_data_loop": Port(
            f"{SCRIPTS}/test_distributed_data_loop.py", "huggingface/accelerate", ACCELERATE, "Apache-2.0"
        ),
    }
)


def test_renames_are_the_guides() -> None:
    """Every rename the ports use is written in the migration guide."""
    assert missing_from_guide() == []


@pytest.mark.parametrize("name", sorted(PORTS))
def test_port_is_upstream_renamed(name: str) -> None:
    """The port differs from its upstream file by the guide's renames only."""
    port = PORTS[name]
    upstream, ported = port.upstream.read_text(), port.port.read_text()
    expected = rename(upstream)
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            ported.splitlines(keepends=True),
            "upstream with the guide's renames",
            str(port.port.relative_to(HERE)),
        )
    )
    assert not diff, f"the port of {port.url} changes more than the guide's renames:\n{diff}"
    assert expected != upstream, "the port renames nothing: is it an Accelerate script?"
    assert "accelerate" not in {line.split()[1] for line in ported.splitlines() if line.startswith("import ")}


def xfail_missing(name: str) -> object:
    missing = PORTS[name].missing
    marks = [pytest.mark.xfail(strict=True, reason=f"waiting for: {missing}")] if missing else []
    return pytest.param(name, marks=marks)


SCRIPTS_RUN = ("test_ops", "test_sync", "test_distributed_data_loop")


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The runs of the ports the tests below read, one after another in one launch (``harness.run_several``: torch,
    transformers and diffusers imported once per process), each in its own folder, with its own output and exit
    code: the three Accelerate test scripts, and the diffusers script's plain run (``"plain"``) and its uninterrupted
    run with a checkpoint every 2 steps (``"full"``)."""
    base = tmp_path_factory.mktemp("ports")
    items = [(name, Case(PORTS[name].script, env=torchvision_env(), timeout=300), base / name) for name in SCRIPTS_RUN]
    if importlib.util.find_spec("tensorboard") is not None:  # else the diffusers tests skip (unconditional_case)
        items += [
            ("plain", unconditional_case(base / "plain"), base / "plain"),
            ("full", unconditional_case(base / "full", *EVERY_2, timeout=180, env=SAVE_ALONE), base / "full"),
        ]
    return run_several(items, base)


@pytest.mark.parametrize("name", [xfail_missing(n) for n in SCRIPTS_RUN])
def test_accelerate_script(name: str, ports: dict[str, Run]) -> None:
    """Accelerate's own test script, ported, passes on 2 processes (it asserts on every result itself)."""
    result = ports[name]
    assert result.returncode == 0, str(result)


@pytest.mark.parametrize("name", ["test_ops", "test_sync"])
def test_accelerate_script_under_accelerate(name: str, tmp_path: Path) -> None:
    """The upstream script passes under Accelerate 1.15 on 2 CPU processes (so the xfail of its port is accel's or
    the guide's). Not test_distributed_data_loop: under Accelerate it waits forever on CPU (its join_uneven_inputs
    only warns on MULTI_CPU, and the uneven DDP steps then never meet)."""
    python = accelerate_python()
    if python is None:
        pytest.skip("no Python with Accelerate 1.15 (make compat-vs-accelerate, or .venv-acc)")
    upstream = str(PORTS[name].upstream.relative_to(HERE))
    result = run_accelerate(Case(upstream, timeout=300), tmp_path, python)
    assert result.returncode == 0, str(result)


# ---------------------------------------------------------------------------------------------------------------
# diffusers examples/unconditional_image_generation/train_unconditional.py: a tiny UNet2DModel built from a local
# config (--model_config_name_or_path), an imagefolder of random PNGs (--train_data_dir), EMA, tensorboard,
# save_state every 2 optimizer steps, a DDPM pipeline sampled and saved at the end of each epoch


def make_images(folder: Path, count: int, size: int = 16) -> None:
    from PIL import Image

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(count):
        pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"{i:03d}.png")


def make_unet_config(folder: Path, size: int = 16) -> None:
    folder.mkdir(parents=True)
    config = {
        "_class_name": "UNet2DModel",
        "sample_size": size,
        "in_channels": 3,
        "out_channels": 3,
        "layers_per_block": 1,
        "block_out_channels": [8, 16],
        "norm_num_groups": 4,
        "attention_head_dim": 4,
        "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
    }
    (folder / "config.json").write_text(json.dumps(config))


IMAGES = 32  # 2 processes x batch 4: 4 optimizer steps an epoch
UNCONDITIONAL_ARGS = [
    "--train_data_dir",
    "images",
    "--model_config_name_or_path",
    "unet",
    "--resolution",
    "16",
    "--train_batch_size",
    "4",
    "--eval_batch_size",
    "2",
    "--num_epochs",
    "2",
    "--save_images_epochs",
    "1",
    "--save_model_epochs",
    "1",
    "--learning_rate",
    "1e-3",
    "--lr_warmup_steps",
    "2",
    "--ddpm_num_steps",
    "50",
    "--ddpm_num_inference_steps",
    "2",
    "--checkpointing_steps",
    "100",  # no checkpoint: see test_train_unconditional_checkpointing
    "--use_ema",
    "--output_dir",
    "ddpm",
]


def torchvision_env() -> dict[str, str]:
    """The stand-in ``offline/torchvision`` (pure-torch ``torchvision.transforms``, served to the script's own import
    by ``record/sitecustomize.py``) when the real torchvision does not import: PyPI's torchvision 0.28.0 links CUDA's
    libraries and fails with the CPU build of torch 2.13.0."""
    try:
        import torchvision.transforms  # noqa: F401
    except Exception:
        return {"COMPAT_TORCHVISION_STANDIN": str(HERE / "offline")}
    return {}


def unconditional_case(out: Path, *extra: str, timeout: float = 600, env: dict[str, str] | None = None) -> Case:
    """The diffusers script's case, with its images and UNet config written into ``out``."""
    pytest.importorskip("tensorboard", reason="the diffusers example logs to tensorboard")
    if not (out / "images").exists():
        make_images(out / "images", IMAGES)
        make_unet_config(out / "unet")
    return Case(
        PORTS["train_unconditional"].script,
        args=[*UNCONDITIONAL_ARGS, *extra],
        env={**torchvision_env(), **(env or {})},
        timeout=timeout,
    )


def run_unconditional(out: Path, *extra: str, timeout: float = 600, env: dict[str, str] | None = None) -> Run:
    result = run_accel(unconditional_case(out, *extra, timeout=timeout, env=env), out)
    assert result.returncode == 0, str(result)
    return result


#: the main process saves alone (diffusers' `if accelerator.is_main_process: accelerator.save_state(save_path)`) once
#: the other process has not come for this long (accel.checkpoint.solo)
SAVE_ALONE = {"ACCEL_SAVE_JOIN_TIMEOUT": "0.5"}
EVERY_2 = ["--checkpointing_steps", "2", "--checkpoints_total_limit", "2"]


def events(logdir: Path, kind: str, tag: str) -> list[Any]:
    """The tensorboard events of ``kind`` (``"scalars"``, ``"images"``) named ``tag`` under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: list[Any] = []
    for folder in sorted({f.parent for f in logdir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        if tag in acc.Tags()[kind]:
            found += acc.Scalars(tag) if kind == "scalars" else acc.Images(tag)
    return found


@pytest.mark.slow
def test_train_unconditional(ports: dict[str, Run]) -> None:
    """The diffusers script trains, checkpoints, samples and saves its pipeline on 2 processes, with Accelerate's
    learning-rate curve (cosine schedule counted in the unprepared dataloader's batches)."""
    from diffusers import DDPMPipeline
    from diffusers.optimization import get_scheduler

    result = ports["plain"] if "plain" in ports else run_unconditional(Path("missing"))  # skips: no tensorboard
    assert result.returncode == 0, str(result)
    ddpm = result.out / "ddpm"
    pipeline = DDPMPipeline.from_pretrained(ddpm)
    assert pipeline.unet.config.block_out_channels == [8, 16]
    images = pipeline(batch_size=1, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 16, 16, 3)
    # Accelerate's rule: the scheduler built on len(train_dataloader) * epochs (before prepare) steps
    # num_processes times per optimizer step, so it ends on time
    lrs = result.lrs
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=(IMAGES // 4) * 2)
    expected = []
    for _ in range(8):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for _ in range(2):
            schedule.step()
    assert lrs == pytest.approx(expected, rel=1e-6, abs=1e-12)
    # the tensorboard tracker got a loss per micro-step (both epochs) and the sampled images of each epoch
    logdir = ddpm / "logs"
    losses = [e.value for e in events(logdir, "scalars", "loss")]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert [e.step for e in events(logdir, "images", "test_samples")] == [
        0,
        1,
    ]  # tracker.add_images(...) through get_tracker("tensorboard")


@pytest.mark.slow
def test_train_unconditional_checkpointing(tmp_path: Path, ports: dict[str, Run]) -> None:
    """A checkpoint every 2 optimizer steps (at most 2 kept), saved by the main process alone as the script does,
    then ``--resume_from_checkpoint latest`` from the one after step 6 (mid-epoch 2): the script loads the state,
    skips the 2 batches of the epoch it already did, and does steps 7 and 8 with the learning rates of the
    uninterrupted run."""
    import shutil

    full = ports["full"] if "full" in ports else run_unconditional(Path("missing"))  # skips: no tensorboard
    assert full.returncode == 0, str(full)
    full_lrs = full.lrs
    ddpm = full.out / "ddpm"
    assert sorted(p.name for p in ddpm.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"], full
    resume = tmp_path / "resume"
    resume.mkdir()
    for name in ("images", "unet", "ddpm"):
        shutil.copytree(full.out / name, resume / name)
    shutil.rmtree(resume / "ddpm" / "checkpoint-8")
    resumed = run_unconditional(resume, *EVERY_2, "--resume_from_checkpoint", "latest", env=SAVE_ALONE)
    assert "Resuming from checkpoint checkpoint-6" in resumed.stdout + resumed.stderr, resumed
    assert resumed.lrs == pytest.approx(full_lrs[6:], rel=1e-6), (resumed.lrs, full_lrs)


@pytest.mark.slow
def test_train_unconditional_same_as_accelerate(tmp_path: Path) -> None:
    """The upstream script under Accelerate 1.15 (its own venv, torchrun, Accelerate's launch variables) has the
    learning rates of the port under accel at every optimizer step of process 0; with a checkpoint every 2 steps
    (``save_state`` on the main process only) it finishes under Accelerate, which is what
    test_train_unconditional_checkpointing asks of accel."""
    python = accelerate_python()
    if python is None:
        pytest.skip("no Python with Accelerate 1.15 (make compat-vs-accelerate, or .venv-acc)")
    ours = run_unconditional(tmp_path / "accel")
    out = tmp_path / "accelerate"
    make_images(out / "images", IMAGES)
    make_unet_config(out / "unet")
    upstream = str(PORTS["train_unconditional"].upstream.relative_to(HERE))
    case = Case(upstream, args=[*UNCONDITIONAL_ARGS, *EVERY_2], env=torchvision_env(), timeout=600)
    theirs = run_accelerate(case, out, python)
    assert theirs.returncode == 0, str(theirs)
    assert sorted(p.name for p in (out / "ddpm").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"], theirs
    assert ours.lrs == pytest.approx(theirs.lrs, rel=1e-6, abs=1e-12), (ours.lrs, theirs.lrs)


# ---------------------------------------------------------------------------------------------------------------
# The upstream diffusers script itself, unchanged, on accel-accelerate (the `accelerate` import name backed by
# accel; on under accel launch): its save/load hooks (register_save_state_pre_hook, enabled by its
# `accelerate.__version__ >= 0.16.0` check) write the UNet and the EMA model into the checkpoint, and a resume from
# a checkpoint the main process saved alone, with the script's own skip of the epoch's first batches, continues
# the EMA and repeats process 0's draws exactly.


def run_upstream_unconditional(out: Path, *extra: str) -> Run:
    if not (out / "images").exists():
        make_images(out / "images", IMAGES)
        make_unet_config(out / "unet")
    upstream = str(PORTS["train_unconditional"].upstream.relative_to(HERE))
    # a join window far beyond the test's timeout: the main process must know from the script's
    # `if accelerator.is_main_process:` that the other process does not come, and save at once
    never = {"ACCEL_SAVE_JOIN_TIMEOUT": "3600"}
    case = Case(upstream, args=[*UNCONDITIONAL_ARGS, *EVERY_2, *extra], env={**torchvision_env(), **never})
    result = run_accel(case, out)
    assert result.returncode == 0, str(result)
    return result


@pytest.mark.slow
def test_train_unconditional_unchanged_on_accel_accelerate(tmp_path: Path) -> None:
    import shutil

    from accel.checkpoint import MANIFEST

    pytest.importorskip("tensorboard", reason="the diffusers example logs to tensorboard")
    full = run_upstream_unconditional(tmp_path / "full")
    ddpm = full.out / "ddpm"
    assert sorted(p.name for p in ddpm.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"], full
    files = json.loads((ddpm / "checkpoint-6" / MANIFEST).read_text())["files"]
    assert "unet/diffusion_pytorch_model.safetensors" in files and "unet_ema/config.json" in files  # the hooks'
    resume = tmp_path / "resume"
    resume.mkdir()
    for name in ("images", "unet"):
        shutil.copytree(full.out / name, resume / name)
    (resume / "ddpm").mkdir()
    shutil.copytree(ddpm / "checkpoint-6", resume / "ddpm" / "checkpoint-6")
    resumed = run_upstream_unconditional(resume, "--resume_from_checkpoint", "latest")
    assert "Resuming from checkpoint checkpoint-6" in resumed.stdout + resumed.stderr, resumed
    assert resumed.lrs == full.lrs[6:]  # steps 7 and 8: none lost, none repeated
    whole = {tag: [e.value for e in events(ddpm / "logs", "scalars", tag)] for tag in ("loss", "ema_decay")}
    again = {tag: [e.value for e in events(resume / "ddpm" / "logs", "scalars", tag)] for tag in ("loss", "ema_decay")}
    assert again["ema_decay"] == whole["ema_decay"][6:]  # the EMA model continued from step 6, not from 0
    # process 0's step 7 is the uninterrupted run's bit for bit (its batch, noise and timesteps); step 8 also
    # depends on process 1's step-7 gradients, whose random states a save by the main process alone does not hold
    assert again["loss"][0] == whole["loss"][6]
