"""The flow model: speech tokens (25 Hz) -> 80-bin mel (50 Hz) by conditional flow matching.

`TokenToMel` is what both families share, extended to batches of right-padded rows (the server batches
chunks of many streams into one call). Per row: prompt tokens ++ new tokens are embedded and encoded to
`mu` (the family's part: `encode`); the prompt mel conditions its own frames; 10 Euler steps from fixed
noise with classifier-free guidance (`FlowMatching`) produce the mel, and the prompt frames are cut off.
`FlowModel` here is CosyVoice2's (official `CausalMaskedDiffWithXvec`: conformer encoder, UNet estimator);
CosyVoice3's is `models/dit_flow.py` (pre-lookahead layer, DiT estimator). Both load `flow.pt` with the
released parameter names.

Precision (`FlowMatching.set_precision`): "fp32", the reference; "bf16": the estimator's matrix products
and convolutions in bfloat16 under autocast (norms, softmax and the Euler update stay float32), native
on CPUs with AVX512-BF16/AMX and on GPUs; "int8-dynamic" (CPU): the Linear layers of the estimator's
transformer blocks (attention and feed-forward, most of its products) in int8 through PyTorch's quantized
engine, each row's activations quantized on their own (models/llm_precision.Int8DynamicLinear), so a
row's mel does not depend on its batch. Quality against fp32 after all 10 steps: perf/flow_quality.py.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_triton.config import ModelPaths, read_yaml
from cosyvoice_triton.errors import InvalidInput
from cosyvoice_triton.family import check_yaml_class
from cosyvoice_triton.models.checkpoint import load_state
from cosyvoice_triton.models.flow_encoder import FlowEncoder, FlowEncoderConfig
from cosyvoice_triton.models.flow_estimator import FlowEstimator, FlowEstimatorConfig
from cosyvoice_triton.models.llm_precision import quantize_linears_dynamic

# Values the official code fixes outside the yaml.
N_TIMESTEPS = 10  # Euler steps (`CausalMaskedDiffWithXvec.inference`)
NOISE_SEED = 0  # `CausalConditionalCFM.__init__` seeds 0 and then draws its noise
NOISE_FRAMES = 50 * 300  # 300 s of 50 Hz mel frames
FLOW_PRECISIONS = ("fp32", "bf16", "int8-dynamic")


def check_flow_precision(precision: str) -> str:
    if precision not in FLOW_PRECISIONS:
        raise ValueError(f"flow precision must be one of {', '.join(FLOW_PRECISIONS)}, got {precision!r}")
    return precision


@dataclass(frozen=True)
class FlowConfig:
    encoder: FlowEncoderConfig
    estimator: FlowEstimatorConfig
    vocab_size: int = 6561
    input_size: int = 512  # token embedding width
    mel_bins: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    inference_cfg_rate: float = 0.7  # classifier-free guidance strength at inference
    n_timesteps: int = N_TIMESTEPS
    noise_frames: int = NOISE_FRAMES

    @classmethod
    def from_yaml(cls, root: dict) -> FlowConfig:
        """Build from the whole cosyvoice2.yaml (as returned by `config.read_yaml`)."""
        flow = root["flow"]
        return cls(encoder=FlowEncoderConfig.from_yaml(flow),
                   estimator=FlowEstimatorConfig.from_yaml(flow["decoder"]["estimator"]),
                   vocab_size=flow["vocab_size"], input_size=flow["input_size"], mel_bins=flow["output_size"],
                   spk_embed_dim=flow["spk_embed_dim"], token_mel_ratio=flow["token_mel_ratio"],
                   pre_lookahead_len=flow["pre_lookahead_len"], inference_cfg_rate=guidance_rate(flow))


def guidance_rate(flow: dict) -> float:
    """The inference CFG rate of a yaml `flow` section, after checking its solver (both families share it)."""
    cfm = flow["decoder"]["cfm_params"]
    cfm = cfm.get("content", cfm)  # wrapped in `!new:omegaconf.DictConfig {content: ...}`
    if cfm["solver"] != "euler" or cfm["t_scheduler"] != "cosine":
        raise ValueError(f"flow cfm_params solver={cfm['solver']!r} t_scheduler={cfm['t_scheduler']!r}: "
                         "only euler with the cosine schedule is supported")
    return float(cfm["inference_cfg_rate"])


def euler_schedule(n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, dt) for each Euler step on the cosine schedule t = 1 - cos(pi/2 * s), s uniform in [0, 1].

    Accumulated exactly as the official solver does (t += dt; dt = t_span[k+1] - t), in fp32 on the CPU.
    """
    t_span = 1 - torch.cos(torch.linspace(0, 1, n_steps + 1) * 0.5 * torch.pi)
    t, dt = t_span[0:1], t_span[1:2] - t_span[0:1]
    ts, dts = [], []
    for step in range(1, n_steps + 1):
        ts.append(t)
        dts.append(dt)
        t = t + dt
        if step < n_steps:
            dt = t_span[step + 1] - t
    return torch.cat(ts), torch.cat(dts)


