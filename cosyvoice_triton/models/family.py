"""The module classes of each model family: the one place where the models layer tells the families apart.

`family_models(model_dir)` reads the folder's family (`family.family_of`: the yaml it holds) and returns its
`FamilyModels`, whose loaders build the speech LM (one class, the family's `LMLayout`), the flow and the
vocoder from the folder. Code above this layer loads through it and never asks which family it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cosyvoice_triton.family import COSYVOICE2, COSYVOICE3, ModelFamily, family_of
from cosyvoice_triton.models.causal_hift import CausalHiFTGenerator
from cosyvoice_triton.models.dit_flow import DiTFlowModel
from cosyvoice_triton.models.flow import FlowModel, TokenToMel
from cosyvoice_triton.models.hift import HiFTGenerator
from cosyvoice_triton.models.speech_lm import SpeechLM

Vocoder = HiFTGenerator | CausalHiFTGenerator


@dataclass(frozen=True)
class FamilyModels:
    family: ModelFamily
    flow: type[TokenToMel]  # speech tokens -> mel
    vocoder: type[Vocoder]  # mel -> 24 kHz audio

    def load_llm(self, model_dir: str | Path, **options) -> SpeechLM:
        """`SpeechLM.from_model_dir` (device, max_batch, max_seq_len, precision)."""
        return SpeechLM.from_model_dir(model_dir, **options)

    def load_flow(self, model_dir: str | Path, device: str | torch.device = "cpu") -> TokenToMel:
        return self.flow.from_model_dir(model_dir, device=device)

    def load_vocoder(self, model_dir: str | Path, device: str | torch.device = "cpu") -> Vocoder:
        return self.vocoder.from_model_dir(model_dir, device=device)


MODELS = {
    COSYVOICE2: FamilyModels(COSYVOICE2, flow=FlowModel, vocoder=HiFTGenerator),
    COSYVOICE3: FamilyModels(COSYVOICE3, flow=DiTFlowModel, vocoder=CausalHiFTGenerator),
}


def family_models(model_dir: str | Path) -> FamilyModels:
    """The family's module classes for the folder `model_dir` (ModelFolderError: no family yaml, or both)."""
    return MODELS[family_of(model_dir)]
