"""Several preference sources: each in its own format, weighted like conversations, counted apart."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tiny_recipe import paired_records, write_preference_recipe

from ligertune.errors import UserError
from ligertune.models import load_tokenizer
from ligertune.recipe import load_recipe
from ligertune.training.build import build_preference_data


def as_conversations(record: dict) -> dict:
    """The same pair as TRL's whole conversations sharing their prompt."""
    prompt = record["prompt"]
    return {"chosen": [*prompt, {"role": "assistant", "content": record["chosen"]}],
            "rejected": [*prompt, {"role": "assistant", "content": record["rejected"]}]}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def build(recipe_path: Path, *overrides: str):
    recipe = load_recipe(recipe_path, ["data.eval_path=null", *overrides])
    return build_preference_data(recipe, load_tokenizer(recipe.model))


def test_two_sources_in_their_formats_take_their_weighted_shares(tmp_path: Path):
    write_jsonl(tmp_path / "a.jsonl", paired_records(8))
    write_jsonl(tmp_path / "b.jsonl", [as_conversations(r) for r in paired_records(8, offset=200)])
    path = write_preference_recipe(tmp_path)
    sources = [{"path": str(tmp_path / "a.jsonl"), "format": "paired", "weight": 3},
               {"path": str(tmp_path / "b.jsonl"), "format": "paired_conversations", "weight": 1}]
    data = build(path, "data.path=null", "data.format=auto", f"data.sources={json.dumps(sources)}")
    assert Counter(u.source for u in data.prepared.train) == {0: 12, 1: 4}
    assert data.prepared.stats.records == 16 and data.prepared.stats.kept == 16
    assert sum(p.num_answers for p in data.train_packs) == 2 * 16
    # The same pair read from either layout is the same unit.
    alone = build(path, f"data.path={tmp_path / 'b.jsonl'}", "data.format=paired_conversations")
    first = build(path, f"data.path={tmp_path / 'a.jsonl'}", "data.format=paired")
    assert {tuple(u.input_ids) for u in alone.prepared.train}.isdisjoint({tuple(u.input_ids) for u in first.prepared.train})
    assert [u.input_ids for u in build(path, f"data.path={tmp_path / 'a.jsonl'}").prepared.train] == \
        [u.input_ids for u in first.prepared.train]


def test_a_source_of_chat_data_is_refused_naming_its_file(tmp_path: Path):
    write_jsonl(tmp_path / "a.jsonl", paired_records(4))
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "hello"}]}] * 4)
    path = write_preference_recipe(tmp_path)
    sources = [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "chat.jsonl")}]
    with pytest.raises(UserError, match=r"chat\.jsonl:1: cannot tell the preference format.*chat data"):
        build(path, "data.path=null", "data.format=auto", f"data.sources={json.dumps(sources)}")


@pytest.mark.parametrize("layout", ["jsonl", "minified json"])
@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_the_held_out_share_is_drawn_by_record(tmp_path: Path, objective: str, layout: str):
    """`data.eval_fraction` holds out whole records: under KTO a pair gives two examples, and both
    land on the same side, so no held-out prompt is trained on with its other answer. Records of a
    JSON array on one line are records of their own."""
    path = write_preference_recipe(tmp_path, n_train=20)
    if layout == "minified json":
        records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
        (tmp_path / "train.json").write_text(json.dumps(records), encoding="utf-8")
    data = build(path, f"objective.name={objective}", "data.eval_fraction=0.25",
                 f"data.path={tmp_path / ('train.json' if layout == 'minified json' else 'train.jsonl')}")
    train, held = data.prepared.train, data.prepared.eval
    per_record = 2 if objective == "kto" else 1
    assert len(held) == 5 * per_record and len(train) == 15 * per_record
    assert {u.origin for u in train}.isdisjoint({u.origin for u in held})
    assert all(n == per_record for n in Counter(u.origin for u in [*train, *held]).values())


def test_records_of_one_unit_split_as_the_units_alone():
    import random

    from ligertune.data.prepare import hold_out

    class Unit:
        def __init__(self, origin: str):
            self.origin = origin

    units = [Unit(f"train.jsonl:{i}") for i in range(1, 41)]
    alone = hold_out(units, 0.2, random.Random("seed"))
    assert hold_out(units, 0.2, random.Random("seed"), record=lambda unit: unit.origin) == alone
