"""The data `ligertune bench step` runs: random tokens shaped as a recipe's training data.

    ids = synthetic_ids(recipe, vocab_size, seed)                      # micro_batch_size x max_seq_len
    batch = synthetic_batch(ids, recipe.model.attention)               # as the trainer lays it out
    examples = synthetic_conversations(total_tokens, max_len, vocab_size, seed)
    examples, packs = whole_micro_batches(examples, recipe.data, micro_batch_size)
    groups = padded_groups([len(e) for e in examples], budget)         # the same, right-padded
    units = synthetic_pairs(pairs, prompt_len, answer_len, vocab_size, seed, spread)   # preference recipes
    units = synthetic_kto(examples, prompt_len, answer_len, vocab_size, seed, spread)  # kto

No tokenizer and no file: the shapes are what a step's time depends on, not the words.
"""

from __future__ import annotations

import math
import random

import torch

from ligertune.data import Batch, PaddedBatch, collate, collate_padded
from ligertune.data.chat import IGNORE_INDEX, TokenizedExample
from ligertune.data.packing import Pack, packs_of_one
from ligertune.data.preference import KTOExample, PreferenceExample
from ligertune.recipe import DataConfig, Recipe


def synthetic_ids(recipe: Recipe, vocab_size: int, seed: int) -> torch.Tensor:
    """[train.micro_batch_size, data.max_seq_len] random tokens: the synthetic rows' micro-batch,
    each row one conversation, every token of it a label."""
    gen = torch.Generator().manual_seed(seed)
    shape = (recipe.train.micro_batch_size, recipe.data.max_seq_len)
    return torch.randint(0, vocab_size, shape, generator=gen)


def synthetic_batch(ids: torch.Tensor, attention: str) -> Batch | PaddedBatch:
    """The rows of `ids` as the trainer lays out a micro-batch of as many conversations
    (`training.step.make_batch`): under packed attention one flattened row kept apart by
    cu_seqlens, else rows (all of one length: nothing padded)."""
    packs = packs_of_one([TokenizedExample(row.tolist(), row.tolist()) for row in ids])
    return collate(packs) if attention == "packed" else collate_padded(packs, pad_id=0)


def synthetic_conversations(total_tokens: int, max_len: int, vocab_size: int,
                            seed: int) -> list[TokenizedExample]:
    """Random-token conversations of mixed lengths adding up to about `total_tokens`.

    Lengths are log-normal (sigma 0.8, median max_len / 6, at least 8 and at most max_len), the
    long-tailed mix of chat data; the first 20-60% of each is masked as the prompt.
    """
    rng = random.Random(f"ligertune-bench-chat:{seed}")
    median = max(8, max_len // 6)
    examples, total = [], 0
    while total < total_tokens:
        n = int(min(max_len, max(8, rng.lognormvariate(math.log(median), 0.8))))
        ids = [rng.randrange(vocab_size) for _ in range(n)]
        prompt = int(n * rng.uniform(0.2, 0.6))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        examples.append(TokenizedExample(ids, labels, origin=f"synthetic:{len(examples)}"))
        total += n
    return examples


def whole_micro_batches(examples: list[TokenizedExample], data: DataConfig,
                        micro_batch_size: int) -> tuple[list[TokenizedExample], list[Pack]]:
    """(the conversations, their packs) that fill whole micro-batches, packed as the recipe packs
    (`build_packs`: `data.max_seq_len`, `data.packing`). Packing leaves the last pack partly filled
    where the conversations overflow, and a micro-batch of it would cost a whole one's fixed work
    for a few tokens (8% of a pass for a 1B model on an H100), which the trainer never pays (it
    carries packs over into the next epoch). Its conversations are left out (the packs'
    `example_indices` still count in `examples`)."""
    from ligertune.training.build import build_packs

    packs = build_packs(data, examples)
    packs = packs[: max(len(packs) // micro_batch_size, 1) * micro_batch_size]
    return [examples[i] for p in packs for i in p.example_indices], packs


def spread_lengths(n: int, spread: float) -> tuple[int, int]:
    """The shortest and longest of the lengths drawn around `n` at `spread` (a fraction below 1):
    round(n (1 - spread)) to round(n (1 + spread)), at least 1."""
    return max(1, round(n * (1 - spread))), max(1, round(n * (1 + spread)))


def _length(n: int, spread: float, gen: torch.Generator) -> int:
    """`n`, or with a spread a length drawn uniformly from `spread_lengths(n, spread)`."""
    if not spread:
        return n
    low, high = spread_lengths(n, spread)
    return int(torch.randint(low, high + 1, (), generator=gen))


def synthetic_pairs(pairs: int, prompt_len: int, answer_len: int, vocab_size: int, seed: int,
                    spread: float = 0.0) -> list[PreferenceExample]:
    """`pairs` preference pairs of random tokens: a prompt of `prompt_len` tokens, then a chosen and a
    rejected answer of `answer_len` tokens each, every answer token scored (as an assistant's turns
    and their end-of-turn tokens are), no prompt token. With a `spread`, each prompt's and each
    answer's length is drawn on its own, uniformly within `spread_lengths` (real pairs' lengths
    differ, which padding pays for and packing does not)."""
    gen = torch.Generator().manual_seed(seed)
    units = []
    for i in range(pairs):
        prompt, chosen, rejected = (_length(n, spread, gen) for n in (prompt_len, answer_len, answer_len))
        ids = torch.randint(0, vocab_size, (prompt + chosen + rejected,), generator=gen).tolist()
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        units.append(PreferenceExample(input_ids=ids, labels=labels, prompt_len=prompt,
                                       answer_lens=(chosen, rejected), origin=f"synthetic:{i}"))
    return units


def synthetic_kto(examples: int, prompt_len: int, answer_len: int, vocab_size: int, seed: int,
                  spread: float = 0.0) -> list[KTOExample]:
    """`examples` KTO examples of random tokens, desirable and undesirable in turn: a prompt of
    `prompt_len` tokens and a completion of `answer_len`, then as its mismatched completion the next
    example's completion (the last takes the first's), every completion token scored. With a
    `spread`, each prompt's and each completion's length is drawn as `synthetic_pairs` draws them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (_length(prompt_len, spread, gen),), generator=gen).tolist()
               for _ in range(examples)]
    completions = [torch.randint(0, vocab_size, (_length(answer_len, spread, gen),), generator=gen).tolist()
                   for _ in range(examples)]
    units = []
    for i, prompt in enumerate(prompts):
        completion, mismatched = completions[i], completions[(i + 1) % examples]
        answers = completion + mismatched
        units.append(KTOExample(input_ids=prompt + answers, labels=[IGNORE_INDEX] * len(prompt) + answers,
                                prompt_len=len(prompt), answer_lens=(len(completion), len(mismatched)),
                                desirable=i % 2 == 0, origin=f"synthetic:{i}"))
    return units


def padded_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive conversations per padded batch, while rows * longest stays within `budget` tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
