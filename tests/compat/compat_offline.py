"""Offline stand-ins for what Accelerate's examples download: hub models and tokenizers, GLUE MRPC / wikitext, the
`evaluate` metrics, the Oxford pets images, timm's pretrained models and torchvision's transforms.

Each port in this folder imports only the names it replaces from here and says so in its header. Everything else in
a port (the Accelerate API use, the training loop) is Accelerate's example with the renames of
docs/migrating-from-accelerate.md. The same port also runs under Accelerate 1.15 (``accelerate_shim/``), so nothing
here may depend on accel.

Sizes come from the environment so the tests can keep runs short: ``COMPAT_TRAIN_SIZE``, ``COMPAT_EVAL_SIZE``
(rows of the synthetic datasets) and ``COMPAT_CONFIG`` (JSON merged into an example's ``config`` dict by
``config()``).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:  # timm/torchvision import PIL.Image in the originals, and the image examples call `PIL.Image.open`
    import PIL.Image  # noqa: F401
except ImportError:  # an Accelerate venv without Pillow: only the image examples need it
    pass

# ---------------------------------------------------------------------------------------------------------------
# sizes and hyper-parameter overrides


def train_size(default: int = 128) -> int:
    return int(os.environ.get("COMPAT_TRAIN_SIZE", default))


def eval_size(default: int = 64) -> int:
    return int(os.environ.get("COMPAT_EVAL_SIZE", default))


def config(values: dict[str, Any]) -> dict[str, Any]:
    """The example's ``config`` dict with the test's overrides (``COMPAT_CONFIG``, JSON) merged in."""
    return {**values, **json.loads(os.environ.get("COMPAT_CONFIG", "{}"))}


# ---------------------------------------------------------------------------------------------------------------
# text data: GLUE MRPC-shaped sentence pairs and a wikitext-shaped corpus, both synthetic and deterministic

# Two word classes. A pair is labelled 1 ("equivalent") when the content words of sentence1 come from the first class:
# a tiny BERT learns that in a few dozen steps, so the tests can ask for a falling loss.
_WORDS_A = (
    "alpha bright calm dawn early fresh gentle happy ideal jolly kind light merry noble open proud quick "
    "rich sunny true"
).split()
_WORDS_B = (
    "ashen bleak cold dark empty faint grim harsh idle jaded lost murky numb odd pale quiet rough sad tired vague"
).split()
_FILLER = "the a of and to in is was it for on with as at by from".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>", *_FILLER, *_WORDS_A, *_WORDS_B]


def _sentence(rng: random.Random, positive: bool) -> str:
    words = [rng.choice(_WORDS_A if positive else _WORDS_B) for _ in range(rng.randint(4, 7))]
    words += [rng.choice(_FILLER) for _ in range(rng.randint(0, 2))]
    rng.shuffle(words)
    return " ".join(words)


def _mrpc_split(n: int, seed: int) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        label = rng.random() < 0.5
        rows["sentence1"].append(_sentence(rng, label))
        rows["sentence2"].append(_sentence(rng, rng.random() < 0.5))
        rows["label"].append(int(label))
        rows["idx"].append(i)
    return rows


def _text_split(n: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {"text": [" ".join(_sentence(rng, rng.random() < 0.5) for _ in range(3)) for _ in range(n)]}


def load_dataset(path: str, name: str | None = None, **_: Any) -> Any:
    """``datasets.load_dataset`` for the data sets the examples name, made offline: ``glue``/``mrpc`` (sentence1,
    sentence2, label, idx), ``wikitext`` (text), ``parti-prompts`` (Prompt; ``COMPAT_EVAL_SIZE`` rows). Returns a
    real ``datasets.DatasetDict`` (a ``Dataset`` for parti-prompts, which the example loads with ``split=``)."""
    from datasets import Dataset, DatasetDict

    n_train, n_eval = train_size(), eval_size()
    if path.endswith("parti-prompts"):  # only a "train" split of prompts
        rng = random.Random(4)
        prompts = [" ".join(rng.choice(_WORDS_A + _WORDS_B) for _ in range(3)) for _ in range(n_eval)]
        return Dataset.from_dict({"Prompt": prompts, "Category": ["Abstract"] * n_eval})
    if path.endswith("pokemon-blip-captions-en-zh"):  # a Dataset of English captions (the example loads a split)
        rng = random.Random(5)
        return Dataset.from_dict({"en_text": [_sentence(rng, rng.random() < 0.5) for _ in range(n_eval)]})
    if path.endswith("glue") and name == "mrpc":
        splits = {
            "train": _mrpc_split(n_train, 1),
            "validation": _mrpc_split(n_eval, 2),
            "test": _mrpc_split(n_eval, 3),
        }
    elif path.endswith("wikitext"):
        splits = {
            "train": _text_split(n_train, 1),
            "validation": _text_split(n_eval, 2),
            "test": _text_split(n_eval, 3),
        }
    else:
        raise ValueError(f"compat_offline.load_dataset has no offline stand-in for {path!r} {name!r}")
    return DatasetDict({split: Dataset.from_dict(rows) for split, rows in splits.items()})


# ---------------------------------------------------------------------------------------------------------------
# tokenizers and models built from configs (no hub)


def tokenizer(name: str, use_fast: bool = True, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(name)`` offline: a word-level tokenizer over the synthetic vocabulary: a
    BERT tokenizer (pairs, [CLS]/[SEP], token_type_ids) for BERT-like names, a GPT-2-like one otherwise."""
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    if "bert" in name:
        return BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=False, **kwargs)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token="[UNK]",
        pad_token="[PAD]",
        **kwargs,
    )
    fast.model_max_length = 64
    return fast


