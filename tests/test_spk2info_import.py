"""`cosyvoice-triton voices import spk2info.pt`: speakers saved by the official `add_zero_shot_spk` +
`save_spkinfo` become voices. The file is written here in the official format (per speaker id the zero-shot
frontend's model input without `text`: batch dimension 1, int32 token ids and lengths, float features), imported
into the voice store of a real tritonserver + gateway (tiny random folder), listed through the gateway, and
spoken with: the gateway's audio equals the library's offline synthesis with the stored voice."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import numpy as np
import pytest
import torch

from web.stack import library_pipeline, serve_stack

PROMPT_TEXT = "A speaker saved by the official code."
SEED = 5
ATOL = 2e-4


def official_entry(prompt_text_tokens: list[int], rng: np.random.Generator, n_tokens: int = 40) -> dict:
    """One speaker as `CosyVoice2.add_zero_shot_spk` keeps it (frontend_zero_shot's dict minus text/text_len)."""
    text = torch.tensor([prompt_text_tokens], dtype=torch.int32)
    speech = torch.tensor(rng.integers(0, 6561, (1, n_tokens)), dtype=torch.int32)
    feat = torch.tensor(rng.normal(-4.0, 1.5, (1, 2 * n_tokens, 80)), dtype=torch.float32)
    embedding = torch.tensor(rng.normal(0, 1, (1, 192)), dtype=torch.float32)

    def length(x):
        return torch.tensor([x.shape[1]], dtype=torch.int32)

    return {"prompt_text": text, "prompt_text_len": length(text),
            "llm_prompt_speech_token": speech, "llm_prompt_speech_token_len": length(speech),
            "flow_prompt_speech_token": speech, "flow_prompt_speech_token_len": length(speech),
            "prompt_speech_feat": feat, "prompt_speech_feat_len": length(feat),
            "llm_embedding": embedding, "flow_embedding": embedding}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    with serve_stack(tmp_path_factory.mktemp("spk2info"), tiny_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from cosyvoice_triton.preprocess.text import TextPreprocessor

    return TextPreprocessor.from_model_dir(tiny_model_dir).tokenizer


@pytest.fixture(scope="module")
def spk2info(tmp_path_factory, tokenizer):
    """(path, the dict saved): two zero-shot speakers and an SFT speaker (embedding only), as torch.save writes."""
    rng = np.random.default_rng(0)
    table = {"saved_a": official_entry(tokenizer.encode(PROMPT_TEXT), rng),
             "中文女": official_entry(tokenizer.encode("Another one."), rng, n_tokens=30),
             "sft_speaker": {"embedding": torch.zeros(1, 192)}}
    path = tmp_path_factory.mktemp("spk") / "spk2info.pt"
    torch.save(table, path)
    return path, table


def run_import(spk2info_path, model_dir, voice_store, *extra) -> int:
    from cosyvoice_triton.cli import main

    return main(["voices", "import", str(spk2info_path), "--model-dir", str(model_dir), "--voice-store",
                 voice_store, *extra])


def test_import_round_trips_the_saved_features(stack, spk2info, tokenizer, capsys):
    from cosyvoice_triton.voices.stores import open_voice_store

    path, table = spk2info
    assert run_import(path, stack.model_dir, stack.voice_store) == 0
    captured = capsys.readouterr()
    assert "saved_a" in captured.out and "中文女" in captured.out
    assert "sft_speaker" in captured.err  # no prompt: skipped, and said so
    store = open_voice_store(stack.voice_store)
    try:
        for speaker_id in ("saved_a", "中文女"):
            entry, voice = table[speaker_id], store.get(speaker_id)
            np.testing.assert_array_equal(voice.speech_tokens, entry["llm_prompt_speech_token"][0].numpy())
            np.testing.assert_array_equal(voice.mel, entry["prompt_speech_feat"][0].numpy())
            np.testing.assert_array_equal(voice.embedding, entry["llm_embedding"][0].numpy())
            assert tokenizer.encode(voice.text) == entry["prompt_text"][0].tolist()
            assert store.info(speaker_id).owner is None  # shared by default
        assert voice.text == "Another one."
    finally:
        store.close()
    assert run_import(path, stack.model_dir, stack.voice_store) == 0  # again: the same voices, no error


def test_imported_voices_are_listed_and_spoken_through_the_gateway(stack, spk2info):
    from cosyvoice_triton.messages import SynthesisRequest

    assert run_import(spk2info[0], stack.model_dir, stack.voice_store) == 0
    with urllib.request.urlopen(stack.gateway_url + "/v1/voices", timeout=30) as response:
        listed = {v["id"] for v in json.loads(response.read())["voices"]}
    assert {"saved_a", "中文女"} <= listed and "sft_speaker" not in listed

    async def post() -> bytes:
        body = {"text": "Hello from a saved speaker.", "voice_id": "saved_a", "seed": SEED, "format": "pcm_f32"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(stack.gateway_url + "/v1/tts", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.read()

    got = np.frombuffer(asyncio.run(post()), "<f4")
    tts, voice = library_pipeline(stack, "saved_a")
    request = SynthesisRequest(text="Hello from a saved speaker.", voice=voice, seed=SEED,
                               sampling=tts.llm.config.sampling)
    want = np.concatenate([c for c in tts.synthesize(request, stream=False) if c.size])
    assert got.size == want.size > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_owner_key_imports_voices_of_that_key(tmp_path, spk2info, tiny_model_dir):
    from cosyvoice_triton.voices.store import owner_tag
    from cosyvoice_triton.voices.stores import open_voice_store

    store_path = str(tmp_path / "voices.sqlite")
    assert run_import(spk2info[0], tiny_model_dir, store_path, "--owner", "key-1") == 0
    store = open_voice_store(store_path)
    try:
        assert store.info("saved_a", owner_tag("key-1")).owner == owner_tag("key-1") != "key-1"
    finally:
        store.close()
