"""Benchmark scenarios: lists of (prompt audio, prompt text, target text) cases.

- `fast_clone`: a short Chinese target (<= 10 characters) after a Chinese prompt of at most 5 s.
- `cross_lingual`: mixed Chinese-English targets after an English prompt (mode `cross_lingual`).
- `long_text`: a long Chinese paragraph after a Chinese prompt.

Prompt recordings are made here, with no downloads: `espeak-ng` (`-v cmn` / `-v en`) when it is on the
PATH (Debian: `apt-get install espeak-ng`), otherwise `speech_like()` (formant-filtered pulses; the
transcript then does not match the sound, which changes nothing for timing). `quick=True` shortens the
targets (for `bench --quick` and tests).
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_triton.client.common import read_wav
from cosyvoice_triton.random_folder.sample_prompt import speech_like

MAX_PROMPT_S = 5.0
QUICK_PROMPT_S = 2.0


@dataclass(frozen=True)
class Case:
    """One request shape: the voice prompt (samples at `prompt_rate`), its transcript, the text to speak."""

    prompt_audio: np.ndarray  # (N,) float32 in [-1, 1]
    prompt_rate: int
    prompt_text: str
    text: str
    mode: str = "zero_shot"  # zero_shot | cross_lingual
    prompt_source: str = "espeak-ng"  # espeak-ng | speech_like

    @property
    def prompt_seconds(self) -> float:
        return self.prompt_audio.size / self.prompt_rate


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    cases: tuple[Case, ...]


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def make_prompt(text: str, voice: str, *, seed: int = 0, max_seconds: float = MAX_PROMPT_S) -> tuple[np.ndarray, int, str]:
    """(samples, rate, source) of `text` spoken by espeak-ng voice `voice` ("cmn", "en"), cut to
    `max_seconds`; a speech-like stand-in of 3 s at 16 kHz when espeak-ng is missing or fails."""
    if espeak_available():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "prompt.wav"
            result = subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "-w", str(out), text],
                                    capture_output=True, timeout=60, check=False)
            if result.returncode == 0 and out.exists() and out.stat().st_size > 44:
                samples, rate = read_wav(out)
                samples = samples[: int(max_seconds * rate)]
                if samples.size > rate // 4:
                    return samples, rate, "espeak-ng"
    return speech_like(min(3.0, max_seconds), 16000, seed=seed), 16000, "speech_like"


ZH_PROMPT = "希望你以后能够做得比我还好哟。"
EN_PROMPT = "I hope you will do even better than me in the future."

FAST_TEXTS = ["你好，欢迎光临。", "今天天气很好。", "我们出发吧！", "谢谢你的帮助。"]
CROSS_TEXTS = ["我们明天去 Starbucks 喝 coffee 吧。", "这个 project 的 deadline 是下周五。",
               "Please 把 report 发给我，谢谢。"]
LONG_TEXTS = [
    ("在一个宁静的小镇上，住着一位年迈的钟表匠。他每天清晨都会打开店门，擦拭柜台上的每一只钟表，"
    "然后坐在窗边，听着滴答滴答的声音，慢慢地修理顾客送来的旧表。镇上的人都说，他修好的钟表从来不会出错，"
    "因为他总是把耐心和时间一起装进了齿轮里。孩子们放学后喜欢围在他的店门口，听他讲那些关于时间的故事。"),
]
QUICK_TEXTS = {"fast_clone": ["你好。", "谢谢。"], "cross_lingual": ["OK 好的。"], "long_text": ["很久以前，有一个小镇。"]}


def build(name: str, *, quick: bool = False) -> Scenario:
    """The scenario `name` (one of `NAMES`), with its prompts made now (cut to 2 s when `quick`)."""
    prompt = functools.partial(make_prompt, max_seconds=QUICK_PROMPT_S if quick else MAX_PROMPT_S)
    if name == "fast_clone":
        audio, rate, source = prompt(ZH_PROMPT, "cmn", seed=1)
        texts, prompt_text, mode = FAST_TEXTS, ZH_PROMPT, "zero_shot"
        description = "short Chinese target (<= 10 characters), Chinese prompt <= 5 s, zero-shot"
    elif name == "cross_lingual":
        audio, rate, source = prompt(EN_PROMPT, "en", seed=2)
        texts, prompt_text, mode = CROSS_TEXTS, EN_PROMPT, "cross_lingual"
        description = "mixed Chinese-English target, English prompt, cross-lingual mode"
    elif name == "long_text":
        audio, rate, source = prompt(ZH_PROMPT, "cmn", seed=3)
        texts, prompt_text, mode = LONG_TEXTS, ZH_PROMPT, "zero_shot"
        description = "a long Chinese paragraph, Chinese prompt, zero-shot"
    else:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(NAMES)}")
    if quick:
        texts = QUICK_TEXTS[name]
    cases = tuple(Case(audio, rate, prompt_text, text, mode, source) for text in texts)
    return Scenario(name, description + (" (quick texts)" if quick else ""), cases)


NAMES = ("fast_clone", "cross_lingual", "long_text")
