"""Tiny models of every supported family, built from a config (no downloads), and a packed batch.

Every family gets hidden 64, 2 layers, 4 query heads over 2 key/value heads, vocabulary 128. The
sliding-window families get a window of 4, shorter than the conversations below, so that the window
is exercised inside each conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ligertune.models import build_model
from ligertune.recipe import ModelConfig

VOCAB = 128

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

_GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4}
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special token ids inside the tiny vocabulary, for the families whose defaults lie beyond it."""

FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama", **_BASE},
    "mistral": {"model_type": "mistral", **_BASE, "sliding_window": 4},
    "qwen2": {"model_type": "qwen2", **_BASE},
    "qwen3": {"model_type": "qwen3", **_BASE, "head_dim": 16},
    "gemma": {"model_type": "gemma", **_BASE, "head_dim": 16},
    "gemma2": {"model_type": "gemma2", **_BASE, **_GEMMA},
    "gemma3": {"model_type": "gemma3_text", **_BASE, **_GEMMA},
    "smollm3": {"model_type": "smollm3", **_BASE, "no_rope_layer_interval": 2, **_TOKENS},  # layer 2: no RoPE
    # Norms after the attention and the MLP, and over q and k; OLMo 3's layers all sliding-window.
    "olmo2": {"model_type": "olmo2", **_BASE, **_TOKENS},
    "olmo3": {"model_type": "olmo3", **_BASE, "sliding_window": 4, **_TOKENS},
    # One joined gate_up_proj (and qkv_proj); half of each head rotated.
    "phi3": {"model_type": "phi3", **_BASE, **_TOKENS,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
}
"""Family id -> config fields of its tiny model."""

GEGLU_FAMILIES = ("gemma", "gemma2", "gemma3")
"""The families whose MLPs are GeGLU (tanh GELU); the others' are SwiGLU."""


def make_model(family: str, *, attention: str = "packed", seed: int = 0, dtype=torch.float32, **fields):
    """The tiny model of `family` (fp32, CPU), weights drawn under `seed`."""
    config = {**FAMILIES[family], **fields}
    return build_model(ModelConfig(config=config, attention=attention), device="cpu", dtype=dtype, seed=seed)


@dataclass
class PackedBatch:
    """Conversations of odd lengths packed in one row, positions restarting at 0 for each."""

    lengths: list[int]
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    targets: torch.Tensor  # [1, T], -100 at the last token of each conversation and at prompt tokens
    cu_seqlens: torch.Tensor  # [len(lengths) + 1], int32

    def pieces(self):
        """(start, end) of every conversation in the row."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))


def make_packed_batch(lengths: list[int], seed: int = 0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    input_ids = torch.randint(0, VOCAB, (1, total), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    targets = torch.full((1, total), -100)
    start = 0
    for n in lengths:
        # Shifted inside the conversation; the first two tokens play the prompt (no loss).
        targets[0, start + 2 : start + n - 1] = input_ids[0, start + 3 : start + n]
        start += n
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(lengths, input_ids, position_ids, targets, cu)


