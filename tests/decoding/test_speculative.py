"""The speculative loop on tiny models of three families: greedy answers are plain greedy's, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from ligertune.decoding import (
    DraftTree,
    NgramDraft,
    NoDraft,
    Sampling,
    accept_rule,
    speculative_generate,
)
from ligertune.models import build_model
from ligertune.recipe import ModelConfig

VOCAB = 128
BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 256, "tie_word_embeddings": False}
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2"},
    # a window of 4, shorter than every prompt: the tree mask must apply it as the model's own mask does
    "mistral": {"model_type": "mistral", "sliding_window": 4},
}
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 21)]


def make_model(family: str, seed: int = 0):
    config = {**BASE, **FAMILIES[family]}
    return build_model(ModelConfig(config=config, attention="sdpa"), device="cpu", dtype=torch.float32, seed=seed).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return make_model(request.param)


@torch.no_grad()
def plain_greedy(model, prompt: list[int], max_new_tokens: int, stop: int | None = None) -> list[int]:
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop, pad_token_id=0)
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=config)
    return out[0, len(prompt):].tolist()


class ScriptedDraft:
    """Guesses from a known answer: a tree whose first branch is right for 2 tokens then wrong, whose
    second is right for `depth` tokens, and whose third is wrong from the start; every depth,
    right and wrong siblings and a mid-path rejection are exercised."""

    name = "scripted"
    wants_hidden = False

    def __init__(self, sequence: list[int], depth: int = 4):
        self.sequence = sequence
        self.depth = depth

    def propose(self, tokens, hidden):
        right = self.sequence[len(tokens):len(tokens) + self.depth]
        wrong = [(t + 1) % VOCAB for t in right]
        return DraftTree.from_sequences([right[:2] + wrong[2:], right, wrong[:3]])


def greedy(model, prompt, drafter, max_new_tokens, stops=()):
    return speculative_generate(model, prompt, drafter, accept_rule(Sampling()), max_new_tokens=max_new_tokens,
                                stop_ids=stops)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt9", "prompt21"])
def test_greedy_answer_is_plain_greedy_whatever_the_draft(model, prompt):
    expected = plain_greedy(model, prompt, 24)
    for drafter in (NoDraft(), NgramDraft(), ScriptedDraft(prompt + expected)):
        result = greedy(model, prompt, drafter, 24)
        assert result.ids == expected, drafter.name
        assert result.finish_reason == "length" and result.stats.tokens == 24
    scripted = greedy(model, prompt, ScriptedDraft(prompt + expected), 24).stats
    assert scripted.tokens_per_step == 24 / 5  # 4 guessed + 1 of the model's own per forward, 5 forwards
    assert scripted.acceptance_per_depth() == [1.0, 1.0, 1.0, 1.0]
    assert greedy(model, prompt, NoDraft(), 24).stats.tokens_per_step == 1.0


def test_an_end_token_inside_an_accepted_path_ends_the_answer_there(model):
    prompt = PROMPTS[1]
    answer = plain_greedy(model, prompt, 24)
    stop = next(t for i, t in enumerate(answer) if i >= 2 and t not in answer[:i])  # first seen at index >= 2
    expected = plain_greedy(model, prompt, 24, stop=stop)
    assert expected[-1] == stop and len(expected) < 24
    # the guesses run past the end token; the answer must not
    result = greedy(model, prompt, ScriptedDraft(prompt + answer, depth=6), 24, stops=[stop])
    assert result.ids == expected and result.finish_reason == "stop"
    assert max(result.stats.accepted) > 0


def test_ngram_drafts_are_accepted_on_a_repetitive_text():
    """A tiny llama trained for a few steps on a repeating 7-token cycle continues the cycle; the
    n-gram draft then guesses it and several tokens are kept per forward."""
    torch.manual_seed(0)
    model = make_model("llama").train()
    cycle = torch.tensor([5, 17, 42, 8, 99, 23, 61])
    data = cycle.repeat(10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(40):
        batch = torch.stack([data[s:s + 32] for s in (step % 7, (step + 3) % 7)])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    prompt = [1, 2, 3] + cycle.repeat(2).tolist()
    expected = plain_greedy(model, prompt, 20)
    assert expected[:7] == cycle.tolist()  # the model learned the cycle: the test below means something
    result = greedy(model, prompt, NgramDraft(depth=5), 20)
    assert result.ids == expected
    assert result.stats.tokens_per_step > 2 and result.stats.mean_accepted > 1


@pytest.mark.parametrize("accept", ["exact", "typical"])
def test_sampling_with_a_seed_is_repeatable(accept):
    model = make_model("qwen2")
    prompt = PROMPTS[0] * 2  # repeats, so that the n-gram draft has something to propose
    rule = accept_rule(Sampling(temperature=0.8, top_p=0.9), accept)

    def sample(seed):
        torch.manual_seed(seed)
        return speculative_generate(model, prompt, NgramDraft(), rule, max_new_tokens=16).ids

    first = sample(3)
    assert first == sample(3)
    assert any(sample(s) != first for s in (4, 5, 6))  # the seed matters: it is sampling, not greedy
