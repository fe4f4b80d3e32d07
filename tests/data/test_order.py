"""The step order: the stratified shuffle, its bounds, and the mixing report against its definitions."""

from __future__ import annotations

import json
import math
import random

import pytest
from chat_fixtures import conversation, write_jsonl
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.data import IGNORE_INDEX, Pack, order_report, pack, prepare_data, shuffled
from ligertune.data.order import spread
from ligertune.models import load_tokenizer
from ligertune.recipe import load_recipe
from ligertune.training.build import packs_per_step
from ligertune.training.state import PackStream, RunState, first_epoch_steps

_ = IGNORE_INDEX


def one_source_packs(n: int, source: int, length: int = 10, start: int = 0) -> list[Pack]:
    """`n` packs of one conversation each from `source`, every token trained but the last."""
    return [Pack([1] * length, [1] * (length - 1) + [_], [length], [start + i], [source]) for i in range(n)]


# --------------------------------------------------------------------------------------------------
# the order


@pytest.mark.parametrize("n_groups", [2, 3, 5])
def test_spread_keeps_every_group_near_its_share_in_every_window(n_groups):
    """In any window of w consecutive items a group of share p has w p items to within 1 + G p."""
    for seed in range(20):
        rng = random.Random(seed)
        sizes = [rng.randint(1, 40) for _ in range(n_groups)]
        merged = spread([[g] * n for g, n in enumerate(sizes)], random.Random(seed + 100))
        total = len(merged)
        assert sorted(merged) == [g for g, n in enumerate(sizes) for _ in range(n)]
        for g, n in enumerate(sizes):
            prefix = [0]
            for item in merged:
                prefix.append(prefix[-1] + (item == g))
            worst = max(abs(prefix[a + w] - prefix[a] - w * n / total)
                        for w in range(1, total + 1) for a in range(total - w + 1))
            assert worst < 1 + n_groups * n / total, (seed, sizes, g)


def test_shuffled_is_a_permutation_fixed_by_seed_and_epoch():
    packs = one_source_packs(30, 0) + one_source_packs(20, 1, length=40, start=30)
    ids = lambda ps: [p.example_indices[0] for p in ps]
    first = ids(shuffled(packs, seed=3, epoch=0))
    assert sorted(first) == list(range(50))
    assert ids(shuffled(list(packs), seed=3, epoch=0)) == first
    assert ids(shuffled(packs, seed=3, epoch=1)) != first
    assert ids(shuffled(packs, seed=4, epoch=0)) != first


def test_every_step_of_two_even_sources_holds_both_where_a_plain_shuffle_does_not():
    """Two sources of 40 single-source packs, 4 packs a step: 1 to 3 of each in every step, every
    epoch (a plain shuffle gives an all-one-source step one time in 8)."""
    packs = one_source_packs(40, 0) + one_source_packs(40, 1, start=40)
    plain_single = 0
    for seed in range(5):
        for epoch in range(4):
            order = shuffled(packs, seed=seed, epoch=epoch)
            for i in range(0, len(order), 4):
                assert 1 <= sum(p.sources[0] for p in order[i : i + 4]) <= 3, (seed, epoch, i)
            plain = list(packs)
            random.Random(f"{seed}:{epoch}").shuffle(plain)
            plain_single += sum(sum(p.sources[0] for p in plain[i : i + 4]) in (0, 4) for i in range(0, 80, 4))
    assert plain_single > 0


