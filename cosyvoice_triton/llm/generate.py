"""Single-stream decoding of the speech LM: the reference that `LLMScheduler` batches.

The model (`models.speech_lm.SpeechLM`) builds the prompt and gives logits; the sampling is here, in
`llm/`, as in the official code: repetition-aware sampling with a generator of the request's own.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import InvalidInput
from ..messages import SamplingParams
from ..models.qwen2 import kv_bucket
from ..models.speech_lm import SpeechLM
from .sampling import RasSampler, Sampler, make_generator


@torch.inference_mode()
def generate(llm: SpeechLM, text_token: Tensor, prompt_text_token: Tensor, prompt_speech_token: Tensor,
             sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
             sampler: Sampler | None = None, slot: int = 0) -> Iterator[int]:
    """Stream speech tokens for one request in cache slot `slot` of `llm`.

    Token tensors are (1, N) ids as `SpeechLM.build_prompt` takes them. Decoding stops before a stop
    token (which is not yielded), after max_len tokens, or when the cache is full. While fewer than
    min_len tokens have been decoded, `config.min_len_masked_token` gets log-prob -inf before sampling (the
    other stop tokens stay allowed, as in the official torch code: EOS in CosyVoice2, SOS in CosyVoice3). `sampler` defaults to RAS with `sampling` (the yaml's values
    when None); `generator` defaults to one seeded with `sampling.seed` (on the CPU: see `sampling`).
    Each step attends over the used cache prefix, rounded up to a `kv_bucket`.
    """
    config = llm.config
    sampling = (config.sampling if sampling is None else sampling).validate()
    sampler = sampler or RasSampler(sampling)
    if not 0 <= slot < llm.backbone.max_batch:
        raise InvalidInput("slot", f"must lie in [0, {llm.backbone.max_batch})")
    lm_input = llm.build_prompt(text_token, prompt_text_token, prompt_speech_token)  # (1, L, D)
    device = lm_input.device
    if generator is None:
        generator = make_generator(sampling.seed)
    prompt_len = lm_input.shape[1]
    if prompt_len >= llm.max_seq_len:
        raise InvalidInput("text_token", f"prompt of {prompt_len} positions does not fit the cache "
                                         f"({llm.max_seq_len} positions)")
    min_len, max_len = llm.length_limits(text_token.shape[1])
    max_len = min(max_len, llm.max_seq_len - prompt_len)
    slots = torch.tensor([slot], device=device)
    input_pos = torch.arange(prompt_len, device=device)[None]  # (1, L)
    x = lm_input
    decoded: list[int] = []
    while len(decoded) < max_len:
        kv_len = kv_bucket(prompt_len + len(decoded), llm.max_seq_len)  # positions in use after this step
        logp = llm.step_logits(x, input_pos, slots, kv_len)[0].log_softmax(dim=-1)  # (V,)
        if len(decoded) < min_len:
            logp[config.min_len_masked_token] = -float("inf")
        token = sampler(logp, decoded, generator)
        if token in config.stop_tokens:
            return
        yield token
        decoded.append(token)
        x = llm.embed_speech(torch.tensor([[token]], device=device))  # (1, 1, D)
        input_pos = input_pos[:, -1:] + 1  # (1, 1)
