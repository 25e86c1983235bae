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


# ---------------------------------------------------------------------------------------------------------------
# diffusers examples/text_to_image/train_text_to_image_lora.py, unchanged: PEFT LoRA on the UNet of a Stable Diffusion
# pipeline (CLIP text encoder and tokenizer, VAE, DDPM scheduler) loaded with from_pretrained from a tiny pipeline
# saved in the test's folder, an imagefolder of captioned PNGs, a checkpoint at the end of every epoch (saved by the
# main process alone, with the script's save/load hooks writing the LoRA weights), `--resume_from_checkpoint latest`;
# on 1 and 2 processes under accel launch (accel-accelerate) and under Accelerate 1.15 itself (torchrun,
# `.venv/accelerate-real` first on the path, ACCEL_ACCELERATE=0).

TEXT_TO_IMAGE_LORA = Port(
    "diffusers/examples/text_to_image/train_text_to_image_lora.py",
    "huggingface/diffusers",
    # main of 2026-08-23 (__version__ 0.40.0.dev0), the newest commit reachable from here (v0.42.1's tag was not);
    # since 1b91856 (2025-11-28) the file has changed only in its check_min_version line, at each release
    "58eb52c0803ea9af3abec60841c2a093bdf1f951",
    "Apache-2.0",
)
REAL_ACCELERATE = HERE.parents[1] / ".venv" / "accelerate-real"
LORA_IMAGES = 8  # batch 2: 4 optimizer steps an epoch on 1 process, 2 on 2
LORA_EPOCHS = 3
LORA_ARGS = [
    "--pretrained_model_name_or_path",
    "model",
    "--train_data_dir",
    "images",
    "--resolution",
    "16",
    "--center_crop",  # no random transform: see test_text_to_image_lora_same_as_accelerate
    "--image_interpolation_mode",
    "bilinear",  # the script's default, lanczos, is not in the torchvision stand-in
    "--train_batch_size",
    "2",
    "--num_train_epochs",
    str(LORA_EPOCHS),
    "--learning_rate",
    "1e-2",
    "--lr_scheduler",
    "cosine",
    "--lr_warmup_steps",
    "1",
    "--seed",
    "7",
    "--rank",
    "4",
    "--output_dir",
    "lora",
]


