"""Write a model folder of either family with random weights in the released layout.

The folder loads through the same code as the real `CosyVoice2-0.5B` / `Fun-CosyVoice3-0.5B-2512` folder:
the family's yaml, `llm.pt`, `flow.pt`, `hift.pt` (legacy weight-norm names), `campplus.onnx` and the
speech tokenizer (random stand-ins with the official inputs and outputs), and `CosyVoice-BlankEN/` (Qwen2
config, a small byte-level BPE tokenizer with the family's special tokens, optional backbone weights).
The configs are written first and the modules are then built from them, so shapes cannot drift.
A CosyVoice3 folder keeps the released text vocabulary at every size: its LM looks for `<|endofprompt|>`
at id 151646, so the tokenizer is padded to the released ids (tokenizer_standin.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..config import read_yaml
from ..family import COSYVOICE2, COSYVOICE3, ModelFamily, family_named
from ..models.family import MODELS
from ..models.hift_source import WEIGHT_NORMED
from ..models.speech_lm import SpeechLM, SpeechLMConfig
from .cosyvoice3_yaml import COSYVOICE3_SIZES, CosyVoice3Size, render_cosyvoice3_yaml
from .marker import mark_random
from .model_yaml import SIZES, ModelSize, qwen_config, render_model_yaml
from .onnx_standins import write_campplus_standin, write_speech_tokenizer_standin
from .tokenizer_standin import write_tokenizer_standin

# The released Qwen2.5 vocabulary; a tiny CosyVoice2 folder uses the stand-in tokenizer's own size instead.
FULL_TEXT_VOCAB = 151936
TINY_TEXT_VOCAB = 2048
RELEASED_BASE_VOCAB = 151643  # the Qwen2.5 BPE entries; the added tokens follow (<|endoftext|> = 151643)
F0_STD_HZ, F0_MEAN_HZ = 60.0, 120.0


@dataclass(frozen=True)
class FolderRecipe:
    sizes: dict  # size name -> the dimensions its yaml takes
    render_yaml: Callable[..., str]
    released_ids: bool  # the text vocabulary and the special tokens' ids are the released ones at every size


RECIPES = {
    COSYVOICE2: FolderRecipe(SIZES, render_model_yaml, released_ids=False),
    COSYVOICE3: FolderRecipe(COSYVOICE3_SIZES, render_cosyvoice3_yaml, released_ids=True),
}


def write_random_model(out_dir: str | Path, size: str | ModelSize | CosyVoice3Size = "tiny", seed: int = 0,
                       backbone_weights: bool = True, family: ModelFamily | str = COSYVOICE2) -> Path:
    """Create `out_dir` (it must be absent or empty) and fill it with a `family` folder. `size` names one of
    the family's sizes (tiny, full) or gives the dimensions themselves. Returns the folder."""
    family = family_named(family) if isinstance(family, str) else family
    recipe = RECIPES[family]
    if isinstance(size, str) and size not in recipe.sizes:
        raise ValueError(f"size must be one of {sorted(recipe.sizes)}, got {size!r}")
    dims = recipe.sizes[size] if isinstance(size, str) else size
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    qwen_dir = out / "CosyVoice-BlankEN"
    qwen_dir.mkdir(parents=True, exist_ok=True)

    if recipe.released_ids:
        write_tokenizer_standin(qwen_dir, FULL_TEXT_VOCAB, family.special_tokens, base_vocab=RELEASED_BASE_VOCAB)
        text_vocab = FULL_TEXT_VOCAB
    else:
        text_vocab = write_tokenizer_standin(qwen_dir, TINY_TEXT_VOCAB, family.special_tokens)
        if size == "full":
            text_vocab = FULL_TEXT_VOCAB
    (out / family.yaml_file).write_text(recipe.render_yaml(dims))
    _write_json(qwen_dir / "config.json", qwen_config(dims, text_vocab))
    _write_json(qwen_dir / "generation_config.json", {"bos_token_id": text_vocab - 1, "do_sample": False,
                                                      "eos_token_id": text_vocab - 1, "max_new_tokens": 2048})
    (out / "config.json").write_text("{}")
    (out / "configuration.json").write_text('{"framework":"Pytorch","task":"text-to-speech"}')
    mark_random(out)

    torch.manual_seed(seed)
    llm = SpeechLM(SpeechLMConfig.from_model_dir(out), max_seq_len=8)
    torch.save(llm.state_dict(), out / "llm.pt")
    if backbone_weights:
        _write_backbone(llm, qwen_dir / "model.safetensors")
    del llm

    yaml, models = read_yaml(out / family.yaml_file), MODELS[family]
    torch.save(models.flow(models.flow.config_from_yaml(yaml)).state_dict(), out / "flow.pt")
    hift = models.vocoder(models.vocoder.config_from_yaml(yaml))
    _make_f0_audible(hift)
    torch.save(_weight_norm_state(hift), out / "hift.pt")

    write_campplus_standin(out / "campplus.onnx", seed=seed)
    write_speech_tokenizer_standin(out / family.speech_tokenizer_file, seed=seed)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_backbone(llm: SpeechLM, path: Path) -> None:
    """`model.safetensors` as the release ships it (bf16, HF names); this stack reads llm.pt instead."""
    from safetensors.torch import save_file

    prefix = "llm.model."
    state = {k[len(prefix):]: v.to(torch.bfloat16).contiguous()
             for k, v in llm.state_dict().items() if k.startswith(prefix) and k != prefix + "lm_head.weight"}
    save_file(state, str(path), metadata={"format": "pt"})


@torch.no_grad()
def _make_f0_audible(hift: torch.nn.Module) -> None:
    """Rescale the F0 read-out so random weights give voiced frames (tens to hundreds of Hz).

    With default initialisation the predicted F0 is ~0.1 Hz, below the 10 Hz voicing threshold, so the
    harmonic source would never run and benchmarks would skip real work.
    """
    classifier = hift.f0_predictor.classifier
    mel = torch.randn(4, hift.config.in_channels, 100, generator=torch.Generator().manual_seed(0)) * 2 - 6
    mel = mel.to(classifier.weight.dtype)  # CosyVoice3's predictor runs in float64
    hidden = hift.f0_predictor.condnet(mel).transpose(1, 2)  # (B, T, C)
    raw = hidden @ classifier.weight.T  # (B, T, 1), before the bias
    classifier.weight.mul_(F0_STD_HZ / raw.std().clamp_min(1e-12))
    classifier.bias.fill_(F0_MEAN_HZ)


def _weight_norm_state(hift: torch.nn.Module) -> dict[str, Tensor]:
    """The state dict in float32, as released, with every weight-normed conv split into legacy `weight_g` /
    `weight_v`."""
    state = {key: value.float() for key, value in hift.state_dict().items()}
    for name, module in hift.named_modules():
        if isinstance(module, WEIGHT_NORMED):
            weight = state.pop(f"{name}.weight")
            dims = tuple(range(1, weight.dim()))
            state[f"{name}.weight_g"] = weight.norm(dim=dims, keepdim=True)  # (dim0, 1, 1)
            state[f"{name}.weight_v"] = weight
    return state