def model_config(name: str, **kwargs: Any) -> Any:
    """``AutoConfig.from_pretrained(name)`` offline: the same architecture, two layers, hidden size 32."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, PhiConfig, VitsConfig

    if "bert" in name:
        return BertConfig(
            vocab_size=len(VOCAB),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            **kwargs,
        )
    if "phi" in name:
        return PhiConfig(
            vocab_size=len(VOCAB),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            pad_token_id=0,
            **kwargs,
        )
    if "mms-tts" in name:
        return VitsConfig(
            vocab_size=len(VOCAB),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            ffn_dim=32,
            flow_size=16,
            spectrogram_bins=17,
            upsample_initial_channel=16,
            upsample_rates=[4, 4],
            upsample_kernel_sizes=[8, 8],
            resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1, 3]],
            prior_encoder_num_flows=2,
            prior_encoder_num_wavenet_layers=1,
            posterior_encoder_num_wavenet_layers=1,
            duration_predictor_num_flows=1,
            duration_predictor_filter_channels=16,
            depth_separable_num_layers=2,
            sampling_rate=16000,
            **kwargs,
        )
    if "smollm" in name.lower() or "llama" in name.lower():
        return LlamaConfig(
            vocab_size=len(VOCAB),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            bos_token_id=5,
            eos_token_id=5,
            **kwargs,
        )
    return GPT2Config(
        vocab_size=len(VOCAB), n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=5, eos_token_id=5, **kwargs
    )


def from_pretrained(
    auto_class: Any,
    name: str,
    config: Any = None,
    from_tf: bool = False,
    device_map: Any = None,
    torch_dtype: Any = None,
    dtype: Any = None,
    **kwargs: Any,
) -> Any:
    """``auto_class.from_pretrained(name, **kwargs)`` offline: a tiny model of the same architecture
    (``from_config``) whose weights, like downloaded ones, are the same in every process and every run: they are
    drawn from a seed of their own, without touching the caller's random state."""
    config = config if config is not None else model_config(name, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = auto_class.from_config(config) if hasattr(auto_class, "from_config") else auto_class(config)
    if torch_dtype is not None or dtype is not None:
        model = model.to(torch_dtype if torch_dtype is not None else dtype)
    if device_map is not None:
        model = model.to(device_map)
    return model


# ---------------------------------------------------------------------------------------------------------------
# metrics: evaluate.load(...) with scikit-learn


class Metric:
    """``evaluate.load("glue", "mrpc")`` / ``evaluate.load("accuracy")``: add_batch + compute, with sklearn."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.predictions: list[Any] = []
        self.references: list[Any] = []

    def add_batch(self, predictions: Any, references: Any) -> None:
        self.predictions.extend(torch.as_tensor(predictions).cpu().tolist())
        self.references.extend(torch.as_tensor(references).cpu().tolist())

    def compute(self, predictions: Any = None, references: Any = None) -> dict[str, float]:
        from sklearn.metrics import accuracy_score, f1_score

        if predictions is not None:
            self.add_batch(predictions, references)
        functions: dict[str, Callable[[Any, Any], float]] = {"accuracy": accuracy_score, "f1": f1_score}
        result = {name: float(functions[name](self.references, self.predictions)) for name in self.names}
        self.predictions, self.references = [], []
        return result


def load_metric(path: str, name: str | None = None, **_: Any) -> Metric:
    if path == "glue" and name == "mrpc":
        return Metric(["accuracy", "f1"])
    if path == "accuracy":
        return Metric(["accuracy"])
    raise ValueError(f"compat_offline.load_metric has no offline stand-in for {path!r} {name!r}")


# ---------------------------------------------------------------------------------------------------------------
# images: the Oxford pets folder layout (``<breed>_<n>.jpg``), a timm-like tiny CNN, torchvision-like transforms

PET_BREEDS = ("abyssinian", "beagle", "bengal", "boxer")
_COLOURS = {"abyssinian": (200, 60, 60), "beagle": (60, 200, 60), "bengal": (60, 60, 200), "boxer": (200, 200, 60)}


def make_pets(directory: str | os.PathLike[str], per_breed: int = 16, size: int = 40, seed: int = 0) -> Path:
    """Write ``per_breed`` noisy JPEGs per breed, named like the Oxford-IIIT pets files; the breed decides the
    colour, so a tiny CNN can learn it."""
    from PIL import Image

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(seed)
    for breed in PET_BREEDS:
        for i in range(per_breed):
            noise = gen.integers(-30, 30, size=(size, size, 3))
            pixels = np.clip(np.array(_COLOURS[breed])[None, None, :] + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(out / f"{breed}_{i + 1}.jpg")
    return out


class TinyCNN(torch.nn.Module):
    """Stands in for ``timm.create_model("resnet50d", pretrained=True, num_classes=...)``: a body and a classifier
    (``get_classifier()``) and timm's ``default_cfg`` mean/std."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(  # no BatchNorm: the body is frozen, its running statistics would drift
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        self.fc = torch.nn.Linear(16, num_classes)
        self.default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

    def get_classifier(self) -> torch.nn.Module:
        return self.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


def create_model(name: str, pretrained: bool = False, num_classes: int = 1000) -> TinyCNN:
    return TinyCNN(num_classes)


def _to_tensor(image: Any) -> torch.Tensor:
    if isinstance(image, torch.Tensor):
        return image
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    def __call__(self, image: Any) -> torch.Tensor:
        return _to_tensor(image)


class Resize:
    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, image: Any) -> torch.Tensor:
        x = _to_tensor(image)[None]
        return torch.nn.functional.interpolate(x, size=self.size, mode="bilinear", align_corners=False)[0]


