"""HiFT vocoder (HiFi-GAN generator + neural source filter + iSTFT head): 80-bin mel at 50 Hz -> 24 kHz audio.

The mel is upsampled by transposed convolutions (x8, x5, x3 = x120 for the released model) while the
STFT of the harmonic source signal is fused in at every scale; a last convolution predicts magnitude
and phase of a 16-point STFT with hop 4, and the iSTFT gives 120 * 4 = 480 samples per mel frame.

Parameter names equal those of the released `hift.pt`, so the checkpoint loads with `strict=True`.
Weight norm is folded on load: the module holds plain conv weights (see `fold_weight_norm`).
`HiFTBody` is what both families share; `HiFTGenerator` is CosyVoice2's, CosyVoice3's causal one is in
`models/causal_hift.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelPaths, read_yaml
from ..errors import ModelFolderError
from .causal_conv import LeftPaddedConv1d
from .hift_source import (WEIGHT_NORMED, F0Predictor, HarmonicSource, HiFTNoise, WeightNormedConv1d,
                          WeightNormedConvTranspose1d)


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1  # sine amplitude
    nsf_sigma: float = 0.003  # noise std in voiced frames
    nsf_voiced_threshold: float = 10.0  # Hz
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_in_channels: int = 80
    f0_cond_channels: int = 512
    f0_num_class: int = 1

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len

    @property
    def spec_bins(self) -> int:
        return self.n_fft // 2 + 1

    @property
    def widths(self) -> list[int]:
        """Channels after conv_pre and after each upsampling stage."""
        return [self.base_channels // 2**i for i in range(len(self.upsample_rates) + 1)]

    @property
    def source_strides(self) -> list[int]:
        """The source STFT (hop_len per frame) is brought to each scale of the upsampling path: the stride at
        stage i is the product of the upsample rates still to come."""
        return [math.prod(self.upsample_rates[i + 1:]) for i in range(len(self.upsample_rates))]

    @classmethod
    def from_yaml(cls, hift: dict) -> "HiFTConfig":
        """From the `hift` section of cosyvoice2.yaml as parsed by `config.read_yaml`."""
        check_vocoder_classes(hift, "HiFTGenerator", "ConvRNNF0Predictor")
        return cls(**yaml_fields(hift))


def check_vocoder_classes(hift: dict, generator: str, f0_predictor: str) -> None:
    """ValueError unless the yaml's `hift` section builds `generator` with `f0_predictor` at 24 kHz."""
    tag, f0 = hift.get("__tag__", ""), hift["f0_predictor"]
    if not tag.endswith("." + generator) or not f0.get("__tag__", "").endswith("." + f0_predictor):
        raise ValueError(f"unsupported vocoder {tag} / {f0.get('__tag__')}: expected {generator} "
                         f"with {f0_predictor}")
    if hift["sampling_rate"] == 22050:
        raise ValueError("sampling_rate 22050 selects the CosyVoice1 sine generator, which is not supported")


