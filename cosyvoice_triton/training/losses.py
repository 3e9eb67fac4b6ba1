"""The two training losses of both families, written from the algorithm of the official recipes.

LLM: next-speech-token cross-entropy (the sum over target positions divided by their count, optionally
label-smoothed as a KL divergence) over one of two sequence layouts per row, as the official LMs train:
- unistream (what one-shot inference reads): [sos, instruct, text, task_id, speech] with targets
  [ignore x (1 + instruct + text), speech, eos];
- bistream (what streamed text input reads), for a row drawn for it (half of them) whose speech is more than
  3x its text: after [sos, instruct], groups of 5 text tokens and the next 15 speech tokens, each group's
  targets [ignore x 4, its 15 speech tokens, fill]; then the text left, task_id and the speech left, as in
  unistream.
The family's `LMLayout` places sos, task_id, eos and fill (CosyVoice2: sos and task_id in a table of their
own; CosyVoice3: rows of the speech embedding and head). The instruct is CosyVoice3's: its recipe gives every
recording the system prompt ending in `<|endofprompt|>` (`data_prep.instruct_tokens`); CosyVoice2 has none.

Flow: conditional flow matching. For target mel x1, noise z and t ~ U(0, 1):
  y = (1 - (1 - sigma_min) t) z + t x1,  u = x1 - (1 - sigma_min) z,
the estimator predicts u from y, conditioned on the flow's `mu` (the family's `encode`: CosyVoice2's
conformer encoder, CosyVoice3's pre-lookahead layer), the speaker vector and a random
prefix of the target mel (the prompt condition); with probability `training_cfg_rate` a row loses all
three conditions (classifier-free guidance dropout). Loss: masked squared error / (frames x mel bins).
The random draws (the LLM's bistream rows; the flow's t, z, the dropout mask, prompt prefix lengths and
streaming) are explicit inputs, drawn by the `draw_*` functions from one torch generator, the flow's in the
official order: t, then z, then the mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_triton.llm.bistream import MIX_SPEECH, MIX_TEXT
from cosyvoice_triton.models.flow import TokenToMel
from cosyvoice_triton.models.speech_lm import SpeechLM

IGNORE_INDEX = -1
PROMPT_CONDITION_PROBABILITY = 0.5  # share of rows that get a prompt prefix as condition
PROMPT_CONDITION_MAX_SHARE = 0.3  # the prefix covers at most this share of the row's frames


@dataclass
class LMBatch:
    text_token: Tensor  # (B, Nt) int64, right-padded
    text_token_len: Tensor  # (B,) int64
    speech_token: Tensor  # (B, Ns) int64, right-padded
    speech_token_len: Tensor  # (B,) int64
    instruct_token: Tensor | None = None  # (B, Ni) int64, right-padded: read before the text; None: none
    instruct_token_len: Tensor | None = None  # (B,) int64

    def to(self, device: torch.device | str) -> LMBatch:
        return LMBatch(*(None if t is None else t.to(device) for t in (
            self.text_token, self.text_token_len, self.speech_token, self.speech_token_len, self.instruct_token,
            self.instruct_token_len)))


@dataclass
class FlowBatch:
    speech_token: Tensor  # (B, T) int64, right-padded
    speech_token_len: Tensor  # (B,) int64
    speech_feat: Tensor  # (B, token_mel_ratio * T, 80) float32 target mel, right-padded
    embedding: Tensor  # (B, 192) float32 speaker embedding

    def to(self, device: torch.device | str) -> FlowBatch:
        return FlowBatch(*(t.to(device) for t in (self.speech_token, self.speech_token_len, self.speech_feat,
                                                  self.embedding)))


@dataclass
class FlowNoise:
    t: Tensor  # (B,) time in [0, 1)
    z: Tensor  # (B, 80, T_mel) standard normal noise
    keep_condition: Tensor  # (B,) bool; False drops mu, speaker and prompt condition (CFG dropout)


@dataclass
class LossOutput:
    loss: Tensor  # () scalar
    accuracy: Tensor | None = None  # () share of targets predicted by argmax (LLM only)


def lm_input_and_target(model: SpeechLM, batch: LMBatch, bistream: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """(x (B, L, D), target (B, L) int64 with IGNORE_INDEX on non-targets and padding, lengths (B,)).

    Row b is laid out bistream where bistream[b] (None: no row) and its speech is more than 3x its text,
    else unistream (module docstring); L_b = 1 + Ni_b + Nt_b + 1 + Ns_b either way (fill tokens are targets,
    never inputs). The target at position i is the token that follows it.
    """
    layout, device = model.config.layout, batch.speech_token.device
    sos = model.special_embedding(layout.sos)[0]  # (1, D)
    task_id = model.special_embedding(layout.task_id)[0]  # (1, D)
    text_emb = model.backbone.embed_tokens(batch.text_token.clamp(min=0))  # (B, Nt, D)
    speech_emb = model.speech_embedding(batch.speech_token.clamp(min=0))  # (B, Ns, D)
    instruct_emb = None if batch.instruct_token is None else model.backbone.embed_tokens(batch.instruct_token.clamp(min=0))
    eos = torch.tensor([model.config.eos_token], device=device)
    fill = torch.tensor([model.config.fill_token], device=device)

    def ignored(n: int) -> Tensor:
        return torch.full((n,), IGNORE_INDEX, device=device, dtype=torch.long)

    inputs, targets = [], []
    for b in range(batch.text_token.size(0)):
        n_text, n_speech = int(batch.text_token_len[b]), int(batch.speech_token_len[b])
        n_instruct = 0 if instruct_emb is None else int(batch.instruct_token_len[b])
        text, speech = text_emb[b, :n_text], speech_emb[b, :n_speech]  # (Nt, D), (Ns, D)
        speech_ids = batch.speech_token[b, :n_speech].long()
        row_x = [sos] + ([] if instruct_emb is None else [instruct_emb[b, :n_instruct]])
        row_target = [ignored(1 + n_instruct)]
        mixes = bistream is not None and bool(bistream[b]) and n_speech * MIX_TEXT > n_text * MIX_SPEECH
        groups = n_text // MIX_TEXT if mixes else 0  # whole groups of text; the rest is laid out unistream
        for g in range(groups):
            t, s = g * MIX_TEXT, g * MIX_SPEECH
            row_x += [text[t:t + MIX_TEXT], speech[s:s + MIX_SPEECH]]
            row_target += [ignored(MIX_TEXT - 1), speech_ids[s:s + MIX_SPEECH], fill]
        t, s = groups * MIX_TEXT, groups * MIX_SPEECH
        row_x += [text[t:], task_id, speech[s:]]
        row_target += [ignored(n_text - t), speech_ids[s:], eos]
        inputs.append(torch.cat(row_x))
        targets.append(torch.cat(row_target))
    lengths = torch.tensor([row.size(0) for row in inputs], device=device)
    x = torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True)  # (B, L, D), zeros after L_b
    target = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=IGNORE_INDEX)
    return x, target, lengths


def smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0) -> Tensor:
    """KL(smoothed one-hot || softmax(logits)) summed over targets / number of targets.

    logits (B, L, V), target (B, L) with IGNORE_INDEX where no target. The smoothed distribution puts
    1 - smoothing on the target and smoothing / (V - 1) on every other class."""
    V = logits.size(-1)
    logits, target = logits.reshape(-1, V), target.reshape(-1)
    valid = target != IGNORE_INDEX
    logp = logits.float().log_softmax(dim=-1)  # (N, V)
    true_dist = torch.full_like(logp, smoothing / (V - 1))
    true_dist.scatter_(1, target.clamp(min=0)[:, None], 1.0 - smoothing)
    kl = F.kl_div(logp, true_dist, reduction="none").sum(dim=1)  # (N,)
    return kl.masked_fill(~valid, 0.0).sum() / valid.sum()


def lm_loss(model: SpeechLM, batch: LMBatch, label_smoothing: float = 0.0,
            bistream: Tensor | None = None) -> LossOutput:
    """Next-speech-token loss and accuracy of one batch, `bistream` (B,) bool the rows drawn for the bistream
    layout (`draw_bistream`; None: all unistream). Causal attention: padding on the right is never attended
    by a real position, so no padding mask is needed."""
    x, target, _ = lm_input_and_target(model, batch, bistream)  # (B, L, D), (B, L)
    logits = model.llm_decoder(model.backbone.forward_full(x))  # (B, L, V)
    loss = smoothed_cross_entropy(logits, target, label_smoothing)
    valid = target != IGNORE_INDEX
    accuracy = (logits.argmax(dim=-1) == target).logical_and(valid).sum() / valid.sum()
    return LossOutput(loss=loss, accuracy=accuracy.detach())


def draw_bistream(batch_size: int, generator: torch.Generator | None = None) -> Tensor:
    """(B,) bool: the rows drawn for the bistream layout, each with probability 1/2 (the layout also needs
    the row's speech to be more than 3x its text)."""
    return torch.rand(batch_size, generator=generator) < 0.5


def draw_flow_noise(batch_size: int, mel_bins: int, frames: int, training_cfg_rate: float,
                    generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> FlowNoise:
    """t, z and the guidance-dropout mask, drawn in that order (the order of the official training)."""
    t = torch.rand(batch_size, 1, 1, generator=generator, device=device)[:, 0, 0]  # (B,)
    z = torch.randn(batch_size, mel_bins, frames, generator=generator, device=device)  # (B, 80, T)
    if training_cfg_rate > 0:
        keep = torch.rand(batch_size, generator=generator, device=device) > training_cfg_rate
    else:
        keep = torch.ones(batch_size, dtype=torch.bool, device=device)
    return FlowNoise(t=t, z=z, keep_condition=keep)


def draw_prompt_frames(feat_len: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B,) prompt-condition frames per row: 0 for about half the rows, else uniform in [0, 0.3 * len]."""
    lengths = feat_len.cpu()
    use = torch.rand(lengths.size(0), generator=generator) >= PROMPT_CONDITION_PROBABILITY
    limit = (lengths.double() * PROMPT_CONDITION_MAX_SHARE).long()  # int(0.3 * len)
    frames = (torch.rand(lengths.size(0), generator=generator) * (limit + 1)).long().clamp(max=limit)
    return torch.where(use, frames, torch.zeros_like(frames))


def draw_streaming(generator: torch.Generator | None = None) -> bool:
    """Whether this batch trains the chunk-causal (streaming) masks: half of the batches."""
    return bool(torch.rand((), generator=generator) < 0.5)


def prompt_condition(speech_feat: Tensor, prompt_frames: Tensor) -> Tensor:
    """(B, 80, T_mel): the first prompt_frames[b] frames of row b's target mel, zeros after them."""
    frame = torch.arange(speech_feat.size(1), device=speech_feat.device)  # (T_mel,)
    keep = frame[None, :] < prompt_frames.to(speech_feat.device)[:, None]  # (B, T_mel)
    return (speech_feat * keep[..., None]).transpose(1, 2)  # (B, T_mel, 80) -> (B, 80, T_mel)


def flow_loss(model: TokenToMel, batch: FlowBatch, noise: FlowNoise, prompt_frames: Tensor, streaming: bool,
              sigma_min: float, training_cfg_rate: float) -> LossOutput:
    """Conditional flow-matching loss of one batch with the given random draws."""
    config = model.config
    B, T = batch.speech_token.shape
    T_mel = config.token_mel_ratio * T
    assert batch.speech_feat.shape == (B, T_mel, config.mel_bins), (
        f"speech_feat {tuple(batch.speech_feat.shape)}, expected {(B, T_mel, config.mel_bins)}")
    device = batch.speech_token.device
    stream = torch.full((B,), streaming, dtype=torch.bool, device=device)
    spks = model.spk_embed_affine_layer(F.normalize(batch.embedding, dim=1))  # (B, 80)

    token_valid = torch.arange(T, device=device)[None, :] < batch.speech_token_len[:, None]  # (B, T)
    x = model.input_embedding(batch.speech_token.clamp(min=0)) * token_valid[..., None]  # (B, T, 512)
    x = F.pad(x, (0, 0, 0, config.pre_lookahead_len))  # (B, T + lookahead, input_size): no right context
    no_context = torch.zeros_like(batch.speech_token_len)
    mu = model.encode(x, batch.speech_token_len, no_context, stream)  # (B, 80, T_mel)

    mel_len = config.token_mel_ratio * batch.speech_token_len
    mask = (torch.arange(T_mel, device=device)[None, :] < mel_len[:, None]).to(mu.dtype)[:, None]  # (B, 1, T_mel)
    x1 = batch.speech_feat.transpose(1, 2)  # (B, T_mel, 80) -> (B, 80, T_mel)
    cond = prompt_condition(batch.speech_feat, prompt_frames)  # (B, 80, T_mel)

    t = noise.t.to(x1.dtype)[:, None, None]  # (B, 1, 1)
    y = (1 - (1 - sigma_min) * t) * noise.z + t * x1
    u = x1 - (1 - sigma_min) * noise.z
    if training_cfg_rate > 0:
        keep = noise.keep_condition.to(mu.dtype)
        mu, spks, cond = mu * keep[:, None, None], spks * keep[:, None], cond * keep[:, None, None]
    pred = model.decoder.estimator(y, mask, mu, noise.t, spks, cond, stream)  # (B, 80, T_mel)
    loss = F.mse_loss(pred * mask, u * mask, reduction="sum") / (mask.sum() * u.size(1))
    return LossOutput(loss=loss)


@dataclass(frozen=True)
class FlowLossConfig:
    sigma_min: float = 1e-6
    training_cfg_rate: float = 0.2

    @classmethod
    def from_yaml(cls, root: dict) -> FlowLossConfig:
        """Read `flow.decoder.cfm_params` of the whole family yaml (`config.read_yaml`)."""
        cfm = root["flow"]["decoder"]["cfm_params"]
        cfm = cfm.get("content", cfm)  # wrapped in `!new:omegaconf.DictConfig {content: ...}`
        return cls(sigma_min=float(cfm["sigma_min"]), training_cfg_rate=float(cfm["training_cfg_rate"]))


def llm_label_smoothing(root: dict) -> float:
    """`llm.lsm_weight` of the whole family yaml (0 in both releases)."""
    return float(root["llm"].get("lsm_weight", 0.0))