class RandomResizedCrop:
    """A random crop of ``scale`` of the area (aspect ratio 3/4..4/3) resized to ``size``; torch's RNG."""

    def __init__(self, size: int | tuple[int, int], scale: tuple[float, float] = (0.08, 1.0)) -> None:
        self.resize = Resize(size)
        self.scale = scale

    def __call__(self, image: Any) -> torch.Tensor:
        x = _to_tensor(image)
        _, h, w = x.shape
        area = h * w * float(torch.empty(1).uniform_(*self.scale))
        ratio = float(torch.empty(1).uniform_(3 / 4, 4 / 3))
        ch, cw = min(h, max(1, round((area / ratio) ** 0.5))), min(w, max(1, round((area * ratio) ** 0.5)))
        top = int(torch.randint(0, h - ch + 1, (1,)))
        left = int(torch.randint(0, w - cw + 1, (1,)))
        return self.resize(x[:, top : top + ch, left : left + cw])


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean)[:, None, None]
        self.std = torch.tensor(std)[:, None, None]

    def __call__(self, image: Any) -> torch.Tensor:
        return (_to_tensor(image) - self.mean) / self.std


# ---------------------------------------------------------------------------------------------------------------
# diffusers: a tiny Stable Diffusion pipeline built from configs (the shape diffusers' own tests use)


def diffusion_pipeline(name: str, torch_dtype: Any = None, **_: Any) -> Any:
    """``DiffusionPipeline.from_pretrained(name)`` offline: a Stable Diffusion pipeline with a 2-block UNet, a tiny
    VAE and a 2-layer CLIP text encoder (fixed weights, as downloaded ones are), 32x32 images by default."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        unet = UNet2DConditionModel(
            block_out_channels=(8, 16),
            layers_per_block=1,
            sample_size=16,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=16,
            norm_num_groups=4,
            attention_head_dim=2,
        )
        vae = AutoencoderKL(
            block_out_channels=(8, 16),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            norm_num_groups=4,
        )
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(VOCAB),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=32,
                bos_token_id=2,
                eos_token_id=3,
                pad_token_id=0,
            )
        )
    tok = tokenizer("clip")
    tok.model_max_length = 16
    tok.pad_token = "[PAD]"
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(torch_dtype) if torch_dtype is not None else pipe