def make_tiny_stable_diffusion(folder: Path) -> None:
    """A Stable Diffusion repository (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/) of tiny
    random models: a 2-block UNet2DConditionModel on 8x8 latents, a 2-block AutoencoderKL (16x16 images), a 2-layer
    CLIP text encoder and a CLIP BPE tokenizer over a vocab.json and merges.txt of the letters."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    words = folder.parent / "bpe"
    words.mkdir(parents=True)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters), "re", "red</w>"]
    (words / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (words / "merges.txt").write_text("#version: 0.2\nr e\nre d</w>\n")
    tokenizer = CLIPTokenizer(str(words / "vocab.json"), str(words / "merges.txt"), model_max_length=8)
    torch.manual_seed(0)
    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=8,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 16],
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=[8, 16],
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(num_train_timesteps=100),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(folder)


def make_captioned_images(folder: Path, count: int, size: int = 16) -> None:
    """``count`` random PNGs and their captions (metadata.jsonl: ``file_name``, ``text``): an imagefolder."""
    from PIL import Image

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    colors = ("red", "green", "blue", "black")
    rows = []
    for i in range(count):
        pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"{i:03d}.png")
        rows.append(json.dumps({"file_name": f"{i:03d}.png", "text": f"a {colors[i % 4]} square"}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")


@dataclass
class LoraRun:
    run: Run
    seconds: float  # wall time of the launch (launcher start to exit)

    @property
    def losses(self) -> list[tuple[int, float]]:
        """(optimizer step, ``train_loss``): the script logs, at each optimizer step, the loss gathered from every
        process (tensorboard)."""
        return [(e.step, e.value) for e in events(self.run.out / "lora" / "logs", "scalars", "train_loss")]

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.run.out / "lora" / "pytorch_lora_weights.safetensors"))


def steps_per_epoch(processes: int) -> int:
    return LORA_IMAGES // (2 * processes)


def run_lora(base: Path, out: Path, processes: int, accelerate: bool, resume_from: Path | None = None) -> LoraRun:
    """The upstream script in ``out`` on ``processes`` processes, under accel launch or (``accelerate``) under
    Accelerate 1.15; a checkpoint at the end of every epoch; with ``resume_from`` (a checkpoint folder of an earlier
    run), that checkpoint alone is copied into the output folder and the run resumes from ``latest``."""
    import os
    import shutil
    import sys
    import time

    from accel.checkpoint import MANIFEST

    out.mkdir(parents=True)
    for name in ("model", "images"):
        shutil.copytree(base / name, out / name)
    extra = ["--checkpointing_steps", str(steps_per_epoch(processes))]
    if resume_from is not None:
        shutil.copytree(resume_from, out / "lora" / resume_from.name)
        extra += ["--resume_from_checkpoint", "latest"]
    env = {**torchvision_env(), "COMPAT_RECORD_MODULE": "UNet2DConditionModel"}
    if accelerate:  # the harness's own PYTHONPATH, with Accelerate's package first
        env.update(PYTHONPATH=":".join(map(str, (REAL_ACCELERATE, HERE / "record", HERE))), ACCEL_ACCELERATE="0")
    case = Case(str(TEXT_TO_IMAGE_LORA.upstream.relative_to(HERE)), args=[*LORA_ARGS, *extra], env=env, timeout=600)
    start = time.perf_counter()
    if accelerate:
        result = run_accelerate(case, out, sys.executable, num_processes=processes)
    else:
        result = run_accel(case, out, num_processes=processes)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, str(result)
    # the library that ran wrote the last checkpoint in its format: Accelerate's pickled random states, accel's manifest
    last = out / "lora" / f"checkpoint-{steps_per_epoch(processes) * LORA_EPOCHS}"
    assert (last / ("random_states_0.pkl" if accelerate else MANIFEST)).is_file(), sorted(os.listdir(last))
    if resume_from is not None:
        assert f"Resuming from checkpoint {resume_from.name}" in result.stdout + result.stderr, str(result)
    return LoraRun(result, seconds)


def lora_runs(base: Path, accelerate: bool) -> dict[tuple[int, str], LoraRun]:
    """On 1 and 2 processes: the uninterrupted run (``"full"``) and the run resumed from its checkpoint at the end
    of the first epoch (``"resumed"``)."""
    pytest.importorskip("tensorboard", reason="the script logs its losses to tensorboard")
    if not (base / "model").exists():
        make_tiny_stable_diffusion(base / "model")
        make_captioned_images(base / "images", LORA_IMAGES)
    which = "accelerate" if accelerate else "accel"
    runs: dict[tuple[int, str], LoraRun] = {}
    for processes in (1, 2):
        full = run_lora(base, base / f"{which}-{processes}-full", processes, accelerate)
        checkpoint = full.run.out / "lora" / f"checkpoint-{steps_per_epoch(processes)}"
        resumed = run_lora(base, base / f"{which}-{processes}-resumed", processes, accelerate, checkpoint)
        runs[processes, "full"], runs[processes, "resumed"] = full, resumed
    for (processes, kind), one in runs.items():
        print(f"{which} {processes} process(es) {kind}: {one.seconds:.1f} s, train_loss {one.losses}")
    return runs


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("text_to_image_lora")


@pytest.fixture(scope="module")
def lora_on_accel(lora_base: Path) -> dict[tuple[int, str], LoraRun]:
    return lora_runs(lora_base, accelerate=False)


@pytest.fixture(scope="module")
def lora_on_accelerate(lora_base: Path) -> dict[tuple[int, str], LoraRun]:
    if not (REAL_ACCELERATE / "accelerate" / "__init__.py").is_file():
        pytest.skip(f"Accelerate 1.15 is not installed in {REAL_ACCELERATE} (make setup)")
    return lora_runs(lora_base, accelerate=True)


def digests(module: torch.nn.Module) -> dict[str, str]:
    import hashlib

    return {
        name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        for name, p in module.named_parameters()
    }


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_text_to_image_lora_unchanged_on_accel_accelerate(
    lora_base: Path, lora_on_accel: dict[tuple[int, str], LoraRun]
) -> None:
    """On 1 and 2 processes the script trains the LoRA layers and nothing else, writes
    ``pytorch_lora_weights.safetensors``, which the pipeline loads, and its checkpoints hold the LoRA weights (the
    script's save hook); on 1 process the run resumed from the first epoch's checkpoint is the uninterrupted run's
    last two epochs bit for bit: losses, learning rates and the LoRA weights it saves."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    base = digests(UNet2DConditionModel.from_pretrained(lora_base / "model", subfolder="unet"))
    for processes in (1, 2):
        full = lora_on_accel[processes, "full"]
        steps = steps_per_epoch(processes) * LORA_EPOCHS
        assert [step for step, _ in full.losses] == list(range(1, steps + 1)), full.run
        assert len(full.run.lrs) == steps and all(math.isfinite(v) for _, v in full.losses)
        checkpoints = sorted((full.run.out / "lora").glob("checkpoint-*/pytorch_lora_weights.safetensors"))
        assert len(checkpoints) == LORA_EPOCHS, checkpoints
        weights = full.weights
        assert weights and all(k.startswith("unet.") and ".lora." in k for k in weights), sorted(weights)[:4]
        # PEFT's gaussian init starts every lora.up (lora_B) at zero: all of them moved
        assert all(w.abs().sum() > 0 for k, w in weights.items() if ".lora.up." in k)
        # the UNet as training left it: its base weights are the pretrained ones, bit for bit
        trained = full.run.record(0)["params"]
        kept = {k.replace(".base_layer", ""): v for k, v in trained.items() if ".lora_" not in k}
        assert kept == base
        assert any(".lora_" in k for k in trained)
    pipeline = StableDiffusionPipeline.from_pretrained(lora_base / "model", safety_checker=None)
    pipeline.load_lora_weights(lora_on_accel[2, "full"].run.out / "lora")
    images = pipeline("a red square", num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 16, 16, 3)
    full, resumed = lora_on_accel[1, "full"], lora_on_accel[1, "resumed"]
    first = steps_per_epoch(1)
    assert resumed.losses == full.losses[first:]
    assert resumed.run.lrs == full.run.lrs[first:]
    assert same_weights(resumed.weights, full.weights)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="by design: a checkpoint the main process saves alone (`if accelerator.is_main_process: "
    "accelerator.save_state(...)`) holds no random states of the other processes, which never call save_state "
    "(docs/migrating-from-accelerate.md, 'Libraries built on Accelerate'); strict, so a change is noticed",
)
def test_text_to_image_lora_resume_on_two_processes_is_exact(lora_on_accel: dict[tuple[int, str], LoraRun]) -> None:
    """On 2 processes the resumed run has the same learning rates, but process 1 restarts from the random states of
    its fresh start (noise, timesteps, the VAE's sample): its losses and the LoRA weights differ from the
    uninterrupted run's from the first resumed step."""
    full, resumed = lora_on_accel[2, "full"], lora_on_accel[2, "resumed"]
    first = steps_per_epoch(2)
    assert resumed.run.lrs == full.run.lrs[first:]
    assert resumed.losses == full.losses[first:]
    assert same_weights(resumed.weights, full.weights)


