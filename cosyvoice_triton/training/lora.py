"""LoRA adapters (peft) on the attention and feed-forward projections, merged back before saving.

`add_lora` injects adapters in place and leaves only them trainable; `merge_lora` folds each adapter into
its base weight and puts the plain layer back, so the state dict has exactly the released keys again.
"""
from __future__ import annotations

from dataclasses import dataclass

from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

# Qwen2 backbone of the LLM
LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# flow, attention and feed-forward of each family's modules (a name missing in one flow is passed over):
# CosyVoice2's conformer encoder and UNet estimator, CosyVoice3's DiT (attention to_*, feed-forward ff.ff.*)
FLOW_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_out", "w_1", "w_2",
                "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "ff.ff.0.0", "ff.ff.2")


@dataclass(frozen=True)
class LoraOptions:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0


def add_lora(module: nn.Module, targets: tuple[str, ...], options: LoraOptions) -> nn.Module:
    """Adapters on every nn.Linear whose name ends with one of `targets`; everything else frozen."""
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
                        target_modules=list(targets), bias="none")
    inject_adapter_in_model(config, module)
    for name, parameter in module.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return module


def merge_lora(module: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights and replace each LoRA layer by its base layer (in place)."""
    for name, child in list(module.named_modules()):
        if isinstance(child, LoraLayer):
            child.merge()
            parent_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attr, child.get_base_layer())
    return module
