"""Held-out evaluation: the objective's metrics over the whole held-out set, and a greedy sample."""

from __future__ import annotations

import torch

from ligertune.data import IGNORE_INDEX, Pack
from ligertune.data.preference import PreferencePack, PreferenceUnit
from ligertune.distributed import Topology, all_reduce_sum, split_packs
from ligertune.training.run import Run
from ligertune.training.step import forward_backward, make_batch, pad_token_id


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """The objective's held-out metrics (`eval_loss` first), normalized like training over the whole
    held-out set, every rank's share together."""
    run.engine.eval()
    packs = eval_share(run.data.eval_packs, run.topology)
    size = run.recipe.train.micro_batch_size
    if any(getattr(p, "reference_logps", None) is not None for p in packs):
        # One pack per forward, as the reference pass scored them: before the first step the policy's
        # log-probabilities are then the reference's to the bit (every margin 0, no pair won), where a
        # forward over several padded packs would round them apart.
        size = 1
    batches = [make_batch(run, packs[i : i + size]) for i in range(0, len(packs), size)]
    totals = forward_backward(run, batches, backward=False)
    run.engine.train()
    names = run.objective.sums
    summed = all_reduce_sum(torch.stack([totals[k].double() for k in names])).tolist()
    metrics = run.objective.summarize(dict(zip(names, summed)))
    return {f"eval_{name}": metrics[name] for name in run.objective.held_out}


def eval_share(packs: list[Pack], topology: Topology) -> list[Pack]:
    """This rank's held-out packs. Every rank must run as many forwards (sharded layers gather their
    weights together), so the shares are made equal with packs that carry no loss."""
    world = topology.world_size
    if world == 1:
        return packs
    padded = list(packs) + [without_targets(packs[0])] * (-len(packs) % world)
    return split_packs(padded, world)[topology.rank]


def without_targets(pack: Pack | PreferencePack) -> Pack | PreferencePack:
    """A pack that runs through the model and scores nothing: the same tokens with no target (a
    preference pack: its first prompt, with no answer)."""
    if isinstance(pack, PreferencePack):
        prompt = pack.prompt_lens[0]
        return PreferencePack(pack.input_ids[:prompt], [prompt], [()], [], [], [],
                              desirable=[] if pack.desirable is not None else None,
                              reference_logps=[] if pack.reference_logps is not None else None)
    return Pack(pack.input_ids, [IGNORE_INDEX] * len(pack.targets), pack.seq_lens)


@torch.no_grad()
def greedy_sample(run: Run, tail_chars: int = 300) -> tuple[str, str, str]:
    """The first held-out conversation's last trained turn, answered greedily by the model; for
    preference data, the first held-out prompt, with its chosen answer as the reference.

    Returns (the end of the rendered conversation before that turn, the reference turn, the answer).
    """
    example = run.data.eval_examples[0]
    if isinstance(example, PreferenceUnit):
        prompt_ids = example.input_ids[:example.prompt_len]
        first, last = example.answer_spans[0]
        reference_ids = example.input_ids[first:last]
    else:
        labels = example.labels
        end = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX) + 1
        start = end - 1
        while start > 0 and labels[start - 1] != IGNORE_INDEX:
            start -= 1
        prompt_ids = example.input_ids[:start]
        reference_ids = example.input_ids[start:end]
    reference = run.tokenizer.decode(reference_ids, skip_special_tokens=True)
    model = run.head.model
    model.eval()
    input_ids = torch.tensor([prompt_ids], device=run.device)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=len(reference_ids) + 16,
        do_sample=False,
        eos_token_id=run.tokenizer.eos_token_id,
        pad_token_id=pad_token_id(run.tokenizer),
    )
    model.train()
    answer = run.tokenizer.decode(output[0, len(prompt_ids):], skip_special_tokens=True)
    prompt = run.tokenizer.decode(prompt_ids, skip_special_tokens=False).rstrip()
    return prompt[-tail_chars:], reference, answer
