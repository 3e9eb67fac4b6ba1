"""In-process CosyVoice2 synthesis: text + voice -> 24 kHz audio, offline or streaming.

This is the reference pipeline. The Triton models run the same steps, split across processes:
1. text: normalize, split into sentences, tokenize;
2. voice: prompt features (speaker embedding, prompt speech tokens, prompt mel, prompt text);
3. LLM: speech tokens, one sentence at a time, prompt laid out by mode;
4. token2wav: flow + HiFT, chunk by chunk when streaming.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..config import ModelPaths
from ..errors import InvalidInput, ModelFolderError
from ..frontend.prompt import PromptEncoder, PromptFeatures
from ..frontend.text import TextFrontend
from ..models.flow import FlowModel
from ..models.hift import HiFTGenerator
from ..models.hift_source import GeneratorNoise
from ..models.speech_lm import SpeechLM
from .chunk_policy import ChunkPolicy
from .sampling import SamplingParams
from .token2wav import FlowPrompt, Token2Wav

log = logging.getLogger(__name__)

MODES = ("zero_shot", "cross_lingual", "instruct2")
END_OF_PROMPT = "<|endofprompt|>"


@dataclass
class SynthesisRequest:
    text: str
    voice: PromptFeatures
    mode: str = "zero_shot"
    instruct_text: str = ""
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk_policy: ChunkPolicy = field(default_factory=ChunkPolicy)

    def validate(self) -> "SynthesisRequest":
        if self.mode not in MODES:
            raise InvalidInput("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "instruct2" and not self.instruct_text.strip():
            raise InvalidInput("instruct_text", "is required in instruct2 mode")
        if self.mode == "zero_shot" and not self.voice.text.strip():
            raise InvalidInput("reference_text", "is required in zero_shot mode (the transcript of the voice prompt)")
        self.sampling.validate()
        self.chunk_policy.validate()
        return self


@dataclass
class SentenceInput:
    """What the LLM sees for one sentence."""

    text_tokens: torch.Tensor  # (1, Nt) int32
    prompt_text_tokens: torch.Tensor  # (1, Np) int32
    prompt_speech_tokens: torch.Tensor  # (1, Ns) int32; empty outside zero-shot mode


class CosyVoice2:
    """All modules of one model folder, loaded once."""

    def __init__(self, model_dir: Path, frontend: TextFrontend, prompt_encoder: PromptEncoder, llm: SpeechLM,
                 token2wav: Token2Wav, device: torch.device):
        self.model_dir = model_dir
        self.frontend = frontend
        self.prompt_encoder = prompt_encoder
        self.llm = llm
        self.token2wav = token2wav
        self.device = device
        self.sample_rate = token2wav.hift.config.sampling_rate

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str = "cpu") -> "CosyVoice2":
        paths = ModelPaths(Path(model_dir))
        missing = paths.missing()
        if missing:
            raise ModelFolderError(f"{model_dir} is not a CosyVoice2 model folder: missing {', '.join(missing)}")
        dev = torch.device(device)
        frontend = TextFrontend.from_model_dir(paths.root)
        prompt_encoder = PromptEncoder.from_model_dir(paths.root)
        llm = SpeechLM.from_model_dir(paths.root, device=device)
        flow = FlowModel.from_model_dir(paths.root, device=device)
        hift = HiFTGenerator.from_model_dir(paths.root, device=device)
        return cls(paths.root, frontend, prompt_encoder, llm, Token2Wav(flow, hift), dev)

    # ---- request preparation -------------------------------------------------------------------

    def encode_voice(self, samples: np.ndarray, sample_rate: int, prompt_text: str) -> PromptFeatures:
        return self.prompt_encoder.encode(samples, sample_rate, prompt_text)

    def sentences(self, request: SynthesisRequest) -> list[SentenceInput]:
        """Normalize and split the text; lay out the LLM prompt of each sentence by mode."""
        pieces = self.frontend.split(request.text, field="text")
        prompt_text = ""
        prompt_speech = torch.zeros(1, 0, dtype=torch.int32)
        if request.mode == "zero_shot":
            prompt_text = self.frontend.normalize(request.voice.text)
            prompt_speech = torch.as_tensor(request.voice.speech_tokens, dtype=torch.int32)[None]
        elif request.mode == "instruct2":
            prompt_text = request.instruct_text.strip()
            if not prompt_text.endswith(END_OF_PROMPT):
                prompt_text += END_OF_PROMPT
        prompt_text_tokens = self._tokens(prompt_text)
        return [SentenceInput(self._tokens(p), prompt_text_tokens, prompt_speech) for p in pieces]

    def _tokens(self, text: str) -> torch.Tensor:
        return torch.tensor([self.frontend.tokenizer.encode(text)], dtype=torch.int32).reshape(1, -1)

    def flow_prompt(self, voice: PromptFeatures) -> FlowPrompt:
        return FlowPrompt(
            speech_tokens=torch.as_tensor(voice.speech_tokens, dtype=torch.int32, device=self.device)[None],
            mel=torch.as_tensor(voice.mel, dtype=torch.float32, device=self.device)[None],
            embedding=torch.as_tensor(voice.embedding, dtype=torch.float32, device=self.device).reshape(1, -1),
        )

    # ---- synthesis ------------------------------------------------------------------------------

    def synthesize(self, request: SynthesisRequest, stream: bool = False) -> Iterator[np.ndarray]:
        """Yield float32 audio chunks at `sample_rate`. Offline mode yields one chunk per sentence."""
        request.validate()
        seed = request.seed if request.seed is not None else int(torch.seed() % (2**63))
        llm_rng = torch.Generator().manual_seed(seed)
        noise_rng = torch.Generator().manual_seed(seed + 1)
        flow_prompt = self.flow_prompt(request.voice)
        for sentence in self.sentences(request):
            tokens = self.llm.generate(sentence.text_tokens, sentence.prompt_text_tokens,
                                       sentence.prompt_speech_tokens, request.sampling, llm_rng)
            yield from self.speak_tokens(tokens, flow_prompt, request.chunk_policy, GeneratorNoise(noise_rng), stream)

    def speak_tokens(self, tokens: Iterator[int], prompt: FlowPrompt, policy: ChunkPolicy, noise,
                     stream: bool) -> Iterator[np.ndarray]:
        """Token2wav over a token iterator: chunks as the schedule allows, then the rest."""
        t2w = self.token2wav.stream(prompt, policy, noise)
        try:
            for token in tokens:
                t2w.push([token])
                if stream and t2w.ready():
                    yield t2w.next_chunk()
            yield t2w.finish()
        finally:
            t2w.close()
