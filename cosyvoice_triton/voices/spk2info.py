"""Official saved speakers (`spk2info.pt`) -> voices of the voice store.

The official `CosyVoice2.add_zero_shot_spk(prompt_text, prompt_wav, spk_id)` keeps, per speaker id, the model
input of its zero-shot frontend, and `save_spkinfo()` writes the dict with `torch.save`. Per speaker (batch
dimension 1 on every tensor):
  prompt_text                 int32 (1, T)       the transcript's text token ids (not normalized)
  llm_prompt_speech_token     int32 (1, P)       prompt speech tokens (flow_prompt_speech_token: the same)
  prompt_speech_feat          float (1, 2P, 80)  prompt mel at 50 Hz, already cut to 2 frames per token
  llm_embedding               float (1, 192)     CAM++ embedding (flow_embedding: the same)
  ... and their *_len companions. A released model's own spk2info.pt (SFT speakers) holds only `embedding`:
  such entries carry no prompt and are skipped.
A voice stores the transcript as text, so the token ids are decoded with the model folder's tokenizer, special
tokens kept (`[breath]`; a CosyVoice3 transcript's system prompt and `<|endofprompt|>`, which synthesis then
takes as they are: `ModelFamily.zero_shot_prompt`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidInput
from ..messages import PromptFeatures
from .store import VoiceStore

ZERO_SHOT_KEYS = ("prompt_text", "llm_prompt_speech_token", "prompt_speech_feat", "llm_embedding")


@dataclass(frozen=True)
class SavedSpeaker:
    """One entry of spk2info.pt, as numpy."""

    speaker_id: str
    prompt_text_tokens: np.ndarray  # (T,) int32
    speech_tokens: np.ndarray  # (P,) int32
    mel: np.ndarray  # (2P, 80) float32
    embedding: np.ndarray  # (192,) float32


def _numpy(value, dtype) -> np.ndarray:
    return np.ascontiguousarray(value.detach().cpu().numpy(), dtype=dtype)


def read_spk2info(path: str | Path) -> tuple[list[SavedSpeaker], list[str]]:
    """(the zero-shot speakers of `path`, the ids skipped because they hold no prompt)."""
    import torch

    table = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(table, dict):
        raise InvalidInput("spk2info", f"{path} is not a spk2info dict (speaker id -> features)")
    speakers, skipped = [], []
    for speaker_id, entry in table.items():
        if not isinstance(entry, dict) or any(key not in entry for key in ZERO_SHOT_KEYS):
            skipped.append(str(speaker_id))
            continue
        speakers.append(SavedSpeaker(
            speaker_id=str(speaker_id),
            prompt_text_tokens=_numpy(entry["prompt_text"], np.int32).reshape(-1),
            speech_tokens=_numpy(entry["llm_prompt_speech_token"], np.int32).reshape(-1),
            mel=_numpy(entry["prompt_speech_feat"], np.float32).reshape(-1, 80),
            embedding=_numpy(entry["llm_embedding"], np.float32).reshape(-1)))
    return speakers, skipped


def speaker_sha256(speaker: SavedSpeaker) -> str:
    """A content hash standing in for the recording's (`audio_sha256`), which spk2info does not keep."""
    import hashlib

    digest = hashlib.sha256()
    for array in (speaker.speech_tokens, speaker.mel, speaker.embedding):
        digest.update(array.tobytes())
    return digest.hexdigest()


def prompt_features(speaker: SavedSpeaker, decode) -> PromptFeatures:
    """`decode(ids, skip_special_tokens) -> str`: the model folder's tokenizer (`TextTokenizer.decode`)."""
    if speaker.mel.shape[0] != 2 * speaker.speech_tokens.shape[0]:
        raise InvalidInput("prompt_speech_feat", f"speaker {speaker.speaker_id!r}: {speaker.mel.shape[0]} mel "
                                                 f"frames for {speaker.speech_tokens.shape[0]} speech tokens "
                                                 "(expected 2 per token)")
    return PromptFeatures(embedding=speaker.embedding, speech_tokens=speaker.speech_tokens, mel=speaker.mel,
                          text=decode([int(t) for t in speaker.prompt_text_tokens], skip_special_tokens=False),
                          audio_sha256=speaker_sha256(speaker))


def import_spk2info(path: str | Path, store: VoiceStore, decode, owner: str | None = None, *,
                    family: str) -> tuple[list, list[str]]:
    """Store every zero-shot speaker of `path` as a voice named by its speaker id (owner None: shared), its
    features as `family`'s (the model folder's that saved them; spk2info keeps no recording, so the voice
    serves that family only). Returns (the voices stored, as `store.register` returns them; the ids skipped)."""
    speakers, skipped = read_spk2info(path)
    stored = [store.register(prompt_features(speaker, decode), voice_id=speaker.speaker_id,
                             name=speaker.speaker_id, owner=owner, family=family) for speaker in speakers]
    return stored, skipped
