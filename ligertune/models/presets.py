"""Model shapes to build with random weights: `model.config: <preset name>` in a recipe.

A preset is only a set of `transformers` config fields (with `model_type`); no weights are involved.
The `tiny-*` presets are for tests and the quick start (they run on a laptop CPU); they leave out
`vocab_size`, which then comes from the tokenizer. The others copy the shapes of published models,
so that speed and memory can be measured at real sizes without downloading anything.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _frozen(fields: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(fields)


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # ---- tiny, for tests and the quick start (vocab_size from the tokenizer)
    "tiny-llama": _frozen({"model_type": "llama", **_TINY}),
    "tiny-mistral": _frozen({"model_type": "mistral", **_TINY, "sliding_window": None}),
    "tiny-qwen2": _frozen({"model_type": "qwen2", **_TINY}),
    "tiny-qwen3": _frozen({"model_type": "qwen3", **_TINY, "head_dim": 16}),
    "tiny-gemma": _frozen({"model_type": "gemma", **_TINY, "head_dim": 16}),
    # ---- shapes of published models (random weights)
    "llama-3.2-1b": _frozen({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0},
    }),
    "llama-3.2-3b": _frozen({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0},
    }),
    "llama-3.1-8b": _frozen({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0},
    }),
    "mistral-7b": _frozen({
        "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen2.5-0.5b": _frozen({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen2.5-7b": _frozen({
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen3-0.6b": _frozen({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen3-8b": _frozen({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
})
"""Preset name -> config fields (read-only). `build_model` copies them before use."""


def preset_fields(name: str) -> dict[str, Any]:
    """A deep, mutable copy of a preset's fields (KeyError for an unknown name)."""
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in PRESETS[name].items()}
