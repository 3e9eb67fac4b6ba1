"""Write tests/data/official_losses*.npz: training losses of the official code on fixed batches.

Run with the official code's virtualenv, OFFICIAL_VENV, and its checkout, OFFICIAL_CHECKOUT (never imported by
the test suite), once per family (the folder's yaml decides):

    OFFICIAL_VENV/bin/python tests/data/make_official_losses.py \
        --official OFFICIAL_CHECKOUT --model-dir tests/golden/tiny/model --out tests/data/official_losses.npz
    OFFICIAL_VENV/bin/python tests/data/make_official_losses.py \
        --official OFFICIAL_CHECKOUT --model-dir tests/golden/cv3/tiny/model --out tests/data/official_losses_cv3.npz

It builds `llm` and `flow` from the tiny golden yaml with hyperpyyaml (as the official `CosyVoice2` and
`CosyVoice3` classes do), loads `llm.pt` / `flow.pt` strictly, puts both in eval mode (no dropout) and
computes the LM's forward (`Qwen2LM`, `CosyVoice3LM`) and the flow's (`CausalMaskedDiffWithXvec`,
`CausalMaskedDiffWithDiT`; both call `compute_loss`) on batches made from fixed seeds. See
tests/data/README.md for what is stored and why.
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
# A second LM batch with the bistream layout: its rows' draws are scripted (True: Python's random says bistream).
# Row 0: 1 whole 5:15 group, then 2 text tokens; row 1: speech exactly 3x its text, so unistream; row 2: 2 whole
# groups and no text left; row 3: drawn unistream.
LMB_SEED = 20242
LMB_TEXT_LEN = [7, 5, 10, 6]
LMB_SPEECH_LEN = [25, 15, 40, 30]
LMB_DRAWS = [True, True, True, False]
FLOW_TOKEN_LEN = 30  # one length for every CosyVoice2 row (see README: padding of unequal rows)
FLOW_BATCH = 2
CV3_FLOW_TOKEN_LEN = [30, 24]  # the DiT flow zeroes padding before its look-ahead: rows may differ
CV3_FLOW_CASES = [(False, [10, 0], 101), (True, [0, 13], None)]  # row 1's 48 frames allow 14 prompt frames
CV3_INSTRUCT_LEN = 6  # random ids, the last one <|endofprompt|>, the same for every row (as the recipe's)
END_OF_PROMPT_ID = 151646
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


def yaml_of(model_dir: Path) -> Path:
    """The family yaml of the folder: cosyvoice2.yaml or cosyvoice3.yaml."""
    (path,) = [model_dir / name for name in ("cosyvoice2.yaml", "cosyvoice3.yaml") if (model_dir / name).exists()]
    return path


def build_official(official: Path, model_dir: Path):
    sys.path[:0] = [str(official), str(official / "third_party" / "Matcha-TTS")]
    stub_unused_imports()
    from hyperpyyaml import load_hyperpyyaml

    with open(yaml_of(model_dir)) as f:
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


def lm_batch(generator: torch.Generator, vocab: int, speech_vocab: int, instruct: bool,
             text_len: list[int], speech_len: list[int]) -> dict[str, torch.Tensor]:
    text = [torch.randint(0, vocab, (n,), generator=generator) for n in text_len]
    speech = [torch.randint(0, speech_vocab, (n,), generator=generator) for n in speech_len]
    batch = {"text_token": padded(text), "text_token_len": torch.tensor(text_len),
             "speech_token": padded(speech), "speech_token_len": torch.tensor(speech_len)}
    if instruct:  # CosyVoice3LM reads an instruct before the text
        ids = torch.randint(0, vocab, (CV3_INSTRUCT_LEN,), generator=generator)
        ids[-1] = END_OF_PROMPT_ID
        batch["instruct_token"] = ids.expand(len(text_len), -1).clone()
        batch["instruct_token_len"] = torch.full((len(text_len),), CV3_INSTRUCT_LEN)
    return batch


class ScriptedDraws:
    """Stands in for the `random` module inside cosyvoice.llm.llm: one draw per row, < 0.5 where bistream."""

    def __init__(self, bistream: list[bool]):
        self.values = [0.1 if row else 0.9 for row in bistream]

    def random(self) -> float:
        return self.values.pop(0)


def official_lm_loss(llm, batch: dict, draws: list[bool] | None = None) -> dict:
    import cosyvoice.llm.llm as llm_module

    if draws is not None:
        llm_module.random = ScriptedDraws(draws)
    with torch.no_grad():
        result = llm.forward(batch, torch.device("cpu"))
    assert draws is None or not llm_module.random.values, "the forward drew another number of rows"
    return result


def flow_batch(generator: torch.Generator, vocab: int, ratio: int, mel_bins: int, spk_dim: int,
               token_len: list[int]) -> dict:
    T = max(token_len)
    lengths = torch.tensor(token_len)
    valid = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    feat_valid = valid.repeat_interleave(ratio, dim=1)[..., None]  # (B, ratio * T, 1)
    return {"speech_token": torch.randint(0, vocab, (FLOW_BATCH, T), generator=generator) * valid,
            "speech_token_len": lengths,
            "speech_feat": (torch.randn(FLOW_BATCH, ratio * T, mel_bins, generator=generator) * 2.0 - 5.0) * feat_valid,
            "speech_feat_len": ratio * lengths,
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
    cosyvoice3 = type(llm).__name__ == "CosyVoice3LM"
    if not cosyvoice3:
        patch_empty_instruct(llm)
    sigma_min = float(flow.decoder.sigma_min)
    cfg_rate = float(flow.decoder.training_cfg_rate)

    generator = torch.Generator().manual_seed(SEED)
    out: dict[str, np.ndarray] = {}
    vocab = llm.llm.model.config.vocab_size
    lm = lm_batch(generator, vocab, llm.speech_token_size, cosyvoice3, LM_TEXT_LEN, LM_SPEECH_LEN)
    result = official_lm_loss(llm, lm)
    out.update({f"lm_{k}": v.numpy() for k, v in lm.items()})
    out["lm_loss"] = np.float64(result["loss"].item())
    out["lm_accuracy"] = np.float64(result["acc"].item())
    # the bistream batch from a generator of its own, so that the arrays above and below stay as they were
    lmb = lm_batch(torch.Generator().manual_seed(LMB_SEED), vocab, llm.speech_token_size, cosyvoice3,
                   LMB_TEXT_LEN, LMB_SPEECH_LEN)
    result = official_lm_loss(llm, lmb, LMB_DRAWS)
    out.update({f"lmb_{k}": v.numpy() for k, v in lmb.items()})
    out["lmb_draws"] = np.array(LMB_DRAWS)
    out["lmb_loss"] = np.float64(result["loss"].item())
    out["lmb_accuracy"] = np.float64(result["acc"].item())

    fb = flow_batch(generator, flow.vocab_size, flow.token_mel_ratio, flow.output_size,
                    flow.spk_embed_affine_layer.in_features,
                    CV3_FLOW_TOKEN_LEN if cosyvoice3 else [FLOW_TOKEN_LEN] * FLOW_BATCH)
    out.update({f"flow_{k}": v.numpy() for k, v in fb.items()})
    out["flow_sigma_min"], out["flow_training_cfg_rate"] = np.float64(sigma_min), np.float64(cfg_rate)
    for case, (streaming, prompt_frames, seed) in enumerate(CV3_FLOW_CASES if cosyvoice3 else FLOW_CASES):
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
