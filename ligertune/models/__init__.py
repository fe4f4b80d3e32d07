"""Models: loading and building, kernel patching, packed attention, and the loss head.

    tokenizer = load_tokenizer(recipe.model)
    model = build_model(recipe.model, device=device, dtype="auto", seed=0, vocab_size=len(tokenizer))
    report = patch_model(model)                      # RMSNorm / RoPE / SwiGLU -> ligertune.kernels
    head = CausalLMLoss(model, fused=True)           # decoder -> fused linear cross-entropy
    out = head(input_ids, position_ids, targets, weights, cu_seqlens=cu, max_seqlen=m)
"""

from __future__ import annotations

from ligertune.models.attention import (
    PACKED_ATTENTION,
    packed_attention_forward,
    packed_attention_kwargs,
    packed_attention_mask,
    register_packed_attention,
)
from ligertune.models.head import CausalLMLoss, causal_lm_loss_from_logits
from ligertune.models.loading import (
    attn_implementation,
    build_config,
    build_model,
    check_model,
    load_tokenizer,
)
from ligertune.models.patching import (
    PATCH_TABLE,
    PatchReport,
    PatchSpec,
    is_patched,
    patch_model,
    unpatch_model,
)
from ligertune.models.presets import PRESETS
from ligertune.models.unwrap import decoder_of, output_head_of, unwrap_model

__all__ = [
    "PACKED_ATTENTION",
    "PATCH_TABLE",
    "PRESETS",
    "CausalLMLoss",
    "PatchReport",
    "PatchSpec",
    "attn_implementation",
    "build_config",
    "build_model",
    "causal_lm_loss_from_logits",
    "check_model",
    "decoder_of",
    "is_patched",
    "load_tokenizer",
    "output_head_of",
    "packed_attention_forward",
    "packed_attention_kwargs",
    "packed_attention_mask",
    "patch_model",
    "register_packed_attention",
    "unpatch_model",
    "unwrap_model",
]