class FlowMatching(nn.Module):
    """Euler ODE solver around the estimator (official `CausalConditionalCFM`, inference only), for both
    families: the CosyVoice2 UNet (`FlowEstimator`, the default) or the CosyVoice3 DiT (`models/dit.py`),
    which take the same call."""

    def __init__(self, config: FlowConfig, estimator: nn.Module | None = None):
        super().__init__()
        self.inference_cfg_rate = config.inference_cfg_rate
        self.estimator = FlowEstimator(config.estimator) if estimator is None else estimator
        generator = torch.Generator().manual_seed(NOISE_SEED)  # local: the global RNG is left alone
        noise = torch.randn(1, config.mel_bins, config.noise_frames, generator=generator)
        self.register_buffer("rand_noise", noise, persistent=False)  # (1, 80, noise_frames)
        t_steps, dt_steps = euler_schedule(config.n_timesteps)
        self.register_buffer("t_steps", t_steps, persistent=False)  # (n_timesteps,)
        self.register_buffer("dt_steps", dt_steps, persistent=False)  # (n_timesteps,)
        self.precision = "fp32"  # of the estimator's arithmetic (module docstring)

    def set_precision(self, precision: str) -> None:
        """fp32 and bf16 switch back and forth; int8-dynamic quantizes the Linear layers of the estimator's
        transformer blocks (its `int8_blocks`: the UNet's and the DiT's) in place, once, from fp32 (CPU only)."""
        check_flow_precision(precision)
        if self.precision == "int8-dynamic" and precision != "int8-dynamic":
            raise RuntimeError("the flow estimator is already quantized (int8-dynamic)")
        if precision == "int8-dynamic" and self.precision != precision:
            if self.t_steps.device.type != "cpu":
                raise ValueError(f"flow precision int8-dynamic runs on the CPU only, not on {self.t_steps.device}")
            for block in self.estimator.modules():
                if isinstance(block, self.estimator.int8_blocks):
                    quantize_linears_dynamic(block)
        self.precision = precision

    def estimator_arithmetic(self, device: torch.device) -> AbstractContextManager:
        """Where the estimator runs: as it is (fp32, int8-dynamic), or under bf16 autocast; callers take
        float32 out."""
        if self.precision != "bf16":
            return nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def forward(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                streaming: torch.Tensor) -> torch.Tensor:
        """mu, cond: (B, 80, T); mask: (B, 1, T) float; spks: (B, 80); streaming: (B,) bool -> mel (B, 80, T).

        The loop has fixed shapes and no host syncs. Guidance runs as one estimator batch of 2B: rows B..2B-1
        repeat x and mask with mu, spks and cond zeroed.
        """
        B, _, T = mu.shape
        x = self.rand_noise[:, :, :T].to(mu.dtype).expand(B, -1, -1)
        mask2 = torch.cat([mask, mask])
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        streaming2 = torch.cat([streaming, streaming])
        for step in range(self.t_steps.size(0)):
            t = self.t_steps[step].expand(2 * B)
            with self.estimator_arithmetic(x.device):
                velocity = self.estimator(torch.cat([x, x]), mask2, mu2, t, spks2, cond2, streaming2).float()
            x = self.euler_step(x, step, *velocity.split(B))
        return x

    def euler_step(self, x: torch.Tensor, step: int, v_cond: torch.Tensor, v_uncond: torch.Tensor) -> torch.Tensor:
        """x (B, 80, T) after Euler step `step` along the guided velocity: the conditioned velocity v_cond pushed
        away from the unconditioned v_uncond (each (B, 80, T)) by the guidance rate."""
        velocity = (1.0 + self.inference_cfg_rate) * v_cond - self.inference_cfg_rate * v_uncond
        return x + self.dt_steps[step] * velocity


