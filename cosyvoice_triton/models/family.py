"""The module classes of each model family: the one place where the models layer tells the families apart.

`family_models(model_dir)` reads the folder's family (`family.family_of`: the yaml it holds) and returns its
`FamilyModels`, whose loaders build the speech LM (one class, the family's `LMLayout`), the flow and the
vocoder from the folder, and which name the flow's per-stream cache (models/flow_cache.py for the UNet,
models/dit_cache.py for the DiT: the same `cached_mel` arguments and results). `models_of_flow(flow)` finds
them from a loaded flow. Code above this layer loads through it and never asks which family it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from cosyvoice_triton.family import COSYVOICE2, COSYVOICE3, ModelFamily, family_of
from cosyvoice_triton.models import dit_cache, flow_cache
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.flow import FlowModel, TokenToMel
from cosyvoice_triton.models.flow_cache import FlowCacheSettings
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.speech_lm import SpeechLM

Vocoder = HiFTGenerator | CausalHiFTGenerator


@dataclass(frozen=True)
class FamilyModels:
    family: ModelFamily
    flow: type[TokenToMel]  # speech tokens -> mel
    vocoder: type[Vocoder]  # mel -> 24 kHz audio
    cached_mel: Callable  # the flow's streaming call over a per-stream cache (flow_cache.cached_mel's contract)
    supports_cache: Callable[[TokenToMel], bool]  # False for an estimator on a graph engine
    graphs: bool = False  # token2wav's ONNX graphs exist for it (engines/onnx_graphs.py: CosyVoice2's only)

    def cache_settings(self, flow: TokenToMel, settings: FlowCacheSettings) -> FlowCacheSettings | None:
        """The per-stream cache a token2wav stage of `flow` runs with: None when off or when the flow's
        estimator cannot be cached; `max_frames` None becomes the family's `flow_cache_frames`."""
        if not settings.enabled or not self.supports_cache(flow):
            return None
        if settings.max_frames is None:
            return replace(settings, max_frames=self.family.flow_cache_frames)
        return settings

    def load_llm(self, model_dir: str | Path, **options) -> SpeechLM:
        """`SpeechLM.from_model_dir` (device, max_batch, max_seq_len, precision)."""
        return SpeechLM.from_model_dir(model_dir, **options)

    def load_flow(self, model_dir: str | Path, device: str | torch.device = "cpu") -> TokenToMel:
        return self.flow.from_model_dir(model_dir, device=device)

    def load_vocoder(self, model_dir: str | Path, device: str | torch.device = "cpu") -> Vocoder:
        return self.vocoder.from_model_dir(model_dir, device=device)


MODELS = {
    COSYVOICE2: FamilyModels(COSYVOICE2, flow=FlowModel, vocoder=HiFTGenerator, cached_mel=flow_cache.cached_mel,
                             supports_cache=flow_cache.supports_cache, graphs=True),
    COSYVOICE3: FamilyModels(COSYVOICE3, flow=DiTFlowModel, vocoder=CausalHiFTGenerator,
                             cached_mel=dit_cache.cached_mel, supports_cache=dit_cache.supports_cache),
}


def family_models(model_dir: str | Path) -> FamilyModels:
    """The family's module classes for the folder `model_dir` (ModelFolderError: no family yaml, or both)."""
    return MODELS[family_of(model_dir)]


def models_of_flow(flow: TokenToMel) -> FamilyModels:
    """The family whose flow class `flow` is an instance of."""
    for models in MODELS.values():
        if isinstance(flow, models.flow):
            return models
    raise TypeError(f"{type(flow).__name__} is the flow of no model family")
