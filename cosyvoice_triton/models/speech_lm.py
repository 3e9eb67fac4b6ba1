"""The speech-token language model of both families: a Qwen2 backbone that reads text and writes speech tokens.

The module tree mirrors the official `Qwen2LM` (CosyVoice2) and `CosyVoice3LM` so that `llm.pt` loads with
`strict=True`: `llm.model.model.*` (backbone), `llm.model.lm_head` (unused, tied), `llm_decoder` (hidden ->
speech logits) and `speech_embedding` (speech token -> input). The family's `LMLayout` (family.py) says the
rest: CosyVoice2 has `llm_embedding` (sos, task id), a decoder bias and codebook + 3 speech ids; CosyVoice3
keeps sos and task id as rows of `speech_embedding`, has no decoder bias and codebook + 200 speech ids, any
of the 200 extra ids ending decoding.

The model builds the prompt and gives logits; it does not sample. Decoding loops live in `llm/`:
`llm.generate.generate` (one stream, the reference) and `llm.scheduler` (in-flight batching).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from cosyvoice_triton.config import ModelPaths, read_qwen_config, read_yaml
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.family import COSYVOICE2, LMLayout, check_yaml_class
from cosyvoice_triton.messages import SamplingParams
from cosyvoice_triton.models.auto_precision import resolve_llm_precision
from cosyvoice_triton.models.checkpoint import load_state
from cosyvoice_triton.models.llm_precision import (activation_dtype, check_llm_precision, multiply_rows_apart,
                                                   quantize_linears, quantize_linears_dynamic, row_by_row)
from cosyvoice_triton.models.qwen2 import Qwen2Config, Qwen2Decoder, Qwen2ForCausalLM, rope_tables


@dataclass
class SpeechLMConfig:
    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    qwen: Qwen2Config
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    layout: LMLayout = COSYVOICE2.lm

    def __post_init__(self) -> None:
        if not self.llm_input_size == self.llm_output_size == self.qwen.hidden_size:
            raise ValueError(f"llm_input_size {self.llm_input_size}, llm_output_size {self.llm_output_size} "
                             f"and the backbone hidden_size {self.qwen.hidden_size} must be equal")

    @property
    def eos_token(self) -> int:
        return self.speech_token_size + self.layout.eos

    @property
    def min_len_masked_token(self) -> int:
        """The id whose log-prob is -inf while fewer than min_len tokens are decoded (`LMLayout.min_len_masked`:
        EOS in CosyVoice2, SOS in CosyVoice3, as the official torch path)."""
        return self.speech_token_size + self.layout.min_len_masked

    @property
    def fill_token(self) -> int:
        """The bistream fill token (`LMLayout.fill`): it closes each group of speech tokens."""
        return self.speech_token_size + self.layout.fill

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return tuple(self.speech_token_size + i for i in range(self.layout.stop_ids))

    @property
    def num_speech_classes(self) -> int:
        return self.speech_token_size + self.layout.head_ids

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> SpeechLMConfig:
        """Read the folder's yaml (key `llm`; its family gives the layout) and `CosyVoice-BlankEN/config.json`."""
        paths = ModelPaths(Path(model_dir))
        family = paths.family
        llm = read_yaml(paths.yaml)["llm"]
        check_yaml_class(llm, family.llm_class, "llm", paths.yaml)
        return cls(llm_input_size=llm["llm_input_size"], llm_output_size=llm["llm_output_size"],
                   speech_token_size=llm["speech_token_size"],
                   qwen=Qwen2Config.from_json(read_qwen_config(model_dir)),
                   sampling=SamplingParams.from_llm_yaml(llm), layout=family.lm)


class _Qwen2Encoder(nn.Module):
    """One more level of nesting, as in the official code, so keys read `llm.model.model.*`."""

    def __init__(self, config: Qwen2Config, max_seq_len: int):
        super().__init__()
        self.model = Qwen2ForCausalLM(config, max_seq_len)