@pytest.mark.slow
def test_text_to_image_lora_same_as_accelerate(
    lora_on_accel: dict[tuple[int, str], LoraRun], lora_on_accelerate: dict[tuple[int, str], LoraRun]
) -> None:
    """Under Accelerate 1.15 the same script and arguments have accel-accelerate's learning rate at every optimizer
    step (1 and 2 processes, uninterrupted and resumed), and the math is the same (Accelerate's sampler rules: the
    batches and the draws of the global generator), so the uninterrupted runs' losses and saved LoRA weights are
    Accelerate's bit for bit, and so is the run resumed on 1 process. The arguments have no random transform
    (``--center_crop``, no ``--random_flip``): Accelerate's DataLoaderShard loads batch k+1 before it yields batch k,
    so flips drawn from the global generator would come before step k's noise under Accelerate and after it under
    accel, which loads a batch when it is asked for (the losses then differ from step 1). What Accelerate's own
    resume does is measured and printed, not asserted."""
    for key, ours in lora_on_accel.items():
        theirs = lora_on_accelerate[key]
        assert ours.run.lrs == theirs.run.lrs, (key, ours.run.lrs, theirs.run.lrs)
        print(f"{key}: wall time accel {ours.seconds:.1f} s, Accelerate {theirs.seconds:.1f} s")
    for key in ((1, "full"), (2, "full"), (1, "resumed")):
        ours, theirs = lora_on_accel[key], lora_on_accelerate[key]
        assert ours.losses == theirs.losses, (key, ours.losses, theirs.losses)
        assert same_weights(ours.weights, theirs.weights), key
    for processes in (1, 2):
        full, resumed = lora_on_accelerate[processes, "full"], lora_on_accelerate[processes, "resumed"]
        first = steps_per_epoch(processes)
        gap = max(abs(a[1] - b[1]) for a, b in zip(resumed.losses, full.losses[first:], strict=True))
        weights = full.weights
        moved = max((resumed.weights[k] - w).abs().max().item() for k, w in weights.items())
        print(
            f"Accelerate, {processes} process(es): resumed run vs uninterrupted: train_loss up to {gap:.3g} apart, "
            f"LoRA weights up to {moved:.3g}"
        )
