"""Write tests/data/official_losses.npz: training losses of the official CosyVoice2 code on fixed batches.

Run with the official code's virtualenv, OFFICIAL_VENV, and its checkout, OFFICIAL_CHECKOUT (never imported by
the test suite):

    OFFICIAL_VENV/bin/python tests/data/make_official_losses.py \
        --official OFFICIAL_CHECKOUT --model-dir tests/golden/tiny/model --out tests/data/official_losses.npz

It builds `llm` and `flow` from the tiny golden `cosyvoice2.yaml` with hyperpyyaml (as the official
`CosyVoice2` class does), loads `llm.pt` / `flow.pt` strictly, puts both in eval mode (no dropout) and
computes `Qwen2LM.forward` and `CausalMaskedDiffWithXvec.forward` (which calls `compute_loss`) on
batches made from fixed seeds. See tests/data/README.md for what is stored and why.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import sys
import types
from pathlib import Path

import numpy as np
import torch

SEED = 20241
LM_TEXT_LEN = [7, 5, 9]
LM_SPEECH_LEN = [20, 15, 24]  # speech / text <= 3: the official forward always takes the unistream layout
FLOW_TOKEN_LEN = 30  # one length for every row (see README: padding of unequal rows)
FLOW_BATCH = 2
FLOW_CASES = [  # (streaming, prompt frames per row (0: no prompt condition), torch seed before forward)
    (False, [10, 0], 101),
    (True, [0, 17], None),  # seed None: the first seed >= 200 whose guidance dropout drops row 0 only
]


def stub_unused_imports() -> None:
    """Modules the official package imports at load time but the loss path never calls."""
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "torchaudio.transforms",
                 "whisper", "whisper.tokenizer", "tiktoken", "pyworld", "pyarrow", "pyarrow.parquet"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules.setdefault(name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    # built by the yaml's `hifigan` discriminator (GAN training of HiFT); never called here
    sys.modules["torchaudio.transforms"].Spectrogram = lambda *args, **kwargs: torch.nn.Identity()
    sys.modules["whisper.tokenizer"].Tokenizer = object  # base class of the tokenizer the yaml names


def build_official(official: Path, model_dir: Path):
    sys.path[:0] = [str(official), str(official / "third_party" / "Matcha-TTS")]
    stub_unused_imports()
    from hyperpyyaml import load_hyperpyyaml

    with open(model_dir / "cosyvoice2.yaml") as f:
        configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    llm, flow = configs["llm"], configs["flow"]
    llm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    flow.load_state_dict(torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    return llm.eval(), flow.eval()


def patch_empty_instruct(llm) -> None:
    """The official Qwen2LM passes empty instruct embeddings of a fixed width 896 (the released hidden size);
    the tiny model's width is 64, so give the empty tensors the model's width. No values change."""
    cls = type(llm)
    original = cls.prepare_lm_input_target

    def prepare(self, sos_emb, text_token, text_token_emb, text_token_len, task_id_emb, speech_token,
                speech_token_emb, speech_token_len, *rest):
        B, D = text_token.size(0), text_token_emb.size(-1)
        empty = torch.zeros(B, 0, dtype=text_token.dtype)
        return original(self, sos_emb, text_token, text_token_emb, text_token_len, task_id_emb, speech_token,
                        speech_token_emb, speech_token_len, empty, torch.zeros(B, 0, D), torch.zeros(B, dtype=torch.long))

    cls.prepare_lm_input_target = prepare


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def lm_batch(generator: torch.Generator, vocab: int, speech_vocab: int) -> dict[str, torch.Tensor]:
    text = [torch.randint(0, vocab, (n,), generator=generator) for n in LM_TEXT_LEN]
    speech = [torch.randint(0, speech_vocab, (n,), generator=generator) for n in LM_SPEECH_LEN]
    return {"text_token": padded(text), "text_token_len": torch.tensor(LM_TEXT_LEN),
            "speech_token": padded(speech), "speech_token_len": torch.tensor(LM_SPEECH_LEN)}


def flow_batch(generator: torch.Generator, vocab: int, ratio: int, mel_bins: int, spk_dim: int) -> dict:
    T = FLOW_TOKEN_LEN
    return {"speech_token": torch.randint(0, vocab, (FLOW_BATCH, T), generator=generator),
            "speech_token_len": torch.full((FLOW_BATCH,), T),
            "speech_feat": torch.randn(FLOW_BATCH, ratio * T, mel_bins, generator=generator) * 2.0 - 5.0,
            "speech_feat_len": torch.full((FLOW_BATCH,), ratio * T),
            "embedding": torch.randn(FLOW_BATCH, spk_dim, generator=generator)}


class ScriptedRandom:
    """Stands in for the `random` module inside cosyvoice.flow.flow: returns scripted draws in call order
    (streaming, then for each row: skip-or-condition, and the prompt length when conditioned)."""

    def __init__(self, streaming: bool, prompt_frames: list[int], feat_len: list[int]):
        self.values = [0.0 if streaming else 0.9]
        self.ints: list[int] = []
        for frames, length in zip(prompt_frames, feat_len):
            self.values.append(0.9 if frames > 0 else 0.1)  # < 0.5 skips the row
            if frames > 0:
                assert frames <= int(0.3 * length)
                self.ints.append(frames)

    def random(self) -> float:
        return self.values.pop(0)

    def randint(self, low: int, high: int) -> int:
        value = self.ints.pop(0)
        assert low <= value <= high, (low, value, high)
        return value


def replay_noise(seed: int, batch: dict, cfg_rate: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draws `compute_loss` makes after torch.manual_seed(seed): t, z, then the dropout mask."""
    generator = torch.Generator().manual_seed(seed)
    x1 = batch["speech_feat"].transpose(1, 2)
    t = torch.rand(FLOW_BATCH, 1, 1, generator=generator)
    z = torch.randn(x1.shape, generator=generator)
    keep = torch.rand(FLOW_BATCH, generator=generator) > cfg_rate
    return t, z, keep


