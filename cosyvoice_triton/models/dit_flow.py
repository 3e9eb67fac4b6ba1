"""CosyVoice3's flow model (official `CausalMaskedDiffWithDiT`, inference only): no conformer encoder.

Per row, the tokens (prompt ++ new) are embedded to 80 channels, mixed by the pre-lookahead layer (each
token sees the 3 tokens after it) and repeated x2 to mel rate: that is `mu`, 80 channels, with no
projection. The DiT estimator (`models/dit.py`) then runs in the shared solver (`FlowMatching`: 10 Euler
steps on the cosine schedule, CFG 0.7, the fixed noise of seed 0, as CosyVoice2). `TokenToMel` (flow.py)
does the rest: lengths, checks, conditions and the prompt cut, for batches of right-padded rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_triton.models.dit import DiT, DiTConfig
from cosyvoice_triton.models.flow import NOISE_FRAMES, N_TIMESTEPS, FlowMatching, TokenToMel, guidance_rate


@dataclass(frozen=True)
class DiTFlowConfig:
    estimator: DiTConfig
    vocab_size: int = 6561
    input_size: int = 80  # token embedding width (= mel bins: mu is the embedding itself)
    mel_bins: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    inference_cfg_rate: float = 0.7
    n_timesteps: int = N_TIMESTEPS
    noise_frames: int = NOISE_FRAMES

    @classmethod
    def from_yaml(cls, root: dict) -> DiTFlowConfig:
        """Build from the whole cosyvoice3.yaml (as returned by `config.read_yaml`)."""
        flow = root["flow"]
        lookahead = flow["pre_lookahead_layer"]
        if lookahead["pre_lookahead_len"] != flow["pre_lookahead_len"] or lookahead["in_channels"] != flow["input_size"]:
            raise ValueError(f"flow.pre_lookahead_layer {lookahead} disagrees with flow.pre_lookahead_len / input_size")
        if flow["input_size"] != flow["output_size"]:
            raise ValueError(f"flow.input_size {flow['input_size']} != output_size {flow['output_size']}: "
                             "mu is the token embedding, so both are the mel bins")
        return cls(estimator=DiTConfig.from_yaml(flow["decoder"]["estimator"]), vocab_size=flow["vocab_size"],
                   input_size=flow["input_size"], mel_bins=flow["output_size"], spk_embed_dim=flow["spk_embed_dim"],
                   token_mel_ratio=flow["token_mel_ratio"], pre_lookahead_len=flow["pre_lookahead_len"],
                   pre_lookahead_channels=lookahead["channels"], inference_cfg_rate=guidance_rate(flow))


class PreLookaheadLayer(nn.Module):
    """Each token mixed with the `lookahead` tokens after it, then causally with the two before, plus a residual.

    conv1 (kernel lookahead + 1) reads tokens t .. t + lookahead, LeakyReLU (slope 0.01), conv2 (kernel 3)
    reads positions t - 2 .. t (zeros before the first).
    """

    def __init__(self, channels: int, hidden: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T + lookahead, C): T tokens then their right context (zeros where a row has none) -> (B, T, C)."""
        h = x.transpose(1, 2)  # (B, C, T + lookahead): channels first for the convolutions
        h = F.leaky_relu(self.conv1(h))  # (B, hidden, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # (B, C, T)
        return h.transpose(1, 2) + x[:, :x.shape[1] - self.lookahead]  # (B, T, C)


class DiTFlowModel(TokenToMel):
    yaml_class = "CausalMaskedDiffWithDiT"

    def __init__(self, config: DiTFlowConfig):
        super().__init__(config)
        self.pre_lookahead_layer = PreLookaheadLayer(config.input_size, config.pre_lookahead_channels,
                                                     config.pre_lookahead_len)
        self.decoder = FlowMatching(config, estimator=DiT(config.estimator))

    @classmethod
    def config_from_yaml(cls, root: dict) -> DiTFlowConfig:
        return DiTFlowConfig.from_yaml(root)

    def encode(self, x: Tensor, enc_len: Tensor, context_len: Tensor, streaming: Tensor) -> Tensor:
        """`TokenToMel.encode`: x (B, T_enc + lookahead, 80) -> mu (B, 80, T_mel). Every row's context lies in
        x already (its next tokens, or zeros after its last token), so one pass serves all rows."""
        h = self.pre_lookahead_layer(x)  # (B, T_enc, 80)
        h = h.repeat_interleave(self.config.token_mel_ratio, dim=1)  # (B, T_mel, 80)
        return h.transpose(1, 2).contiguous()  # (B, T_mel, 80) -> (B, 80, T_mel)
