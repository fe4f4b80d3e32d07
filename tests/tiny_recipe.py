"""A tiny, fast recipe on the bundled quick-start tokenizer and data, for end-to-end tests."""

from __future__ import annotations

import itertools
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart"

TINY_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def write_recipe(folder: Path, n_train: int = 48, n_eval: int = 8, **sections) -> Path:
    """A recipe for a tiny model on the first conversations of the quick-start data, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", n_train), ("eval", n_eval)):
        with (QUICKSTART / f"{name}.jsonl").open(encoding="utf-8") as src:
            (folder / f"{name}.jsonl").write_text("".join(itertools.islice(src, count)), encoding="utf-8")
    recipe = {
        "model": {"config": dict(TINY_MODEL), "tokenizer": str(QUICKSTART / "tokenizer")},
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl", "max_seq_len": 256, "cache_dir": None},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "eval_every": 3},
        "output": {"dir": str(folder / "run")},
    }
    for section, values in sections.items():
        if values is None:
            recipe[section] = None
        else:
            recipe.setdefault(section, {}).update(values)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random llama and the quick-start tokenizer in `folder`, as a run leaves its `final/`:
    a stand-in for the quick start's model, for a recipe that starts from it (quickstart-dpo)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))
    config = AutoConfig.for_model(**TINY_MODEL, vocab_size=len(tokenizer), tie_word_embeddings=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
