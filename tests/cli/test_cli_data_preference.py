"""`ligertune data` on a preference recipe: the pairs (KTO: the examples) as the trainer builds them,
and `--show N`: each pair's prompt once, then the chosen and the rejected answer, scored tokens marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_recipe import QUICKSTART, TINY_MODEL
from typer.testing import CliRunner

from ligertune.cli.main import app

CHOSEN_TURNS = [  # a multi-turn answer: only its assistant turns are scored
    {"role": "assistant", "content": "tnalp"},
    {"role": "user", "content": "and backwards again?"},
    {"role": "assistant", "content": "plant"},
]


def bundled_pairs(name: str, n: int) -> list[dict]:
    with (QUICKSTART / name).open(encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.fixture()
def recipe(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.delenv("LIGERTUNE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps panels at the terminal width
    train = bundled_pairs("pairs_train.jsonl", 6)
    train[1] = {"prompt": [{"role": "user", "content": "reverse plant"}], "chosen": CHOSEN_TURNS,
                "rejected": "tanlp"}
    lines = [json.dumps(r) for r in train] + ['{"prompt": "hi"}']  # no answers: skipped
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    held_out = bundled_pairs("pairs_eval.jsonl", 3)
    (tmp_path / "held-out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out), encoding="utf-8")
    recipe = {
        "model": {"config": dict(TINY_MODEL), "tokenizer": str(QUICKSTART / "tokenizer")},
        "objective": {"name": "dpo"},
        "data": {"path": "pairs.jsonl", "eval_path": "held-out.jsonl", "format": "paired", "max_seq_len": 256,
                 "on_bad_record": "skip"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def run(*args):
    return CliRunner().invoke(app, ["data", *map(str, args)])


def joined(part: dict, scored: bool | None = None) -> str:
    return "".join(s["text"] for s in part["segments"] if scored is None or s["scored"] == scored)


def test_json_counts_the_pairs_and_packs_them(recipe: Path):
    result = run(recipe, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    data = report["data"]
    assert (data["records"], data["bad_records"], data["kept"]) == (7, 1, 6)
    assert (data["train_pairs"], data["eval_pairs"]) == (6, 3)
    assert report["packing"]["conversations"] == 6  # units in packs: every kept pair
    assert report["packing"]["real_tokens"] == data["total_tokens"]
    (warning,) = report["warnings"]
    assert warning.startswith("data.on_bad_record: skipped 1 malformed record of ") and "pairs.jsonl:7" in warning
    assert "pairs" not in report  # only with --show


def test_show_gives_the_prompt_once_then_each_answer_with_its_scored_tokens(recipe: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))
    report = json.loads(run(recipe, "--json", "--show", "2").stdout)
    first, multi_turn = report["pairs"]
    assert first["origin"].endswith("pairs.jsonl:1") and multi_turn["origin"].endswith("pairs.jsonl:2")
    assert [p["name"] for p in first["parts"]] == ["prompt", "chosen", "rejected"]
    prompt, chosen, rejected = first["parts"]
    record = bundled_pairs("pairs_train.jsonl", 1)[0]
    # The prompt once, ending where the answers start; nothing of it scored.
    assert prompt["scored"] == 0 and joined(prompt, scored=True) == ""
    assert joined(prompt) == tokenizer.apply_chat_template(record["prompt"], tokenize=False,
                                                           add_generation_prompt=True)
    # Each answer continues that prompt as its own conversation would; its content and end of turn scored.
    for part, side in ((chosen, "chosen"), (rejected, "rejected")):
        whole = tokenizer.apply_chat_template(record["prompt"] + record[side], tokenize=False)
        assert joined(prompt) + joined(part) == whole
        assert joined(part, scored=True) == record[side][0]["content"] + "<|im_end|>"
        assert part["tokens"] == len(tokenizer.encode(joined(part), add_special_tokens=False))
        assert part["scored"] == len(tokenizer.encode(joined(part, scored=True), add_special_tokens=False))
    # A multi-turn answer: the user turn inside it is shown, not scored.
    _, chosen, rejected = multi_turn["parts"]
    assert [s["text"] for s in chosen["segments"] if s["scored"]] == ["tnalp<|im_end|>", "plant<|im_end|>"]
    assert "<|im_start|>user\nand backwards again?<|im_end|>" in joined(chosen, scored=False)
    assert joined(rejected, scored=True) == "tanlp<|im_end|>"


def test_show_prints_panels_and_tables_in_pair_terms(recipe: Path):
    result = run(recipe, "--show", "1")
    assert result.exit_code == 0, result.output
    out = result.stdout
    record = bundled_pairs("pairs_train.jsonl", 1)[0]
    for text in ("pairs.jsonl:1", "prompt (", "chosen (3 tokens, 2 scored)", "rejected (",
                 record["prompt"][-1]["content"], "Preference data (pairs)", "train pairs", "eval pairs",
                 "scored / total tokens", "Packing", "Pair lengths (tokens)", "warning data.on_bad_record"):
        assert text in out, text
    assert out.index("prompt (") < out.index("chosen (") < out.index("rejected (")
    assert "pairs.jsonl:2" not in out


def test_kto_examples_show_their_completion_its_label_and_the_mismatched_one(recipe: Path, tmp_path: Path):
    records = [{"prompt": "reverse plant", "completion": "tnalp", "label": True},
               {"prompt": "reverse plant", "completion": "tanlp", "label": False}]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    result = run(recipe, "--json", "--show", "2", "--set", "objective.name=kto", "--set", "data.path=kto.jsonl",
                 "--set", "data.format=unpaired", "--set", "data.eval_path=null", "--set", "data.eval_fraction=0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["data"]["train_examples"] == 2
    shown = [[(p["name"], joined(p, scored=True)) for p in example["parts"]] for example in report["examples"]]
    # Each with the other's completion, scored for the KL estimate z0 (never trained).
    assert shown == [
        [("prompt", ""), ("desirable completion", "tnalp<|im_end|>"), ("mismatched completion", "tanlp<|im_end|>")],
        [("prompt", ""), ("undesirable completion", "tanlp<|im_end|>"), ("mismatched completion", "tnalp<|im_end|>")],
    ]


def test_order_is_refused_in_one_line(recipe: Path):
    result = run(recipe, "--order")
    assert result.exit_code == 2
    assert "--order:" in result.stderr and "preference data" in result.stderr
    assert "Traceback" not in result.output