class SpeechLM(nn.Module):
    def __init__(self, config: SpeechLMConfig, max_seq_len: int):
        super().__init__()
        self.config = config
        layout = config.layout
        # CosyVoice2's sos and task id rows; CosyVoice3 keeps them in speech_embedding (`LMLayout`).
        self.llm_embedding = nn.Embedding(2, config.llm_input_size) if layout.own_special_table else None
        self.llm = _Qwen2Encoder(config.qwen, max_seq_len)
        self.llm_decoder = nn.Linear(config.llm_output_size, config.num_speech_classes, bias=layout.decoder_bias)
        self.speech_embedding = nn.Embedding(config.num_speech_classes, config.llm_input_size)
        self.precision = "fp32"

    @property
    def backbone(self) -> Qwen2Decoder:
        return self.llm.model.model

    @property
    def max_seq_len(self) -> int:
        return self.backbone.max_seq_len

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: torch.device | str = "cpu", max_batch: int = 1,
                       max_seq_len: int = 2048, precision: str = "fp32") -> SpeechLM:
        """Load `llm.pt` strictly, set the backbone's `precision` (fp32 | bf16 | int8 | int8-dynamic, or auto:
        models/auto_precision.py) and allocate a KV cache of `max_batch` slots x `max_seq_len` positions."""
        paths = ModelPaths(Path(model_dir))
        model = cls(SpeechLMConfig.from_model_dir(model_dir), max_seq_len)
        load_state(model, paths.llm)
        model.to(device).eval()
        model.set_precision(resolve_llm_precision(precision, device))
        if torch.device(device).type == "cpu":
            model.multiply_rows_apart()
        model.setup_caches(max_batch)
        return model

    def set_precision(self, precision: str) -> None:
        """Run the backbone in `precision` (fp32 | bf16 | int8 | int8-dynamic: models/llm_precision.py), once,
        from fp32. The speech head and the rotary tables stay float32; call setup_caches() afterwards (the KV cache
        takes the embeddings' dtype)."""
        check_llm_precision(precision)
        if self.precision != "fp32":
            raise RuntimeError(f"the LLM is already in {self.precision}")
        self.precision = precision
        if precision == "fp32":
            return
        backbone = self.backbone
        device = self.llm_decoder.weight.device
        if precision == "int8-dynamic":  # float32 around int8 products: nothing else changes dtype
            if device.type != "cpu":
                raise ValueError(f"llm precision int8-dynamic runs on the CPU only, not on {device}")
            quantize_linears_dynamic(backbone.layers)
            return
        dtype = activation_dtype(precision, device)
        if precision == "int8":
            quantize_linears(backbone.layers, dtype)
        for module in (self.llm_embedding, self.speech_embedding, backbone):
            if module is not None:
                module.to(dtype)
        cos, sin = rope_tables(self.config.qwen, backbone.max_seq_len)
        backbone.rope_cos, backbone.rope_sin = cos.to(backbone.rope_cos.device), sin.to(backbone.rope_sin.device)

    def multiply_rows_apart(self) -> None:
        """Decode steps row by row where the kernels' sums depend on the batch: the backbone's float Linears and
        the speech head multiply one row at a time (`llm_precision.RowByRowLinear`), the attention runs each row
        over its own prefix (`qwen2.row_attention`). A stream's logits are then the same bits whatever else
        decodes beside it (models/llm_precision.py, "Batch-invariant decode"). For the CPU: the per-row host
        reads would break a CUDA graph."""
        multiply_rows_apart(self.backbone.layers)
        self.llm_decoder = row_by_row(self.llm_decoder)
        for layer in self.backbone.layers:
            layer.self_attn.rows_apart = True

    def setup_caches(self, max_batch: int) -> None:
        self.backbone.setup_caches(max_batch)

    def length_limits(self, text_len: int) -> tuple[int, int]:
        """(min_len, max_len) of the decoded speech tokens for `text_len` text tokens, prompt text excluded."""
        return (int(text_len * self.config.min_token_text_ratio),
                int(text_len * self.config.max_token_text_ratio))

    @torch.inference_mode()
    def build_prompt(self, text_token: Tensor, prompt_text_token: Tensor, prompt_speech_token: Tensor) -> Tensor:
        """The prefill input (1, L, D): [sos, embed(prompt_text ++ text), task_id, speech_embed(prompt_speech)].

        Token tensors are (1, N) integer ids on the model's device; any of the prompts may be (1, 0).
        What the official frontends pass, per mode:
        - zero_shot: prompt_text_token = tokens of the reference transcript, prompt_speech_token = the
          reference audio's speech tokens.
        - cross_lingual: both prompts empty (the reference voice reaches only the flow model).
        - instruct2: prompt_text_token = tokens of the instruction ending in '<|endofprompt|>',
          prompt_speech_token empty.
        """
        for name, tokens in (("text_token", text_token), ("prompt_text_token", prompt_text_token),
                             ("prompt_speech_token", prompt_speech_token)):
            if tokens.dim() != 2 or tokens.shape[0] != 1:
                raise InvalidInput(name, f"expected shape (1, N), got {tuple(tokens.shape)}")
        if text_token.shape[1] == 0:
            raise InvalidInput("text_token", "is empty")
        self._check_range("text_token", text_token, self.config.qwen.vocab_size)
        self._check_range("prompt_text_token", prompt_text_token, self.config.qwen.vocab_size)
        self._check_range("prompt_speech_token", prompt_speech_token, self.config.speech_token_size)
        all_text = torch.cat([prompt_text_token, text_token], dim=1).long()  # (1, Nt)
        self.check_required_text(all_text[0].tolist(), "prompt_text_token")
        layout = self.config.layout
        sos, task_id = self.special_embedding(layout.sos), self.special_embedding(layout.task_id)  # (1, 1, D) each
        text = self.backbone.embed_tokens(all_text)  # (1, Nt, D)
        speech = self.speech_embedding(prompt_speech_token.long())  # (1, Ns, D)
        return torch.cat([sos, text, task_id, speech], dim=1)

    def check_required_text(self, text_ids: list[int], field: str) -> None:
        """InvalidInput naming `field` unless `text_ids` hold the layout's `required_text_id` (CosyVoice3's
        `<|endofprompt|>`, which the official LM asserts in prompt_text ++ text)."""
        required = self.config.layout.required_text_id
        if required is not None and required not in text_ids:
            raise InvalidInput(field, f"this model needs text id {required} (<|endofprompt|>) in the prompt text "
                                      "or the text, e.g. after a system prompt")

    def special_embedding(self, row: int) -> Tensor:
        """The input embedding (1, 1, D) of a marker (`LMLayout.sos`, `.task_id`), from the table the layout names."""
        if self.config.layout.own_special_table:
            return self.llm_embedding.weight[row].reshape(1, 1, -1)
        return self.speech_embedding.weight[self.config.speech_token_size + row].reshape(1, 1, -1)

    @staticmethod
    def _check_range(name: str, tokens: Tensor, limit: int) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= limit):
            raise InvalidInput(name, f"ids must lie in [0, {limit})")

    @torch.inference_mode()
    def embed_speech(self, tokens: Tensor) -> Tensor:
        """Decoder input for speech tokens (B, T) -> (B, T, D)."""
        return self.speech_embedding(tokens)

    @torch.inference_mode()
    def step_logits(self, x: Tensor, input_pos: Tensor, slots: Tensor, kv_len: int | None = None) -> Tensor:
        """Cached forward (prefill or decode) -> float32 speech logits (B, V) of each row's last column.

        x (B, T, D), input_pos (B, T) int64, slots (B,) int64; attention over the first `kv_len` cache
        positions (`qwen2.kv_bucket`; default all). No host synchronisation."""
        hidden = self.backbone(x, input_pos, slots, kv_len)  # (B, T, D)
        return self.llm_decoder(hidden[:, -1].float())

    @torch.inference_mode()
    def logits_full(self, x: Tensor) -> Tensor:
        """Cache-free causal scoring: x (B, T, D) -> speech logits (B, T, V) at every position."""
        return self.llm_decoder(self.backbone.forward_full(x).float())