def official_flow_loss(flow, batch: dict, streaming: bool, prompt_frames: list[int], seed: int):
    import cosyvoice.flow.flow as flow_module

    flow_module.random = ScriptedRandom(streaming, prompt_frames, batch["speech_feat_len"].tolist())
    captured = {}
    original = type(flow.decoder).compute_loss

    def capture(self, *args, **kwargs):
        loss, y = original(self, *args, **kwargs)
        captured["y"] = y
        return loss, y

    type(flow.decoder).compute_loss = capture
    torch.manual_seed(seed)
    with torch.no_grad():
        loss = flow.forward(batch, torch.device("cpu"))["loss"]
    type(flow.decoder).compute_loss = original
    return loss, captured["y"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True, help="checkout of FunAudioLLM/CosyVoice")
    parser.add_argument("--model-dir", type=Path, required=True, help="tests/golden/tiny/model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm, flow = build_official(args.official, args.model_dir.resolve())
    patch_empty_instruct(llm)
    sigma_min = float(flow.decoder.sigma_min)
    cfg_rate = float(flow.decoder.training_cfg_rate)

    generator = torch.Generator().manual_seed(SEED)
    out: dict[str, np.ndarray] = {}
    lm = lm_batch(generator, llm.llm.model.config.vocab_size, llm.speech_token_size)
    with torch.no_grad():
        result = llm.forward(lm, torch.device("cpu"))
    out.update({f"lm_{k}": v.numpy() for k, v in lm.items()})
    out["lm_loss"] = np.float64(result["loss"].item())
    out["lm_accuracy"] = np.float64(result["acc"].item())

    fb = flow_batch(generator, flow.vocab_size, flow.token_mel_ratio, flow.output_size,
                    flow.spk_embed_affine_layer.in_features)
    out.update({f"flow_{k}": v.numpy() for k, v in fb.items()})
    out["flow_sigma_min"], out["flow_training_cfg_rate"] = np.float64(sigma_min), np.float64(cfg_rate)
    for case, (streaming, prompt_frames, seed) in enumerate(FLOW_CASES):
        if seed is None:
            seed = next(s for s in range(200, 10_000) if replay_noise(s, fb, cfg_rate)[2].tolist() == [False, True])
        loss, y = official_flow_loss(flow, fb, streaming, prompt_frames, seed)
        t, z, keep = replay_noise(seed, fb, cfg_rate)
        expected_y = (1 - (1 - sigma_min) * t) * z + t * fb["speech_feat"].transpose(1, 2)
        assert torch.equal(y, expected_y), "replayed t and z differ from the official draws"
        out[f"flow{case}_streaming"] = np.bool_(streaming)
        out[f"flow{case}_prompt_frames"] = np.array(prompt_frames, dtype=np.int64)
        out[f"flow{case}_seed"] = np.int64(seed)
        out[f"flow{case}_t"], out[f"flow{case}_z"] = t[:, 0, 0].numpy(), z.numpy()
        out[f"flow{case}_keep_condition"] = keep.numpy()
        out[f"flow{case}_loss"] = np.float64(loss.item())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    for key, value in out.items():
        if value.ndim == 0:
            print(f"{key} = {value}")


if __name__ == "__main__":
    main()