@dataclass(frozen=True)
class FlowConditions:
    """The encoder's output and the solver's conditions for a batch of rows (`FlowModel.conditions`)."""

    mu: torch.Tensor  # (B, 80, T_mel) encoder output
    mask: torch.Tensor  # (B, 1, T_mel) float, 1 on the frames each row makes
    spks: torch.Tensor  # (B, 80) projected speaker embedding
    cond: torch.Tensor  # (B, 80, T_mel) prompt mel on the prompt frames, else 0
    streaming: torch.Tensor  # (B,) bool
    finalize: torch.Tensor  # (B,) bool
    enc_len: torch.Tensor  # (B,) tokens that produce frames, prompt included
    mel_len: torch.Tensor  # (B,) frames, prompt included (token_mel_ratio * enc_len)
    prompt_feat_len: torch.Tensor  # (B,) prompt frames, cut off the output
    out_len: torch.Tensor  # (B,) frames after the prompt's
    max_out: int  # out_len.max()


class TokenToMel(nn.Module):
    """What the flows of both families share (inference only): the lengths, the input checks, the conditions
    around the family's `encode`, the solver and the prompt cut, the token embedding and the speaker
    projection. A subclass builds the rest and `decoder` (a `FlowMatching`), names the yaml class it reads
    (`yaml_class`) and turns embedded tokens into `mu` (`encode`)."""

    yaml_class: str  # the official class the yaml's `flow` section must build
    decoder: FlowMatching

    def __init__(self, config: FlowConfig):
        """`config`: a FlowConfig, or CosyVoice3's `DiTFlowConfig` (the fields read here have the same names)."""
        super().__init__()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.mel_bins)

    @classmethod
    def config_from_yaml(cls, root: dict):
        raise NotImplementedError

    def encode(self, x: torch.Tensor, enc_len: torch.Tensor, context_len: torch.Tensor,
               streaming: torch.Tensor) -> torch.Tensor:
        """Embedded tokens x (B, T_enc + pre_lookahead_len, input_size), zero after each row's tokens -> mu
        (B, 80, T_mel). Row b makes frames for its first enc_len[b] tokens; the context_len[b] after them are
        right context only. streaming: (B,) bool, chunk attention per row."""
        raise NotImplementedError

    def final_mu_tokens(self, tokens: int) -> int:
        """Of `tokens` tokens that more may follow, how many have an encoder output (`mu`) that no later token
        changes: those with all their look-ahead tokens present (and, with a chunk-attending encoder, in
        whole chunks)."""
        return max(tokens - self.config.pre_lookahead_len, 0)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> Self:
        """Build from the folder's yaml (its `flow` section must build `yaml_class`) and load `flow.pt` strictly."""
        paths = ModelPaths(Path(model_dir))
        root = read_yaml(paths.yaml)
        check_yaml_class(root["flow"], cls.yaml_class, "flow", paths.yaml)
        model = cls(cls.config_from_yaml(root))
        load_state(model, paths.flow)
        return model.to(device).eval()

    def output_lengths(self, token_len: torch.Tensor, prompt_token_len: torch.Tensor,
                       prompt_feat_len: torch.Tensor, finalize: bool | torch.Tensor) -> torch.Tensor:
        """(B,) mel frames that `inference` returns per row (prompt frames removed)."""
        finalize = torch.as_tensor(finalize, device=token_len.device)
        return self._lengths(token_len, prompt_token_len, prompt_feat_len, finalize)[2]

    def _lengths(self, token_len: torch.Tensor, prompt_token_len: torch.Tensor, prompt_feat_len: torch.Tensor,
                 finalize: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(enc_len, mel_len, out_len), each (B,): the tokens that produce frames (the look-ahead is held back
        unless `finalize`), their mel frames (prompt included), and the frames `inference` returns."""
        enc_len = prompt_token_len + token_len - self.config.pre_lookahead_len * (~finalize)
        mel_len = self.config.token_mel_ratio * enc_len
        return enc_len, mel_len, mel_len - prompt_feat_len

    def _check_inputs(self, token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                      prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                      embedding: torch.Tensor) -> None:
        B = token.size(0) if token.dim() == 2 else -1
        expected = {"token": (token, (B, None)), "token_len": (token_len, (B,)),
                    "prompt_token": (prompt_token, (B, None)), "prompt_token_len": (prompt_token_len, (B,)),
                    "prompt_feat": (prompt_feat, (B, None, self.config.mel_bins)),
                    "prompt_feat_len": (prompt_feat_len, (B,)),
                    "embedding": (embedding, (B, self.config.spk_embed_dim))}
        for name, (tensor, shape) in expected.items():
            if tensor.dim() != len(shape) or any(want not in (None, got) for want, got in zip(shape, tensor.shape)):
                raise InvalidInput(name, f"shape {tuple(tensor.shape)}, expected {shape} (None: any)")

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                  prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool | torch.Tensor,
                  finalize: bool | torch.Tensor) -> torch.Tensor:
        """Synthesize mel for `token` in the voice of the prompt.

        token: (B, T) int, prompt_token: (B, Tp) int, prompt_feat: (B, Tf, 80), embedding: (B, 192); each with
        a (B,) length tensor, rows right-padded. streaming: chunk attention masks (bool, or (B,) bool per row).
        finalize: False holds the last `pre_lookahead_len` tokens back as right context; they produce no
        frames (bool, or (B,) bool per row).
        Returns mel (B, 80, max frames); row b holds `output_lengths(...)[b]` frames, then zeros.
        """
        c = self.conditions(token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len,
                            embedding, streaming, finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, c.streaming)  # (B, 80, T_mel)

        # Drop each row's prompt frames: out[b, :, j] = mel[b, :, prompt_feat_len[b] + j].
        T_mel, device = mel.size(2), mel.device
        j = torch.arange(c.max_out, device=device)[None, :]  # (1, T_out)
        frame_src = (c.prompt_feat_len[:, None] + j).clamp(max=T_mel - 1)  # (B, T_out)
        out = mel.gather(2, frame_src[:, None, :].expand(-1, self.config.mel_bins, -1))
        return out * (j < c.out_len[:, None])[:, None, :].to(out.dtype)

    def conditions(self, token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                   prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                   embedding: torch.Tensor, streaming: bool | torch.Tensor,
                   finalize: bool | torch.Tensor) -> FlowConditions:
        """Checks, then the encoder: what the solver needs for every frame of each row (see `inference`)."""
        self._check_inputs(token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding)
        B, device = token.size(0), token.device
        streaming = torch.as_tensor(streaming, dtype=torch.bool, device=device).expand(B)
        finalize = torch.as_tensor(finalize, dtype=torch.bool, device=device).expand(B)
        token_len, prompt_token_len, prompt_feat_len = (
            x.to(device=device, dtype=torch.long) for x in (token_len, prompt_token_len, prompt_feat_len))
        total_len = prompt_token_len + token_len
        enc_len, mel_len, out_len = self._lengths(token_len, prompt_token_len, prompt_feat_len, finalize)
        # The only host sync: output shapes, before the solver.
        T_enc, T_out, min_enc, min_out = torch.stack(
            [enc_len.max(), out_len.max(), enc_len.min(), out_len.min()]).tolist()
        if min_enc < 1 or min_out < 0:
            raise InvalidInput("token_len", "too few tokens for the prompt length and the look-ahead")
        T_mel = self.config.token_mel_ratio * T_enc
        if T_mel > self.decoder.rand_noise.size(2):
            raise InvalidInput("token", f"{T_mel} mel frames exceed the {self.decoder.rand_noise.size(2)}-frame limit")

        weight = self.spk_embed_affine_layer.weight
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(weight.dtype), dim=1))  # (B, 80)

        # Row b: prompt_token[b, :Tp_b] ++ token[b, :T_b], then padding; width covers the look-ahead slots.
        prompt_then_token = torch.cat([prompt_token.long(), token.long()], dim=1)  # (B, Tp + T), padding inside
        pos = torch.arange(T_enc + self.config.pre_lookahead_len, device=device)[None, :]  # (1, W)
        in_prompt = pos < prompt_token_len[:, None]
        src_index = torch.where(in_prompt, pos, pos - prompt_token_len[:, None] + prompt_token.size(1))
        ids = prompt_then_token.gather(1, src_index.clamp(max=prompt_then_token.size(1) - 1))  # (B, W)
        valid = (pos < total_len[:, None]).to(weight.dtype)
        x = self.input_embedding(ids.clamp(min=0)) * valid[..., None]  # (B, W, input_size)

        mu = self.encode(x, enc_len, total_len - enc_len, streaming)  # (B, 80, T_mel)

        frame = torch.arange(T_mel, device=device)[None, :]  # (1, T_mel)
        mask = (frame < mel_len[:, None]).to(mu.dtype)[:, None, :]  # (B, 1, T_mel)
        n_prompt = min(prompt_feat.size(1), T_mel)
        cond = torch.zeros(B, T_mel, self.config.mel_bins, device=device, dtype=mu.dtype)
        is_prompt_frame = (frame[:, :n_prompt] < prompt_feat_len[:, None])[..., None]  # (B, n_prompt, 1)
        cond[:, :n_prompt] = prompt_feat[:, :n_prompt].to(mu.dtype) * is_prompt_frame
        cond = cond.transpose(1, 2)  # (B, T_mel, 80) -> (B, 80, T_mel)
        return FlowConditions(mu, mask, spks, cond, streaming, finalize, enc_len, mel_len, prompt_feat_len,
                              out_len, T_out)


class FlowModel(TokenToMel):
    """CosyVoice2's token-to-mel model (official `CausalMaskedDiffWithXvec`): an up-sampling conformer encoder
    and a causal UNet estimator."""

    yaml_class = "CausalMaskedDiffWithXvec"

    def __init__(self, config: FlowConfig):
        super().__init__(config)
        self.encoder = FlowEncoder(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.mel_bins)
        self.decoder = FlowMatching(config)

    @classmethod
    def config_from_yaml(cls, root: dict) -> FlowConfig:
        return FlowConfig.from_yaml(root)

    def final_mu_tokens(self, tokens: int) -> int:
        chunk = self.encoder.config.static_chunk_size  # the encoder attends in chunks of tokens
        return super().final_mu_tokens(tokens) // chunk * chunk

    def encode(self, x: torch.Tensor, enc_len: torch.Tensor, context_len: torch.Tensor,
               streaming: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x, enc_len, context_len, streaming)  # (B, T_mel, 512): up-sampled x2
        return self.encoder_proj(h).transpose(1, 2).contiguous()  # (B, T_mel, 80) -> (B, 80, T_mel)
