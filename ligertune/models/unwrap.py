"""Find the `transformers` model inside a wrapper (peft), and its decoder and output projection."""

from __future__ import annotations

import sys

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The `transformers` causal LM inside `model`: itself, or the base model of a peft wrapper.

    peft's LoRA injects its adapters into the base model's own modules, so the base model found here
    runs with the adapters; only the outer wrapper is skipped.
    """
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    if callable(get_base):
        return get_base()
    # A tuner (LoraModel) used without PeftModel. Only a process that imported peft can hold one, and
    # importing it here would cost every other run seconds.
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is not None and isinstance(model, tuners.BaseTuner):
        return model.model
    return model


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (e.g. `LlamaModel` inside `LlamaForCausalLM`): it returns the
    last hidden states, after the final norm, without the output projection."""
    base = unwrap_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or decoder is base:
        prefix = getattr(base, "base_model_prefix", "model")
        decoder = getattr(base, prefix, None)
    if not isinstance(decoder, nn.Module) or decoder is base:
        raise TypeError(f"cannot find the decoder inside {type(base).__name__}")
    return decoder


def output_head_of(model: nn.Module) -> nn.Module:
    """The output projection module (`lm_head`), possibly wrapped by peft."""
    head = unwrap_model(model).get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(unwrap_model(model)).__name__} has no output projection")
    return head


def plain_projection(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) when `head` computes exactly `x @ weight.T + bias`, else None.

    A plain `nn.Linear` qualifies, and so does peft's `ModulesToSaveWrapper` (a trained copy of the
    layer), through the copy that is active. A LoRA-adapted head does not: its product is not one
    weight matrix, so the caller must run the module itself.
    """
    if type(head) is nn.Linear:
        return head.weight, head.bias
    copies = getattr(head, "modules_to_save", None)  # peft.utils.ModulesToSaveWrapper
    if isinstance(copies, nn.ModuleDict):
        # Mirrors the wrapper's own forward: the first active copy, or the original when none is active.
        active = [] if head.disable_adapters else list(head.active_adapters)
        return plain_projection(copies[active[0]] if active else head.original_module)
    return None
