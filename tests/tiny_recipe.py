"""Tiny, fast recipes on the bundled quick-start tokenizer and data, for end-to-end tests: supervised
fine-tuning (`write_recipe`), preference pairs and KTO examples (`write_preference_recipe`), Medusa
heads (`write_medusa_recipe`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import yaml

from ligertune.metrics import read_metrics

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
        "output": {"dir": str(folder / "run"), "plot": False},  # tests that plot say so
    }
    for section, values in sections.items():
        if values is None:
            recipe[section] = None
        else:
            recipe.setdefault(section, {}).update(values)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path

# A distillation student, smaller than TINY_MODEL's teacher.
STUDENT = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}


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


def paired_records(n: int, offset: int = 0) -> list[dict]:
    """`n` pairs from the quick-start conversations from `offset` on: the prompt is every message but
    the last, the chosen answer the last (the real one), the rejected one the last answer of the next
    conversation with a different one."""
    with (QUICKSTART / "train.jsonl").open(encoding="utf-8") as f:
        conversations = [json.loads(line)["messages"] for line in itertools.islice(f, offset, offset + 2 * n + 8)]
    records = []
    for i, messages in enumerate(conversations[:n]):
        chosen = messages[-1]["content"]
        rejected = next(c[-1]["content"] for c in conversations[i + 1:] if c[-1]["content"] != chosen)
        records.append({"prompt": messages[:-1], "chosen": chosen, "rejected": rejected})
    return records


def unpaired_records(n: int, offset: int = 0) -> list[dict]:
    """`n` KTO records: the pairs' prompts, each with its chosen answer (desirable) for even records
    and its rejected one (undesirable) for odd ones."""
    return [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 == 0 else r["rejected"],
             "label": i % 2 == 0} for i, r in enumerate(paired_records(n, offset))]


def write_preference_recipe(folder: Path, n_train: int = 32, n_eval: int = 8, make_records=paired_records,
                            **sections) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, records in (("train", make_records(n_train)), ("eval", make_records(n_eval, offset=1000))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    recipe = {
        "model": {"config": dict(TINY_MODEL), "tokenizer": str(QUICKSTART / "tokenizer"), "dtype": "float32"},
        "objective": {"name": "dpo"},
        "data": {"path": "train.jsonl", "eval_path": "eval.jsonl", "format": "paired", "max_seq_len": 256,
                 "cache_dir": None},
        "optim": {"lr": 3e-3, "warmup_steps": 0},
        "train": {"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "eval_every": None,
                  "eval_at_start": False},
        "output": {"dir": str(folder / "run"), "plot": False},  # tests that plot say so
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def write_medusa_recipe(folder: Path, *, objective: dict | None = None, base: Path | None = None, **sections) -> Path:
    """Medusa heads over a tiny model saved in `folder/base` (as the quick start leaves its final/)."""
    base = base or save_tiny_model(folder / "base", seed=3)
    sections.setdefault("model", {"name_or_path": str(base), "config": None, "tokenizer": None})
    return write_recipe(folder, objective={"name": "medusa", "heads": 3, **(objective or {})}, **sections)


def write_distill_recipe(folder: Path, *, teacher: Path | None = None, objective: dict | None = None,
                         **sections) -> Path:
    """A tiny student (smaller than the teacher: hidden 16 against 32) distilled from a tiny random
    teacher saved in `folder/teacher`, on the first quick-start conversations."""
    if teacher is None:
        teacher = save_tiny_model(folder / "teacher", seed=1)
    sections.setdefault("model", {"config": dict(STUDENT)})
    return write_recipe(folder, objective={"name": "distill", "teacher": str(teacher), **(objective or {})},
                        **sections)
