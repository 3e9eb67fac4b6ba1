"""The `cosyvoice3.yaml` of a generated CosyVoice3 model folder.

It has the structure and tags of the released file for the sections a serving stack reads (llm, flow,
hift, the mel extractor, the tokenizer), so the same reader handles both; all but the flow section are
CosyVoice2's (model_yaml.py) with CosyVoice3's classes and values. Only sizes change between
`tiny` and `full`; `full` carries the released values, `tiny` those of the CosyVoice3 golden set.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model_yaml import render


@dataclass(frozen=True)
class CosyVoice3Size:
    llm_size: int  # llm_input_size == llm_output_size == Qwen hidden size
    qwen_layers: int
    qwen_heads: int
    qwen_kv_heads: int
    qwen_intermediate: int
    lookahead_channels: int  # the flow's pre-lookahead layer
    dit_dim: int  # a multiple of 16 (the DiT's grouped position convolution)
    dit_depth: int
    dit_heads: int
    dit_head_dim: int
    hift_channels: int


COSYVOICE3_SIZES = {
    # The released Fun-CosyVoice3-0.5B-2512 dimensions.
    "full": CosyVoice3Size(llm_size=896, qwen_layers=24, qwen_heads=14, qwen_kv_heads=2, qwen_intermediate=4864,
                           lookahead_channels=1024, dit_dim=1024, dit_depth=22, dit_heads=16, dit_head_dim=64,
                           hift_channels=512),
    # Small enough for tests; the text embedding keeps the released 151936 rows (the LM looks for id 151646).
    "tiny": CosyVoice3Size(llm_size=32, qwen_layers=2, qwen_heads=4, qwen_kv_heads=2, qwen_intermediate=128,
                           lookahead_channels=64, dit_dim=64, dit_depth=2, dit_heads=4, dit_head_dim=16,
                           hift_channels=32),
}

_FLOW = """\
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {lookahead_channels}
        pre_lookahead_len: 3
{solver}        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit_dim}
            depth: {dit_depth}
            heads: {dit_heads}
            dim_head: {dit_head_dim}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

"""

SECTIONS = dict(export_flags=" --family cosyvoice3", family_title="CosyVoice3", llm_class="CosyVoice3LM",
                vocoder_class="CausalHiFTGenerator", vocoder_extra="    conv_pre_look_right: 4\n",
                f0_class="CausalConvRNNF0Predictor", fmax="null", tokenizer_extra="    version: cosyvoice3\n")


def render_cosyvoice3_yaml(size: CosyVoice3Size) -> str:
    return render(_FLOW, SECTIONS, size)
