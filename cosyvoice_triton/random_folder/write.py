"""Write a CosyVoice2 model folder with random weights in the released layout.

The folder loads through the same code as the real `CosyVoice2-0.5B` folder: `cosyvoice2.yaml`,
`llm.pt`, `flow.pt`, `hift.pt` (legacy weight-norm names), `campplus.onnx` and
`speech_tokenizer_v2.onnx` (random stand-ins with the official inputs and outputs), and
`CosyVoice-BlankEN/` (Qwen2 config, a small byte-level BPE tokenizer, optional backbone weights).
The configs are written first and the modules are then built from them, so shapes cannot drift.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..config import read_yaml
from ..models.flow import FlowConfig, FlowModel
from ..models.hift import HiFTConfig, HiFTGenerator
from ..models.hift_source import WEIGHT_NORMED
from ..models.speech_lm import SpeechLM, SpeechLMConfig
from .model_yaml import SIZES, qwen_config, render_model_yaml
from .onnx_standins import write_campplus_standin, write_speech_tokenizer_standin
from .tokenizer_standin import write_tokenizer_standin
from .marker import mark_random

# The released Qwen2.5 vocabulary; the tiny size uses the stand-in tokenizer's own size instead.
FULL_TEXT_VOCAB = 151936
TINY_TEXT_VOCAB = 2048
F0_STD_HZ, F0_MEAN_HZ = 60.0, 120.0


def write_random_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, backbone_weights: bool = True) -> Path:
    """Create `out_dir` (it must be absent or empty) and fill it. Returns the folder."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    dims = SIZES[size]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    qwen_dir = out / "CosyVoice-BlankEN"
    qwen_dir.mkdir(parents=True, exist_ok=True)

    text_vocab = write_tokenizer_standin(qwen_dir, vocab_size=TINY_TEXT_VOCAB)
    if size == "full":
        text_vocab = FULL_TEXT_VOCAB
    (out / "cosyvoice2.yaml").write_text(render_model_yaml(dims))
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

    yaml = read_yaml(out / "cosyvoice2.yaml")
    torch.save(FlowModel(FlowConfig.from_yaml(yaml)).state_dict(), out / "flow.pt")
    hift = HiFTGenerator(HiFTConfig.from_yaml(yaml["hift"]))
    _make_f0_audible(hift)
    torch.save(_weight_norm_state(hift), out / "hift.pt")

    write_campplus_standin(out / "campplus.onnx", seed=seed)
    write_speech_tokenizer_standin(out / "speech_tokenizer_v2.onnx", seed=seed)
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
def _make_f0_audible(hift: HiFTGenerator) -> None:
    """Rescale the F0 read-out so random weights give voiced frames (tens to hundreds of Hz).

    With default initialisation the predicted F0 is ~0.1 Hz, below the 10 Hz voicing threshold, so the
    harmonic source would never run and benchmarks would skip real work.
    """
    mel = torch.randn(4, hift.config.in_channels, 100, generator=torch.Generator().manual_seed(0)) * 2 - 6
    classifier = hift.f0_predictor.classifier
    hidden = hift.f0_predictor.condnet(mel).transpose(1, 2)  # (B, T, C)
    raw = hidden @ classifier.weight.T  # (B, T, 1), before the bias
    classifier.weight.mul_(F0_STD_HZ / raw.std().clamp_min(1e-12))
    classifier.bias.fill_(F0_MEAN_HZ)


def _weight_norm_state(hift: HiFTGenerator) -> dict[str, Tensor]:
    """The state dict with every weight-normed conv split into legacy `weight_g` / `weight_v`."""
    state = hift.state_dict()
    for name, module in hift.named_modules():
        if isinstance(module, WEIGHT_NORMED):
            weight = state.pop(f"{name}.weight")
            dims = tuple(range(1, weight.dim()))
            state[f"{name}.weight_g"] = weight.norm(dim=dims, keepdim=True)  # (dim0, 1, 1)
            state[f"{name}.weight_v"] = weight
    return state
