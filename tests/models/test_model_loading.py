"""Tokenizer and model loading: presets, config mappings, pretrained directories, and the errors."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ligertune.devices import resolve_dtype
from ligertune.errors import UserError
from ligertune.models import (
    PACKED_ATTENTION,
    PRESETS,
    build_config,
    build_model,
    load_tokenizer,
)
from ligertune.recipe import ModelConfig

# Parameter counts published with each model (embeddings counted once when tied).
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
}


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level chat tokenizer of 40 entries saved as a local directory."""
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(37)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_full_size_presets_have_the_published_shapes(name):
    config = build_config(name)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


def test_every_preset_is_covered():
    assert set(PRESETS) == set(PUBLISHED_PARAMETERS) | {n for n in PRESETS if n.startswith("tiny-")}


def test_build_from_preset_takes_the_tokenizer_vocabulary(tokenizer_dir):
    cfg = ModelConfig(config="tiny-llama", tokenizer=str(tokenizer_dir))
    tokenizer = load_tokenizer(cfg)
    assert len(tokenizer) == 40
    model = build_model(cfg, device="cpu", vocab_size=len(tokenizer))
    assert model.config.model_type == "llama"
    assert model.get_input_embeddings().weight.shape == (40, 64)
    assert model.config._attn_implementation == PACKED_ATTENTION
    assert next(model.parameters()).dtype == torch.float32  # auto on a CPU


def test_build_from_mapping_with_dtype_and_attention():
    cfg = ModelConfig(config={"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48,
                              "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                              "head_dim": 16, "vocab_size": 50}, dtype="bfloat16", attention="sdpa")
    model = build_model(cfg, device="cpu", vocab_size=30)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert len(model.model.layers) == 3
    assert model.config.vocab_size == 50  # the declared vocabulary is larger than the tokenizer's
    assert model.config._attn_implementation == "sdpa"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_init_is_seeded_and_leaves_the_global_random_state_alone():
    cfg = ModelConfig(config="tiny-qwen2")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_model(cfg, device="cpu", seed=7, vocab_size=64).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    b = build_model(cfg, device="cpu", seed=7, vocab_size=64).state_dict()
    c = build_model(cfg, device="cpu", seed=8, vocab_size=64).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_pretrained_directory_round_trip(tmp_path):
    saved = build_model(ModelConfig(config="tiny-mistral"), device="cpu", vocab_size=48, seed=3)
    saved.save_pretrained(tmp_path / "model")
    loaded = build_model(ModelConfig(name_or_path=str(tmp_path / "model")), device="cpu", dtype="float32")
    assert loaded.config._attn_implementation == PACKED_ATTENTION
    for (name, p), (_, q) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), name
    # A tokenizer with more entries than the embedding grows it.
    grown = build_model(ModelConfig(name_or_path=str(tmp_path / "model"), attention="eager"), device="cpu",
                        vocab_size=56)
    assert grown.get_input_embeddings().weight.shape[0] == 56
    assert grown.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param("tiny-lama", "unknown preset 'tiny-lama'; did you mean `tiny-llama`?", id="preset-typo"),
        pytest.param({"model_type": "llama", "hidnen_size": 8, "vocab_size": 10},
                     "model.config.hidnen_size: unknown field for model type 'llama'; "
                     "did you mean `hidden_size`?",
                     id="field-typo"),
        pytest.param({"model_type": "no-such-model", "vocab_size": 10}, "unknown model type 'no-such-model'",
                     id="model-type"),
        pytest.param({"model_type": "llama"}, "no `vocab_size`", id="no-vocab"),
    ],
)
def test_config_mistakes_are_user_errors(spec, message):
    with pytest.raises(UserError) as err:
        build_config(spec)
    assert message in str(err.value)


def test_missing_paths_are_user_errors_without_asking_the_hub(tmp_path):
    missing = tmp_path / "no" / "such-tokenizer"
    with pytest.raises(UserError, match=f"model.tokenizer: no such folder: {missing}"):
        load_tokenizer(ModelConfig(config="tiny-llama", tokenizer=str(missing)))
    with pytest.raises(UserError, match=f"model.name_or_path: no such folder: {missing}"):
        build_model(ModelConfig(name_or_path=str(missing)), device="cpu")
    with pytest.raises(UserError, match="needs a tokenizer"):
        load_tokenizer(ModelConfig(config="tiny-llama"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=f"cannot load a tokenizer from '{empty}'"):
        load_tokenizer(ModelConfig(name_or_path=str(empty)))


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(UserError, match="model.dtype"):
        resolve_dtype("fp8", "cpu")
