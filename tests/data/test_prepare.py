"""prepare_data: length policy, dropping, sources with weights or samples, eval split, cache, workers."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from chat_fixtures import conversation, make_tokenizer, write_jsonl

from ligertune.data import prepare as prepare_module
from ligertune.data import prepare_data, read_conversations, tokenize_conversation
from ligertune.data.prepare import TokenizeSettings, make_pool, tokenize_conversations
from ligertune.data.stats import compact_count, counted
from ligertune.errors import DataError
from ligertune.recipe import DataConfig, DataSource


def config(path: Path | None = None, **kwargs) -> DataConfig:
    kwargs.setdefault("cache_dir", None)
    kwargs.setdefault("num_workers", 1)
    return DataConfig(path=str(path) if path else None, **kwargs)


def prepare(cfg: DataConfig, tokenizer, seed: int = 0):
    return prepare_data(cfg, tokenizer, seed=seed, show_progress=False)


def as_tuples(examples):
    return [(e.input_ids, e.labels, e.origin) for e in examples]


# --------------------------------------------------------------------------------------------------
# Length policy


@pytest.fixture()
def long_conversation(chatml):
    """Four exchanges, and a max_seq_len that fits the first two exchanges but not three."""
    messages = conversation(7, turns=4, system=True)["messages"]
    two = tokenize_conversation(chatml, messages[:5])
    three = tokenize_conversation(chatml, messages[:7])
    return messages, two, (len(two) + len(three)) // 2


def test_drop_turns_keeps_the_longest_prefix_that_fits(tmp_path, chatml, long_conversation):
    messages, two, max_seq_len = long_conversation
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": messages}])
    data = prepare(config(path, max_seq_len=max_seq_len, truncation="drop_turns"), chatml)
    assert as_tuples(data.train) == [(two.input_ids, two.labels, f"{path}:1")]
    assert data.stats.truncated == {"trailing_turns": 1}
    assert data.stats.turns_removed == 4
    assert data.stats.dropped == {}


def test_drop_drops_too_long_conversations(tmp_path, chatml, long_conversation):
    messages, two, max_seq_len = long_conversation
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": messages}, {"messages": messages[:5]}])
    data = prepare(config(path, max_seq_len=max_seq_len, truncation="drop"), chatml)
    assert as_tuples(data.train) == [(two.input_ids, two.labels, f"{path}:2")]
    assert data.stats.dropped == {"too_long": 1}
    assert data.stats.truncated == {}


def test_a_first_answer_too_long_is_dropped(tmp_path, chatml):
    messages = conversation(3, turns=2)["messages"]
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": messages}, short])
    max_seq_len = len(tokenize_conversation(chatml, short["messages"]))
    data = prepare(config(path, max_seq_len=max_seq_len, truncation="drop_turns"), chatml)
    assert [e.origin for e in data.train] == [f"{path}:2"]
    assert data.stats.dropped == {"too_long": 1}


def test_conversations_without_trained_tokens_are_dropped_and_counted(tmp_path, chatml):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}]},
        conversation(1),
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ])
    data = prepare(config(path), chatml)
    assert [e.origin for e in data.train] == [f"{path}:2"]
    assert data.stats.dropped == {"no_trained_tokens": 2}
    assert data.stats.trained_tokens == data.train[0].trained_tokens > 0
    assert data.stats.total_tokens == len(data.train[0])


# --------------------------------------------------------------------------------------------------
# Sources, eval


@pytest.fixture()
def two_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [conversation(100 + i) for i in range(30)])
    return a, b


def per_file(examples) -> Counter:
    return Counter(Path(e.origin.rsplit(":", 1)[0]).name for e in examples)


def test_source_weights(chatml, two_sources):
    a, b = two_sources
    cfg = config(sources=[DataSource(path=str(a), weight=3.0), DataSource(path=str(b), weight=1.0)])
    data = prepare(cfg, chatml, seed=0)
    # 40 conversations in all, shared 3:1 -> 30 from a (3 whole copies), 10 distinct ones from b.
    assert per_file(data.train) == {"a.jsonl": 30, "b.jsonl": 10}
    from_a = Counter(e.origin for e in data.train if "a.jsonl" in e.origin)
    assert from_a == {f"{a}:{i}": 3 for i in range(1, 11)}
    assert len({e.origin for e in data.train if "b.jsonl" in e.origin}) == 10
    assert [s.taken for s in data.stats.sources] == [30, 10]
    assert as_tuples(prepare(cfg, chatml, seed=0).train) == as_tuples(data.train)
    assert as_tuples(prepare(cfg, chatml, seed=1).train) != as_tuples(data.train)


def test_source_samples(chatml, two_sources):
    a, b = two_sources
    cfg = config(sources=[DataSource(path=str(a), samples=25), DataSource(path=str(b), samples=5)])
    data = prepare(cfg, chatml)
    assert per_file(data.train) == {"a.jsonl": 25, "b.jsonl": 5}
    counts = Counter(e.origin for e in data.train if "a.jsonl" in e.origin)
    assert sorted(counts.values()) == [2] * 5 + [3] * 5  # two whole copies, then 5 distinct ones again
    assert data.stats.train_conversations == 30


def test_a_source_with_nothing_usable_is_named(tmp_path, chatml, two_sources):
    a, _ = two_sources
    useless = write_jsonl(tmp_path / "useless.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    cfg = config(sources=[DataSource(path=str(a), samples=5), DataSource(path=str(useless), samples=5)])
    with pytest.raises(DataError, match=r"useless.jsonl: no usable conversation among its 1 record "
                                        r"\(no trained tokens: 1\)"):
        prepare(cfg, chatml)
    # Without weights or samples too, and for the held-out file, and for an empty file.
    with pytest.raises(DataError, match="useless.jsonl: no usable conversation"):
        prepare(config(sources=[DataSource(path=str(a)), DataSource(path=str(useless))]), chatml)
    with pytest.raises(DataError, match="useless.jsonl: no usable conversation"):
        prepare(config(a, eval_path=str(useless)), chatml)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl: no records \(the file is empty\)"):
        prepare(config(tmp_path / "empty.jsonl"), chatml)


def test_eval_fraction_is_a_deterministic_disjoint_split(chatml, two_sources):
    a, _ = two_sources
    data = prepare(config(a, eval_fraction=0.3), chatml, seed=0)
    assert (len(data.train), len(data.eval)) == (7, 3)
    origins = [e.origin for e in data.train + data.eval]
    assert sorted(origins) == sorted(f"{a}:{i}" for i in range(1, 11))
    assert as_tuples(prepare(config(a, eval_fraction=0.3), chatml, seed=0).eval) == as_tuples(data.eval)
    held_out = {tuple(e.origin for e in prepare(config(a, eval_fraction=0.3), chatml, seed=s).eval)
                for s in range(6)}
    assert len(held_out) > 1  # the seed decides which
    assert data.stats.eval_conversations == 3
    assert data.stats.eval_trained_tokens == sum(e.trained_tokens for e in data.eval)


def test_eval_path(chatml, two_sources):
    a, b = two_sources
    data = prepare(config(a, eval_path=str(b)), chatml)
    assert per_file(data.train) == {"a.jsonl": 10}
    assert per_file(data.eval) == {"b.jsonl": 30}
    assert data.stats.conversations_read == 40


# --------------------------------------------------------------------------------------------------
# Cache and workers


def test_second_run_hits_the_cache(tmp_path, chatml, two_sources, monkeypatch):
    a, _ = two_sources
    cfg = config(a, cache_dir=str(tmp_path / "cache"), eval_fraction=0.2)
    first = prepare(cfg, chatml)
    assert [s.cached for s in first.stats.sources] == [False]

    def no_reading(*args, **kwargs):
        raise AssertionError("a cache hit must not read the source again")

    with monkeypatch.context() as m:
        m.setattr(prepare_module, "read_conversations", no_reading)
        second = prepare(cfg, chatml)
    assert [s.cached for s in second.stats.sources] == [True]
    assert as_tuples(second.train) == as_tuples(first.train)
    assert as_tuples(second.eval) == as_tuples(first.eval)
    assert second.stats.trained_tokens == first.stats.trained_tokens
    files = os.listdir(tmp_path / "cache" / "tokenized")
    assert len(files) == 1 and files[0].endswith(".bin")  # no temporary file left behind


@pytest.mark.parametrize(
    "change",
    [pytest.param("file", id="data-file"), pytest.param("train_on", id="train_on"),
     pytest.param("max_seq_len", id="max_seq_len"), pytest.param("template", id="chat-template")],
)
def test_cache_misses_when_what_shapes_the_examples_changes(tmp_path, tokenizer_factory, change):
    path = write_jsonl(tmp_path / "train.jsonl", [conversation(i) for i in range(4)])
    tokenizer = make_tokenizer("chatml")  # a fresh one: this test changes its template
    cfg = config(path, cache_dir=str(tmp_path / "cache"))
    prepare(cfg, tokenizer)
    if change == "file":
        write_jsonl(path, [conversation(i) for i in range(5)])
    elif change == "train_on":
        cfg = config(path, cache_dir=str(tmp_path / "cache"), train_on="all")
    elif change == "max_seq_len":
        cfg = config(path, cache_dir=str(tmp_path / "cache"), max_seq_len=1024)
    else:
        tokenizer.chat_template = tokenizer_factory("llama3").chat_template
    again = prepare(cfg, tokenizer)
    assert [s.cached for s in again.stats.sources] == [False]
    assert prepare(cfg, tokenizer).stats.sources[0].cached


def test_corrupt_cache_is_rebuilt(tmp_path, chatml, two_sources):
    a, _ = two_sources
    cfg = config(a, cache_dir=str(tmp_path / "cache"))
    first = prepare(cfg, chatml)
    (file,) = (tmp_path / "cache" / "tokenized").iterdir()
    file.write_bytes(file.read_bytes()[:-7])
    again = prepare(cfg, chatml)
    assert not again.stats.sources[0].cached
    assert as_tuples(again.train) == as_tuples(first.train)


def test_worker_processes_give_the_same_outcomes(tmp_path, tokenizer_factory):
    tokenizer = tokenizer_factory("gemma")
    records = [conversation(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(40)]
    records[5] = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    path = write_jsonl(tmp_path / "train.jsonl", records)
    conversations = read_conversations(str(path)).conversations
    settings = TokenizeSettings("assistant", 60, "drop_turns")
    serial = tokenize_conversations(conversations, tokenizer, settings)
    pool = make_pool(tokenizer, settings, 2)
    try:
        parallel = tokenize_conversations(conversations, tokenizer, settings, pool=pool, workers=2)
    finally:
        pool.terminate()
    assert [o.status for o in parallel] == [o.status for o in serial]
    assert {o.status for o in serial} >= {"ok", "truncated", "bad"}
    assert [as_tuples([o.example]) if o.example else o.problem for o in parallel] == [
        as_tuples([o.example]) if o.example else o.problem for o in serial]


def test_a_record_s_tools_reach_its_tokens_through_the_pool_and_the_cache(tmp_path, tokenizer_factory,
                                                                           monkeypatch):
    monkeypatch.setattr(prepare_module, "PARALLEL_MIN_PER_WORKER", 1)
    tokenizer = tokenizer_factory("chatml_tools")
    tools = [{"type": "function", "function": {"name": "weather"}}]
    calling = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "tool_calls": [{"function": {"name": "weather", "arguments": "{}"}}]},
               {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    records = [{"messages": calling, "tools": tools} if i % 2 else conversation(i) for i in range(40)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    normalized = read_conversations(str(path)).conversations
    expected = [tokenize_conversation(tokenizer, c.messages, tools=c.tools) for c in normalized]
    assert expected[1].input_ids != tokenize_conversation(tokenizer, normalized[1].messages).input_ids
    for workers, cached in ((1, False), (2, False), (1, True)):  # serial, two processes, from the cache
        cfg = config(path, cache_dir=str(tmp_path / "cache") if cached else None, num_workers=workers)
        if cached:
            prepare(cfg, tokenizer)
        data = prepare(cfg, tokenizer)
        assert [(e.input_ids, e.labels) for e in data.train] == [(e.input_ids, e.labels) for e in expected]
        assert [s.cached for s in data.stats.sources] == [cached]


def test_the_system_prompt_opens_every_conversation_without_one_and_keys_the_cache(tmp_path, chatml):
    records = [conversation(0), conversation(1, system=True)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = config(path, cache_dir=str(tmp_path / "cache"), system_prompt="Be kind.")
    data = prepare(cfg, chatml)
    first, second = (read_conversations(str(path)).conversations[i].messages for i in (0, 1))
    expected = [tokenize_conversation(chatml, [{"role": "system", "content": "Be kind."}, *first]),
                tokenize_conversation(chatml, second)]  # a system message of its own is kept
    assert [(e.input_ids, e.labels) for e in data.train] == [(e.input_ids, e.labels) for e in expected]
    plain = prepare(config(path, cache_dir=str(tmp_path / "cache")), chatml)
    assert not plain.stats.sources[0].cached  # another system prompt, another cache entry
    assert plain.train[0].input_ids == tokenize_conversation(chatml, first).input_ids


def test_counts_read_as_a_user_reads_them():
    assert [counted(n, "pack") for n in (0, 1, 2, 2048)] == ["0 packs", "1 pack", "2 packs", "2,048 packs"]
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(3, "micro-batch", "micro-batches") == "3 micro-batches"
    assert [compact_count(n) for n in (999, 1234, 310_000, 2_500_000_000)] == ["999", "1.23k", "310k", "2.5G"]
