"""How long a prompt transcript may be: the check that registration and synthesis share.

One LLM stream holds `max_seq_len` positions (the llm model's KV cache): its prefill is
`2 + prompt text tokens + sentence text tokens + prompt speech tokens` (sos, task id), and the speech it
generates follows. A voice whose transcript and recording leave no room for a sentence fails every
synthesis ("the prompt takes N positions; the cache holds M"), so it is refused when it is made, naming
the transcript's field. The room kept for the sentence is one full merged sentence of text
(`TOKEN_MAX_N` tokens, where the text preprocessor stops merging) and the fewest speech tokens the LLM makes
for it (`min_token_text_ratio` per text token, the official 2).

The transcript is counted as synthesis counts it: in the family's form (CosyVoice3: behind its system prompt),
normalized by the text preprocessor, then tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.messages import SPEECH_TOKENS_PER_SECOND
from cosyvoice_triton.preprocess.text import TOKEN_MAX_N, TextPreprocessor

PREFILL_EXTRA = 2  # sos and the task id
MIN_TOKEN_TEXT_RATIO = 2  # SpeechLMConfig.min_token_text_ratio of CosyVoice2
SENTENCE_ROOM = TOKEN_MAX_N * (1 + MIN_TOKEN_TEXT_RATIO)  # one sentence's text tokens and its shortest speech
MAX_TRANSCRIPT_CHARS = 2000  # as request text; longer ones are refused before the (slow) normalization


def speech_tokens_of(samples: int, sample_rate: int) -> int:
    """The prompt speech tokens a recording of `samples` at `sample_rate` gives (25 a second)."""
    return int(samples / sample_rate * SPEECH_TOKENS_PER_SECOND)


@dataclass(frozen=True)
class PromptBudget:
    max_seq_len: int  # positions of one LLM stream (the llm model's max_seq_len)
    preprocessor: TextPreprocessor

    def transcript_limit(self, prompt_speech_tokens: int) -> int:
        """Most transcript tokens that leave a sentence's room next to `prompt_speech_tokens`."""
        return self.max_seq_len - PREFILL_EXTRA - SENTENCE_ROOM - prompt_speech_tokens

    def check(self, transcript: str, prompt_speech_tokens: int, field: str) -> None:
        """InvalidInput naming `field` unless a voice with this transcript leaves room for a sentence."""
        if not transcript:
            return
        if len(transcript) > MAX_TRANSCRIPT_CHARS:
            raise InvalidInput(field, f"is {len(transcript)} characters long; a transcript takes at most "
                                      f"{MAX_TRANSCRIPT_CHARS}")
        prompt_text = self.preprocessor.family.zero_shot_prompt(transcript)
        tokens = len(self.preprocessor.tokenizer.encode(self.preprocessor.normalize(prompt_text)))
        limit = self.transcript_limit(prompt_speech_tokens)
        if tokens > limit:
            raise InvalidInput(field, f"the transcript takes {tokens} tokens; with the recording's "
                                      f"{prompt_speech_tokens} speech tokens at most {max(limit, 0)} fit (an LLM "
                                      f"stream holds {self.max_seq_len} positions and a sentence needs "
                                      f"{SENTENCE_ROOM} of them)")