def test_length_classes_are_spread_within_a_source():
    """One source, lengths 1..64: each window of 4 packs takes about one from each quartile."""
    packs = [Pack([1] * n, [1] * n, [n], [n], [0]) for n in range(1, 65)]
    order = shuffled(packs, seed=0, epoch=0)
    for i in range(0, 64, 4):
        quartiles = sorted((len(p) - 1) // 16 for p in order[i : i + 4])
        assert len(set(quartiles)) >= 3, quartiles  # a random window of 4 has all four 9% of the time


def test_first_epoch_steps_are_the_steps_a_run_takes():
    packs = one_source_packs(10, 0) + one_source_packs(7, 1, start=10)
    steps = first_epoch_steps(packs, seed=5, per_step=4)
    stream = shuffled(packs, seed=5, epoch=0) + shuffled(packs, seed=5, epoch=1)
    assert [[id(p) for p in s] for s in steps] == [[id(p) for p in stream[i : i + 4]] for i in range(0, 20, 4)]
    state, taken = RunState(), PackStream(packs, 5)
    assert [[id(p) for p in taken.take(state, 4)] for _ in steps] == [[id(p) for p in s] for s in steps]


# --------------------------------------------------------------------------------------------------
# the report


def test_report_figures_follow_their_definitions():
    """Two sources, steps laid out by hand, every figure recomputed here from its definition."""
    a = [Pack([1] * 6, [1, _, 1, 1, 1, _], [2, 4], [0, 1], [0, 1]),  # trained: source 0: 1, source 1: 3
         Pack([1] * 5, [1, 1, 1, 1, _], [5], [2], [1])]  # source 1: 4
    b = [Pack([1] * 8, [1, 1, _, 1, 1, 1, 1, _], [3, 5], [3, 4], [0, 0]),  # source 0: 2 + 4
         Pack([1] * 3, [1, 1, _], [3], [5], [1])]  # source 1: 2
    packs = a + b
    steps = [[a[0], b[0]], [a[1], b[1]], [b[0], a[0]], [b[1], a[1]]]
    report = order_report(packs, steps, source_names=["x", "y"], draws=8)

    trained = {id(a[0]): (1, 3), id(a[1]): (0, 4), id(b[0]): (6, 0), id(b[1]): (0, 2)}
    whole = [sum(trained[id(p)][s] for p in packs) for s in (0, 1)]
    p = [w / sum(whole) for w in whole]
    shares, lengths = [], []
    for step in steps:
        t = [sum(trained[id(x)][s] for x in step) for s in (0, 1)]
        shares.append([v / sum(t) for v in t])
        lengths.append(sum(sum(x.seq_lens) for x in step) / sum(len(x.seq_lens) for x in step))
    mean_len = sum(sum(x.seq_lens) for x in packs) / sum(len(x.seq_lens) for x in packs)
    tv = [0.5 * sum(abs(q[s] - p[s]) for s in (0, 1)) for q in shares]
    m = sum(lengths) / 4
    r1 = sum((lengths[t] - m) * (lengths[t + 1] - m) for t in range(3)) / sum((v - m) ** 2 for v in lengths)

    assert [s.share for s in report.sources] == pytest.approx(p)
    assert [s.name for s in report.sources] == ["x", "y"]
    assert report.sources[0].mean_deviation == pytest.approx(sum(abs(q[0] - p[0]) for q in shares) / 4)
    assert report.sources[1].max_deviation == pytest.approx(max(abs(q[1] - p[1]) for q in shares))
    assert report.source_deviation == pytest.approx(sum(tv) / 4)
    assert report.source_deviation_max == pytest.approx(max(tv))
    assert report.single_source_steps == sum(min(q) == 0 for q in shares) == 2
    assert report.mean_length == pytest.approx(mean_len)
    assert report.length_deviation == pytest.approx(sum(abs(v - mean_len) / mean_len for v in lengths) / 4)
    assert report.length_autocorrelation == pytest.approx(r1)
    assert (report.packs, report.packs_per_step, report.steps) == (4, 2, 4)
    assert [c.name for c in report.checks] == ["source deviation", "length deviation", "length persistence"]
    for check in report.checks:
        assert check.limit == pytest.approx(check.random_mean + 3 * check.random_std)
        assert check.passed == (check.value <= check.limit + 1e-9)


def test_one_source_and_few_steps_leave_out_the_checks_that_do_not_apply():
    packs = one_source_packs(6, 0)
    report = order_report(packs, [packs[:3], packs[3:]], source_names=["only"], draws=8)
    assert [c.name for c in report.checks] == ["length deviation"]
    assert report.length_autocorrelation is None
    assert report.single_source_steps == 0


# --------------------------------------------------------------------------------------------------
# a deliberately sorted two-source dataset, end to end


@pytest.fixture()
def sorted_recipe(tmp_path, tokenizer_factory, monkeypatch):
    """Two sources, each sorted by length: 72 one-exchange conversations and 36 of four to six
    exchanges with a system prompt; 2 x 2 packs a step."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LIGERTUNE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    tokenizer_factory("llama3").save_pretrained(tmp_path / "tokenizer")
    short = sorted((conversation(i) for i in range(72)), key=lambda r: len(json.dumps(r)))
    long = sorted((conversation(i, turns=4 + i % 3, system=True) for i in range(36)), key=lambda r: len(json.dumps(r)))
    write_jsonl(tmp_path / "short.jsonl", short)
    write_jsonl(tmp_path / "long.jsonl", long)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model:\n  config: {model_type: llama}\n  tokenizer: tokenizer\n"
        "data:\n  sources:\n    - {path: short.jsonl}\n    - {path: long.jsonl}\n"
        "  max_seq_len: 256\n  cache_dir: null\n  num_workers: 1\n"
        "train:\n  micro_batch_size: 2\n  grad_accum_steps: 2\n"
    )
    return path


def test_the_default_order_of_sorted_sources_passes(sorted_recipe):
    result = CliRunner().invoke(app, ["data", str(sorted_recipe), "--order", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["order"]
    assert report["passed"] is True
    assert report["packs_per_step"] == 4
    assert [s["name"].rsplit("/", 1)[-1] for s in report["sources"]] == ["short.jsonl", "long.jsonl"]
    assert report["steps"] == math.ceil(report["packs"] / 4)
    assert {c["name"] for c in report["checks"]} == {"source deviation", "length deviation", "length persistence"}
    # Better than chance where it is designed to be, not only within the limit.
    source = next(c for c in report["checks"] if c["name"] == "source deviation")
    assert source["value"] < source["random_mean"]
    assert report["single_source_steps"] == 0

    text = CliRunner().invoke(app, ["data", str(sorted_recipe), "--order", "--world-size", "2"])
    assert text.exit_code == 0, text.output
    assert "Step order: first epoch" in text.stdout and "of 8 packs" in text.stdout
    assert "order: mixed at least as well as a random order" in text.stdout


@pytest.mark.parametrize("packing", [False, True], ids=["data-order", "packing-order"])
def test_the_sorted_order_itself_fails(sorted_recipe, packing):
    """The same data taken in file order (one pack per conversation) or in best-fit order (packs by
    length): steps of one source and one length class, caught by the report."""
    recipe = load_recipe(sorted_recipe, [f"data.packing={str(packing).lower()}"])
    prepared = prepare_data(recipe.data, load_tokenizer(recipe.model), seed=recipe.train.seed, show_progress=False)
    packs = pack(prepared.train, recipe.data.max_seq_len, packing=packing)
    k = packs_per_step(recipe.train)
    in_order = [packs[i : i + k] for i in range(0, len(packs) - k + 1, k)]
    report = order_report(packs, in_order, source_names=["short", "long"], seed=recipe.train.seed)
    failed = {c.name for c in report.checks if not c.passed}
    assert not report.passed
    assert {"source deviation", "length persistence"} <= failed
    assert report.single_source_steps > report.random_single_source_steps

    default = order_report(packs, first_epoch_steps(packs, recipe.train.seed, k), source_names=["short", "long"],
                           seed=recipe.train.seed)
    assert default.passed


def test_prepare_data_tags_every_example_and_pack_with_its_source(sorted_recipe):
    recipe = load_recipe(sorted_recipe, [])
    prepared = prepare_data(recipe.data, load_tokenizer(recipe.model), seed=0, show_progress=False)
    assert [e.source for e in prepared.train] == [0] * 72 + [1] * 36
    assert all("long.jsonl:" in e.origin for e in prepared.train if e.source == 1)
    for p in pack(prepared.train, 256):
        assert p.sources == [prepared.train[i].source for i in p.example_indices]


def test_a_pack_without_sources_counts_as_source_zero():
    loose = [Pack([1] * 4, [1, 1, 1, _], [4]) for _ in range(8)]
    assert len(shuffled(loose, seed=0, epoch=0)) == 8
    report = order_report(loose, [loose[:4], loose[4:]], source_names=["data"], draws=4)
    assert [s.share for s in report.sources] == [1.0]