def yaml_fields(hift: dict) -> dict:
    """The `HiFTConfig` fields of a yaml `hift` section (both families)."""
    f0 = hift["f0_predictor"]
    return dict(
        in_channels=hift["in_channels"], base_channels=hift["base_channels"],
        nb_harmonics=hift["nb_harmonics"], sampling_rate=hift["sampling_rate"],
        nsf_alpha=hift["nsf_alpha"], nsf_sigma=hift["nsf_sigma"],
        nsf_voiced_threshold=hift["nsf_voiced_threshold"],
        upsample_rates=tuple(hift["upsample_rates"]), upsample_kernel_sizes=tuple(hift["upsample_kernel_sizes"]),
        n_fft=hift["istft_params"]["n_fft"], hop_len=hift["istft_params"]["hop_len"],
        resblock_kernel_sizes=tuple(hift["resblock_kernel_sizes"]),
        resblock_dilation_sizes=_nested_tuple(hift["resblock_dilation_sizes"]),
        source_resblock_kernel_sizes=tuple(hift["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=_nested_tuple(hift["source_resblock_dilation_sizes"]),
        lrelu_slope=hift["lrelu_slope"], audio_limit=hift["audio_limit"],
        f0_in_channels=f0["in_channels"], f0_cond_channels=f0["cond_channels"], f0_num_class=f0["num_class"],
    )


def _nested_tuple(rows: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(row) for row in rows)


# ---- checkpoint loading --------------------------------------------------------------------------

_WEIGHT_NORM_SUFFIXES = {  # (g suffix, v suffix) of the two namings torch has used
    "parametrizations": (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    "legacy": (".weight_g", ".weight_v"),
}


def fold_weight_norm(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], set[str]]:
    """Replace every (g, v) pair, in either naming, by `<module>.weight` = g * v / ||v|| (norm over all
    dims but 0). Returns the folded state and the names of the modules that were folded."""
    folded, modules = {}, set()
    for key, value in state.items():
        for g_suffix, v_suffix in _WEIGHT_NORM_SUFFIXES.values():
            if key.endswith(g_suffix) or key.endswith(v_suffix):
                module = key.removesuffix(g_suffix).removesuffix(v_suffix)
                g, v = state.get(module + g_suffix), state.get(module + v_suffix)
                if g is None or v is None:
                    raise ValueError(f"{module}: weight-norm pair incomplete, found only {key}")
                if module not in modules:
                    # the same kernel torch's weight_norm runs at every forward, so the weights match bitwise
                    folded[module + ".weight"] = torch._weight_norm(v, g, 0)
                    modules.add(module)
                break
        else:
            folded[key] = value
    return folded, modules


def read_hift_state(path: str | Path, float64_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, Tensor], set[str]]:
    """Read a `hift.pt` (either weight-norm naming; an optional `generator.` prefix is dropped) and fold it;
    tensors under `float64_prefixes` are folded in float64 (a module that runs in float64)."""
    state = torch.load(path, weights_only=True, map_location="cpu")
    state = {key.removeprefix("generator."): value for key, value in state.items()}
    state = {key: value.double() if key.startswith(float64_prefixes) else value for key, value in state.items()}
    return fold_weight_norm(state)


def load_weight_normed(model: nn.Module, path: str | Path, float64_prefixes: tuple[str, ...] = ()) -> None:
    """Load a `hift.pt` into `model`: its weight-normed modules (`WEIGHT_NORMED`) must be exactly the file's
    (g, v) pairs, and every other key must match (strict)."""
    state, folded = read_hift_state(path, float64_prefixes)
    expected = {name for name, module in model.named_modules() if isinstance(module, WEIGHT_NORMED)}
    if folded != expected:
        raise ValueError(f"{path}: weight-normed modules differ from the model: missing "
                         f"{sorted(expected - folded)}, unexpected {sorted(folded - expected)}")
    model.load_state_dict(state, strict=True)


# ---- network -------------------------------------------------------------------------------------

class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, with a learned alpha per channel. (B, C, T) -> (B, C, T)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha[None, :, None]  # (1, C, 1)
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Residual stack of (Snake, dilated conv, Snake, conv) pairs, one per dilation. (B, C, T) -> (B, C, T).
    `causal`: every conv pads on the left only (CosyVoice3); else on both sides (CosyVoice2)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], causal: bool = False):
        super().__init__()

        def conv(dilation: int) -> nn.Module:
            if causal:
                return LeftPaddedConv1d(channels, channels, kernel_size, dilation=dilation)
            return WeightNormedConv1d(channels, channels, kernel_size, dilation=dilation,
                                      padding=dilation * (kernel_size - 1) // 2)

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class HiFTBody(nn.Module):
    """What both families' vocoders do between their first and their last convolution: the source's STFT, the
    upsampling stages fused with it, and the iSTFT head. A subclass builds the layers (`_build_body`)."""

    config: HiFTConfig

    def _build_body(self, causal: bool) -> None:
        """The resblocks (`causal`: left-padded convs) and the STFT window; the subclass builds conv_pre, ups,
        source_downs and conv_post."""
        c, widths = self.config, self.config.widths
        self.source_resblocks = nn.ModuleList(
            ResBlock(widths[i + 1], k, d, causal)
            for i, (k, d) in enumerate(zip(c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes)))
        self.resblocks = nn.ModuleList(  # index i * kernels + j: stage i, kernel j
            ResBlock(widths[i + 1], k, d, causal)
            for i in range(len(c.upsample_rates)) for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.register_buffer("stft_window", torch.hann_window(c.n_fft, periodic=True, dtype=torch.float64).float(),
                             persistent=False)

    def source_spectrum(self, source: Tensor) -> Tensor:
        """Source (B, 1, L) -> its STFT, real then imaginary parts (B, 2F, L / hop + 1)."""
        c = self.config
        spec = torch.stft(source.squeeze(1), c.n_fft, c.hop_len, c.n_fft, window=self.stft_window,
                          return_complex=True)  # (B, F, L / hop + 1)
        spec = torch.view_as_real(spec)  # (B, F, frames, 2)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    def upsample(self, x: Tensor, source_spec: Tensor) -> Tensor:
        """conv_pre's output (B, base, T) and the source STFT -> (B, C_last, T * prod(rates) + 1)."""
        c = self.config
        kernels = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))  # (B, C_i, T * prod(rates[:i+1]))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame, to line up with the centred STFT
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            stage = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                stage = stage + self.resblocks[i * kernels + j](x)
            x = stage / kernels
        return x

    def to_audio(self, x: Tensor) -> Tensor:
        """The last stage (B, C_last, frames) -> audio (B, (frames - 1) * hop): magnitude and phase, iSTFT."""
        c = self.config
        x = self.conv_post(F.leaky_relu(x))  # (B, 2F, frames); default slope 0.01 here, as in the reference
        magnitude = torch.exp(x[:, :c.spec_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, c.spec_bins:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        audio = torch.istft(spec, c.n_fft, c.hop_len, c.n_fft, window=self.stft_window)  # (B, L)
        return audio.clamp(-c.audio_limit, c.audio_limit)


class HiFTGenerator(HiFTBody):
    """CosyVoice2's vocoder. Mel (B, n_mels, T) -> 24 kHz audio (B, T * samples_per_frame); see `inference`."""

    yaml_class = "HiFTGenerator"

    @classmethod
    def config_from_yaml(cls, root: dict) -> HiFTConfig:
        """The config of the whole cosyvoice2.yaml's `hift` section."""
        return HiFTConfig.from_yaml(root["hift"])

    def __init__(self, config: HiFTConfig):
        super().__init__()
        self.config = c = config
        self.f0_predictor = F0Predictor(c.f0_in_channels, c.f0_cond_channels, c.f0_num_class)
        self.m_source = HarmonicSource(c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha,
                                       c.nsf_sigma, c.nsf_voiced_threshold)
        self.conv_pre = WeightNormedConv1d(c.in_channels, c.base_channels, 7, padding=3)
        widths = c.widths
        self.ups = nn.ModuleList(WeightNormedConvTranspose1d(widths[i], widths[i + 1], k, u, padding=(k - u) // 2)
                                 for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
        spec_channels = 2 * c.spec_bins  # real and imaginary parts
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_channels, widths[i + 1], 1) if s == 1 else
            nn.Conv1d(spec_channels, widths[i + 1], 2 * s, s, padding=s // 2) for i, s in enumerate(c.source_strides))
        self.conv_post = WeightNormedConv1d(widths[-1], spec_channels, 7, padding=3)  # magnitude and phase
        self._build_body(causal=False)

    # ---- loading ----

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> "HiFTGenerator":
        """Build from `cosyvoice2.yaml` (`hift` section) and load `hift.pt` of a model folder."""
        paths = ModelPaths(Path(model_dir))
        missing = [p.name for p in (paths.yaml, paths.hift) if not p.exists()]
        if missing:
            raise ModelFolderError(f"{model_dir}: missing {', '.join(missing)}")
        model = cls(HiFTConfig.from_yaml(read_yaml(paths.yaml)["hift"]))
        model.load_hift_state(paths.hift)
        return model.to(device).eval()

    def load_hift_state(self, path: str | Path) -> None:
        """Load an official `hift.pt` in either weight-norm naming; every key must match (strict)."""
        load_weight_normed(self, path)

    # ---- inference ----

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """Mel (B, n_mels, T) and source (B, 1, L) -> audio (B, L), L = T * samples_per_frame."""
        source_spec = self.source_spectrum(source)  # (B, 2F, L / hop + 1)
        return self.to_audio(self.upsample(self.conv_pre(mel), source_spec))

    @torch.inference_mode()
    def inference(self, mel: Tensor, cache_source: Tensor | None, noise: HiFTNoise) -> tuple[Tensor, Tensor]:
        """Mel (B, n_mels, T) -> (audio (B, L), source (B, 1, L)), L = T * samples_per_frame.

        `cache_source` (B, 1, S), S <= L, replaces the first S source samples: in streaming it carries the
        source of the mel frames repeated from the previous chunk, so the excitation stays continuous.
        """
        B, n_mels, _ = mel.shape
        assert n_mels == self.config.in_channels, f"mel has {n_mels} bins, the model {self.config.in_channels}"
        f0 = self.f0_predictor(mel)  # (B, T)
        source = self.m_source(f0, noise)  # (B, 1, L)
        if cache_source is not None and cache_source.shape[2] > 0:
            S = cache_source.shape[2]
            assert cache_source.shape[:2] == (B, 1) and S <= source.shape[2], \
                f"cache_source {tuple(cache_source.shape)} for a source of {tuple(source.shape)}"
            source = torch.cat([cache_source.to(source.dtype), source[:, :, S:]], dim=2)
        return self.decode(mel, source), source
