"""CosyVoice3's causal HiFT vocoder (official `CausalHiFTGenerator` with `CausalConvRNNF0Predictor`).

The CosyVoice2 vocoder's structure (`HiFTBody`: source STFT fused into three upsampling stages, iSTFT head)
with causal parts: every convolution pads on the left, the upsampling stages are nearest-neighbour
repeats followed by a left-padded convolution (not transposed convolutions), the source's phase is held
constant over each frame, and only two layers look ahead: the F0 predictor's first convolution (3 frames)
and `conv_pre` (`conv_pre_look_right`, 4 frames).

Streaming (`inference(mel, finalize=False)` on T mel frames): the F0 predictor takes the last 3 frames as
right context, `conv_pre` the last 4 of the rest, and the last frame's samples are dropped, which the next
call makes again with its right context: (T - 8) * 480 samples. `finalize=True` gives all T * 480.

F0 runs in float64, as the official code does on every call (the causal predictor needs the precision).
The source noise is the official fixed noise (`models/fixed_noise.py`), drawn once when the folder is
loaded: inference draws nothing, so a chunk's audio does not depend on anything but its mel.

A stream need not run the vocoder on all its mel again at every chunk (the official way): every layer is
causal with a finite reach to the left, so `inference_window` runs a window of the mel from `context_frames`
before the first new sample on. Two things are not local and come in as state: the source's phase, a sum
over every frame so far (`HarmonicSource.accumulated_cycles`), and the fixed noise, read by absolute sample
position (`ShiftedNoise`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.errors import ModelFolderError
from cosyvoice_triton.models.causal_conv import CausalDownsample, CausalUpsample, LeftPaddedConv1d, LookaheadConv1d
from cosyvoice_triton.models.checkpoint import read_state
from cosyvoice_triton.models.dit_flow import DiTFlowConfig
from cosyvoice_triton.models.fixed_noise import NOISE_HARMONICS, FixedNoise, cosyvoice3_draws
from cosyvoice_triton.models.hift import (HiFTBody, HiFTConfig, ResBlock, check_vocoder_classes, load_weight_normed,
                                          yaml_fields)
from cosyvoice_triton.models.hift_source import HarmonicSource, HiFTNoise, ShiftedNoise

F0_LOOKAHEAD = 3  # frames the F0 predictor's first convolution (kernel 4) reads ahead


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    conv_pre_look_right: int = 4

    @property
    def held_back_frames(self) -> int:
        """Mel frames at the end of a non-final call that make no samples: 3 + 4 look-ahead, plus the last frame."""
        return F0_LOOKAHEAD + self.conv_pre_look_right + 1

    @classmethod
    def from_yaml(cls, hift: dict) -> CausalHiFTConfig:
        """From the `hift` section of cosyvoice3.yaml as parsed by `config.read_yaml`."""
        check_vocoder_classes(hift, "CausalHiFTGenerator", "CausalConvRNNF0Predictor")
        config = cls(**yaml_fields(hift), conv_pre_look_right=hift["conv_pre_look_right"])
        if config.nb_harmonics + 1 != NOISE_HARMONICS:
            raise ValueError(f"hift.nb_harmonics {config.nb_harmonics}: the fixed noise has {NOISE_HARMONICS} "
                             "harmonics, so it must be 8")
        return config


class CausalF0Predictor(nn.Module):
    """Mel (B, n_mels, T) -> F0 in Hz (B, T) (finalize) or (B, T - 3): five conv+ELU layers, the first reading
    3 frames ahead, the others causal, and a linear read-out made positive."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = [LookaheadConv1d(in_channels, cond_channels, F0_LOOKAHEAD + 1), nn.ELU()]
        for _ in range(4):
            layers += [LeftPaddedConv1d(cond_channels, cond_channels, 3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # checkpoint names: condnet.{0,2,4,6,8}
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        hidden = self.condnet[0](mel, finalize)  # (B, C, T) or (B, C, T - 3): the look-ahead frames as context
        hidden = self.condnet[1:](hidden)
        hidden = hidden.transpose(1, 2)  # (B, C, T') -> (B, T', C) for the linear read-out
        return torch.abs(self.classifier(hidden).squeeze(-1))  # (B, T')


class CausalHiFTGenerator(HiFTBody):
    """Mel (B, n_mels, T) -> 24 kHz audio; see `inference`. `noise`: the source noise (the official fixed noise
    when loaded with `from_model_dir`)."""

    yaml_class = "CausalHiFTGenerator"

    def __init__(self, config: CausalHiFTConfig, noise: HiFTNoise | None = None):
        super().__init__()
        self.config = c = config
        self.noise = noise
        self.f0_predictor = CausalF0Predictor(c.f0_in_channels, c.f0_cond_channels, c.f0_num_class).double()
        self.m_source = HarmonicSource(c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha,
                                       c.nsf_sigma, c.nsf_voiced_threshold, phase_upsampling="nearest")
        self.conv_pre = LookaheadConv1d(c.in_channels, c.base_channels, c.conv_pre_look_right + 1)
        widths = c.widths
        self.ups = nn.ModuleList(CausalUpsample(widths[i], widths[i + 1], k, u)
                                 for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
        spec_channels = 2 * c.spec_bins  # real and imaginary parts
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_channels, widths[i + 1], 1) if s == 1 else CausalDownsample(spec_channels, widths[i + 1], s)
            for i, s in enumerate(c.source_strides))
        self.conv_post = LeftPaddedConv1d(widths[-1], spec_channels, 7)  # magnitude and phase
        self._build_body(causal=True)

    @classmethod
    def config_from_yaml(cls, root: dict) -> CausalHiFTConfig:
        """The config of the whole cosyvoice3.yaml's `hift` section."""
        return CausalHiFTConfig.from_yaml(root["hift"])

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> CausalHiFTGenerator:
        """Build from cosyvoice3.yaml (`hift`, and `flow` for the noise's draws) and load `hift.pt` strictly."""
        paths = ModelPaths(Path(model_dir))
        root = read_yaml(paths.yaml)
        try:
            config = cls.config_from_yaml(root)
        except (KeyError, ValueError) as exc:
            raise ModelFolderError(f"{paths.yaml}: `hift`: {exc}") from exc
        flow = DiTFlowConfig.from_yaml(root)
        noise = FixedNoise(cosyvoice3_draws(flow.mel_bins, flow.noise_frames, flow.vocab_size, flow.input_size,
                                            flow.spk_embed_dim, config.f0_in_channels, config.f0_cond_channels,
                                            config.f0_num_class))
        model = cls(config, noise)
        model.load_hift_state(paths.hift)
        return model.to(device).eval()

    def load_hift_state(self, path: str | Path) -> None:
        """Load an official `hift.pt` in either weight-norm naming, strictly; the F0 predictor folded in float64.
        Errors name the file."""
        read_state(Path(path))  # absent or unreadable: ModelFolderError
        try:
            load_weight_normed(self, path, float64_prefixes=("f0_predictor.",))
        except (RuntimeError, ValueError) as exc:
            raise ModelFolderError(f"{path}: does not match the vocoder its folder's yaml describes: {exc}") from exc

    def decode(self, mel: Tensor, source: Tensor, finalize: bool = True) -> Tensor:
        """Mel (B, n_mels, T) and source (B, 1, T * 480) -> audio (B, T * 480) (finalize), else the last
        `conv_pre_look_right` frames are right context: (B, (T - 5) * 480)."""
        c = self.config
        source_spec = self.source_spectrum(source)  # (B, 2F, 120 T + 1)
        x = self.conv_pre(mel, finalize)  # (B, base, T) or (B, base, T - look_right)
        if not finalize:  # the context frames make no samples: drop their source frames too
            source_spec = source_spec[:, :, :-math.prod(c.upsample_rates) * c.conv_pre_look_right]
        audio = self.to_audio(self.upsample(x, source_spec))
        return audio if finalize else audio[:, :-c.samples_per_frame]

    @torch.inference_mode()
    def inference(self, mel: Tensor, finalize: bool = True, noise: HiFTNoise | None = None) -> tuple[Tensor, Tensor]:
        """Mel (B, n_mels, T) -> (audio (B, L), source (B, 1, L')): finalize L = T * 480, else (T - 8) * 480
        (module docstring); `noise` replaces the vocoder's own (e.g. `ZeroNoise`)."""
        f0 = self._f0(mel, finalize)  # (B, T) or (B, T - 3)
        source = self.m_source(f0, self._noise(noise))  # (B, 1, 480 * f0 frames)
        body = mel if finalize else mel[:, :, :-F0_LOOKAHEAD]
        return self.decode(body, source, finalize), source

    @property
    def f0_context(self) -> int:
        """Frames before a frame that its F0 depends on (the predictor's causal convolutions)."""
        return sum(layer.left for layer in self.f0_predictor.condnet if isinstance(layer, LeftPaddedConv1d))

    @property
    def context_frames(self) -> int:
        """Mel frames before the first sample wanted that a window must start with: a window's first frames
        lack what came before them (their F0, then `decode`'s reach), and differ from a run on the whole mel."""
        return self.f0_context + math.ceil(self._decode_warmup_samples() / self.config.samples_per_frame)

    def _decode_warmup_samples(self) -> int:
        """`decode`'s leading samples that depend on frames before its first (zero padding in their place):
        how many frames go wrong at each layer, from the start, along both paths of every stage."""
        c, kernels = self.config, len(self.config.resblock_kernel_sizes)
        wrong_x = 0  # conv_pre reads only ahead
        wrong_spec = math.ceil(c.n_fft // 2 / c.hop_len)  # centred STFT frames that read the reflected edge
        for i, (up, down) in enumerate(zip(self.ups, self.source_downs)):
            wrong_x = wrong_x * up.rate + up.kernel_size[0] - 1 + (i == len(self.ups) - 1)  # + the reflected frame
            stride = down.stride[0]
            wrong_source = wrong_spec if stride == 1 else (wrong_spec + stride - 2) // stride + 1
            wrong_source += _reach(self.source_resblocks[i])
            wrong_x = max(wrong_x, wrong_source) + max(_reach(self.resblocks[i * kernels + j]) for j in range(kernels))
        wrong_x += self.conv_post.left
        return c.hop_len * (wrong_x + 1)  # the iSTFT's frames overlap n_fft / hop samples

    @torch.inference_mode()
    def inference_window(self, mel: Tensor, first: int, cycles_before: Tensor, finalize: bool = True,
                         noise: HiFTNoise | None = None) -> tuple[Tensor, Tensor]:
        """`inference` on the frames of a longer mel from frame `first` on, what came before given as state.

        mel (B, n_mels, T): frames first .. first + T - 1. If first > 0, the F0 of its first `f0_context`
        frames lacks their left context, so the source and the audio start at frame s = first + f0_context
        (else s = 0). cycles_before (B, H) float64: the source's phase accumulated over the frames before s
        (zeros at s = 0). The audio's samples before frame s + context_frames - f0_context lack their left
        context too, unless s = 0.
        Returns (audio (B, L) from sample 480 s on, to the same end as `inference` on the whole mel; the
        phase accumulated before frame s + k, k = 0 .. F (B, F + 1, H) float64, F the frames with an F0)."""
        noise = self._noise(noise)
        skip = self.f0_context if first > 0 else 0
        f0 = self._f0(mel, finalize)[:, skip:]  # (B, F)
        start = first + skip
        cycles = self.m_source.accumulated_cycles(f0, noise, cycles_before)  # (B, F + 1, H)
        source = self.m_source(f0, ShiftedNoise(noise, start * self.config.samples_per_frame), cycles[:, 1:])
        body = mel[:, :, skip:] if finalize else mel[:, :, skip:-F0_LOOKAHEAD]
        return self.decode(body, source, finalize), cycles

    def _noise(self, noise: HiFTNoise | None) -> HiFTNoise:
        noise = self.noise if noise is None else noise
        if noise is None:
            raise ValueError("the vocoder has no noise source: load it with from_model_dir or pass one")
        return noise

    def _f0(self, mel: Tensor, finalize: bool) -> Tensor:
        """F0 (B, T) or (B, T - 3), computed in float64 and returned in the mel's dtype."""
        if self.f0_predictor.classifier.weight.dtype != torch.float64:  # a cast of the whole model reached it
            self.f0_predictor.double()
        return self.f0_predictor(mel.double(), finalize).to(mel.dtype)


def _reach(block: ResBlock) -> int:
    """Frames before a frame that a causal resblock's output depends on."""
    return sum(conv.left for conv in (*block.convs1, *block.convs2))

