"""Turn a reference recording into the voice features the models need.

For one recording (any sample rate, mono):
  - speaker embedding: 16 kHz → `speaker_fbank` → campplus.onnx → (192,)
  - speech tokens: 16 kHz → `whisper_log_mel` (128 mels) → speech_tokenizer_v2.onnx → (N,) at 25 Hz
  - prompt mel: 24 kHz → `prompt_mel` → (T, 80) at 50 Hz
Then tokens and mel are aligned as the official zero-shot frontend does: keep
n = min(T // token_mel_ratio, N) tokens and token_mel_ratio * n mel frames.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.engines.base import Runner
from cosyvoice_triton.engines.onnx_session import Device, input_names, open_session
from cosyvoice_triton.preprocess.audio import resample, validate_prompt_audio
from cosyvoice_triton.preprocess.features import MelConfig, prompt_mel, speaker_fbank, whisper_log_mel
from cosyvoice_triton.messages import PromptFeatures
from cosyvoice_triton.preprocess.voice_features import audio_sha256

SPEAKER_RATE = 16000  # CAM++ and the S3 tokenizer
WHISPER_MELS = 128


class PromptEncoder:
    """Speaker embedding, prompt speech tokens and prompt mel of a reference recording.

    `campplus`: an ONNX Runtime session of campplus.onnx, or a `Runner` of it on any engine
    (`engines.select.open_campplus`)."""

    def __init__(self, campplus: ort.InferenceSession | Runner, speech_tokenizer: ort.InferenceSession,
                 mel_config: MelConfig = MelConfig(), token_mel_ratio: int = 2):
        self.campplus = campplus
        self.speech_tokenizer = speech_tokenizer
        self.mel_config = mel_config
        self.token_mel_ratio = token_mel_ratio

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: Device = "auto") -> PromptEncoder:
        """Open campplus.onnx (on the CPU, as the official frontend) and speech_tokenizer_v2.onnx."""
        paths = ModelPaths(Path(model_dir))
        config = read_yaml(paths.yaml)
        return cls(campplus=open_session(paths.campplus, device="cpu"),
                   speech_tokenizer=open_session(paths.speech_tokenizer, device=device),
                   mel_config=MelConfig.from_yaml(config),
                   token_mel_ratio=int(config.get("token_mel_ratio", 2)))

    def speaker_embedding(self, wav16k: np.ndarray) -> np.ndarray:
        """(N,) at 16 kHz → (192,) float32."""
        fbank = speaker_fbank(wav16k)[None]  # (1, T, 80)
        if isinstance(self.campplus, Runner):
            return self.campplus(fbank).cpu().numpy().reshape(-1).astype(np.float32)
        fbank = fbank.numpy()
        (name,) = input_names(self.campplus)
        return self.campplus.run(None, {name: fbank})[0].reshape(-1).astype(np.float32)

    def speech_tokens(self, wav16k: np.ndarray) -> np.ndarray:
        """(N,) at 16 kHz → (about N / 640,) int32 speech tokens."""
        feats = whisper_log_mel(wav16k, n_mels=WHISPER_MELS).numpy()[None]  # (1, 128, T)
        feats_name, length_name = input_names(self.speech_tokenizer)
        lengths = np.array([feats.shape[2]], dtype=np.int32)
        indices = self.speech_tokenizer.run(None, {feats_name: feats, length_name: lengths})[0]
        return indices.reshape(-1).astype(np.int32)

    def prompt_mel(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        """(N,) at `sample_rate` → (T, 80) float32 mel at the flow model's rate."""
        wav = resample(samples, sample_rate, self.mel_config.sampling_rate)
        return prompt_mel(wav, self.mel_config).numpy()

    def encode(self, samples: np.ndarray, sample_rate: int, prompt_text: str,
               field: str = "reference_audio") -> PromptFeatures:
        """Check the recording (errors name `field`) and compute its aligned features."""
        samples = np.asarray(samples, dtype=np.float32)
        validate_prompt_audio(samples, sample_rate, field)
        wav16k = resample(samples, sample_rate, SPEAKER_RATE)
        tokens = self.speech_tokens(wav16k)
        mel = self.prompt_mel(samples, sample_rate)
        n_tokens = min(mel.shape[0] // self.token_mel_ratio, tokens.shape[0])
        return PromptFeatures(embedding=self.speaker_embedding(wav16k),
                              speech_tokens=tokens[:n_tokens],
                              mel=np.ascontiguousarray(mel[:self.token_mel_ratio * n_tokens]),
                              text=prompt_text,
                              audio_sha256=audio_sha256(samples, sample_rate))
