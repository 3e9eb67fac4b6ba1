"""In-process synthesis with a model folder of either family: text + voice -> 24 kHz audio, offline or streaming.

`CosyVoice.from_model_dir(folder)` loads whatever the folder holds (`cosyvoice2.yaml` or `cosyvoice3.yaml`:
family.py `family_of`), as the official `AutoModel`; `CosyVoice2` and `CosyVoice3` load only their own family's
folders (a folder of the other one is a ModelFolderError naming its yaml). The families differ only below the
seams (`family.ModelFamily`, models/family.py, token2wav/vocoders.py); the pipeline is one.

This is the reference pipeline. The Triton models run the same steps, split across processes:
1. text: normalize, split into sentences, tokenize;
2. voice: prompt features (speaker embedding, prompt speech tokens, prompt mel, prompt text);
3. LLM: speech tokens, one sentence at a time, prompt laid out by mode;
4. token2wav: flow + HiFT, chunk by chunk when streaming.
Steps 1, 3 and 4 are the `Pipeline`; here it runs with in-process stages. `engine`,
`precision` and `ort_providers` choose where token2wav's graphs and CAM++ run, as `serve` does
(engines/select.py); `device` is checked first (engines/providers.py). `llm_precision` (fp32 | bf16 |
int8, models/llm_precision.py) is the LLM backbone's, `flow_precision` (fp32 | bf16, models/flow.py) the flow
estimator's; `auto` picks each from the CPU's instructions (models/auto_precision.py). `compile` (off | auto |
on) runs the LLM's, the flow estimator's and HiFT's blocks through torch.compile (models/compiled.py).

With `decode_ahead` (the default) the LLM decodes in a thread of its own, ahead of the chunks, so the
next tokens come while token2wav turns a chunk into audio; the two share the torch threads this
pipeline was made with (`torch.get_num_threads()` then; pipeline/threads.py): side by side they split
them (on 2: one each), the LLM alone and a stream's last chunk get all, and a stream's first chunk gets
all while the LLM waits (first audio waits for that chunk). Without it, the LLM waits while token2wav
runs.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import ModelPaths
from ..engines.providers import check_torch_device
from ..engines.select import build_token2wav, open_campplus
from ..errors import ModelFolderError
from ..family import COSYVOICE2, COSYVOICE3, ModelFamily
from ..messages import PromptFeatures, SynthesisRequest
from ..wire.checks import validate_text
from ..wire.names import TARGET_TEXT
from ..preprocess.prompt import PromptEncoder
from ..preprocess.text import TextPreprocessor
from ..models.compiled import apply_compile
from ..models.family import family_models
from ..models.flow_cache import FlowCacheSettings
from ..models.speech_lm import SpeechLM
from .local_stages import CoreSharingToken2Wav, DecodeAheadLLM, ReferenceLLM, ReferenceToken2Wav
from .pipeline import Pipeline
from .threads import CoreShare, RowWorkers, thread_plan
from ..token2wav.stream import Token2Wav

log = logging.getLogger(__name__)


class CosyVoice:
    """All modules of one model folder, loaded once. Not thread-safe: one request at a time (its LLM's
    decode-ahead thread is part of that request)."""

    accepts: ModelFamily | None = None  # set by a subclass: `from_model_dir` takes only that family's folders

    def __init__(self, model_dir: Path, preprocessor: TextPreprocessor, prompt_encoder: PromptEncoder, llm: SpeechLM,
                 token2wav: Token2Wav, decode_ahead: bool = True):
        import torch

        self.model_dir = model_dir
        self.family = preprocessor.family  # the folder's
        self.preprocessor = preprocessor
        self.prompt_encoder = prompt_encoder
        self.llm = llm
        self.token2wav = token2wav
        self.sample_rate = token2wav.hift.config.sampling_rate
        self.cores = CoreShare(thread_plan(torch.get_num_threads()))
        if token2wav.flow_cache is not None and token2wav.device.type == "cpu":
            # The flow's rows over the cores the LLM leaves at each Euler step (pipeline/threads.py).
            token2wav.map_rows = RowWorkers(self.cores).map
        self.pipeline = Pipeline(preprocessor, ReferenceLLM(llm), ReferenceToken2Wav(token2wav))
        self.use_decode_ahead(decode_ahead)

    def use_decode_ahead(self, on: bool) -> None:
        """Overlap the LLM and token2wav (True), or let the LLM wait while token2wav runs (False)."""
        self.decode_ahead = on
        llm, token2wav = ReferenceLLM(self.llm), ReferenceToken2Wav(self.token2wav)
        if on:
            llm, token2wav = DecodeAheadLLM(llm, self.cores), CoreSharingToken2Wav(token2wav, self.cores)
        self.pipeline.llm, self.pipeline.token2wav = llm, token2wav

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str = "cpu", *, engine: str = "torch",
                       precision: str = "fp32", ort_providers: str | None = None,
                       onnx_dir: str | Path | None = None, llm_precision: str = "fp32", flow_precision: str = "fp32",
                       decode_ahead: bool = True, flow_cache: FlowCacheSettings = FlowCacheSettings(),
                       compile: str = "off") -> "CosyVoice":
        """Load `model_dir`; its yaml decides the family. `flow_cache.max_frames` None: the family's default
        (CosyVoice2 1000 frames, CosyVoice3 300: `ModelFamily.flow_cache_frames`). CosyVoice3's token2wav runs
        on torch whatever `engine` asks (engines/select.py)."""
        paths = ModelPaths(Path(model_dir))
        missing = paths.missing()
        if missing:
            raise ModelFolderError(f"{model_dir} is not a CosyVoice model folder: missing {', '.join(missing)}")
        for line in paths.unused():
            log.warning("%s: %s", model_dir, line)
        if cls.accepts is not None and paths.family is not cls.accepts:
            raise ModelFolderError(f"{model_dir} holds a {paths.family} model ({paths.family.yaml_file}), not "
                                   f"{cls.accepts}: load it with CosyVoice.from_model_dir (the folder decides)")
        check_torch_device(device)
        preprocessor = TextPreprocessor.from_model_dir(paths.root)
        prompt_encoder = PromptEncoder.from_model_dir(paths.root)
        if engine != "torch":  # CAM++ on the same engine, on the CPU as the official CosyVoice (or TensorRT's GPU)
            prompt_encoder.campplus = open_campplus(paths.root, engine, device if engine == "tensorrt" else "cpu",
                                                    precision=precision, ort_providers=ort_providers)
        llm = family_models(paths.root).load_llm(paths.root, device=device, max_seq_len=4096, precision=llm_precision)
        flow, hift = build_token2wav(paths.root, engine, device, precision=precision, onnx_dir=onnx_dir,
                                     ort_providers=ort_providers, flow_precision=flow_precision)
        apply_compile(compile, device, llm=llm, flow=flow, hift=hift)  # off | auto | on: models/compiled.py
        return cls(paths.root, preprocessor, prompt_encoder, llm, Token2Wav(flow, hift, flow_cache),
                   decode_ahead=decode_ahead)

    def encode_voice(self, samples: np.ndarray, sample_rate: int, prompt_text: str) -> PromptFeatures:
        return self.prompt_encoder.encode(samples, sample_rate, prompt_text)

    def synthesize(self, request: SynthesisRequest, stream: bool = False,
                   is_cancelled: Callable[[], bool] = lambda: False) -> Iterator[np.ndarray]:
        """Yield float32 audio chunks at `sample_rate`. Offline mode yields one chunk per sentence. The request is
        checked here, where it enters the library (InvalidInput naming the field)."""
        validate_text(request.validate().text, TARGET_TEXT, self.preprocessor.max_chars)
        return self.pipeline.run(request, stream=stream, is_cancelled=is_cancelled)


class CosyVoice2(CosyVoice):
    """`CosyVoice` for CosyVoice2 folders only."""

    accepts = COSYVOICE2


class CosyVoice3(CosyVoice):
    """`CosyVoice` for CosyVoice3 folders only."""

    accepts = COSYVOICE3

