"""`ligertune verify-loss` on a preference recipe: packing pairs, cutting the step into micro-batches
and dealing it to several processes leave the loss and its gradient unchanged.

For a sample of the recipe's pairs (KTO: examples) and the recipe's model:

- the reference runs every answer alone, as its own sequence (prompt + that answer, one padded row
  each, the model's own sdpa attention, no ligertune kernel), takes each answer's sum of log p from
  the full logits in float64, and gives those sums to the objective's loss with every pair weighted
  1/|P| (KTO: z0 from the same sums);
- ligertune's paths lay each pair out as prompt + chosen + rejected (each answer attending to the
  prompt and itself), packed several to a row or one to a row, in one micro-batch or several, and
  run the model as `train` runs it (the recipe's kernels, the fused loss head, step-level pair
  weights; KTO's z0 counted over the whole step);
- a naive variant (each micro-batch the mean of its own pairs, averaged over the micro-batches)
  shows the error that step-level weights avoid.

The reference log-probabilities are those of the starting model; the policy is that model moved a
little (LoRA: its B matrices drawn small and random; otherwise every trainable weight nudged by 5%
of its scale), so
that policy and reference differ and every term of the loss is exercised. Under several processes
each takes an equal share of the units, and the loss summed over them and the whole gradients are
compared with the same reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from ligertune.data import collate_preferences
from ligertune.data.packing import best_fit_decreasing
from ligertune.data.preference import PreferencePack, PreferenceUnit, make_preference_pack
from ligertune.distributed import (
    accumulating,
    all_reduce_sum,
    shard,
    split_packs,
    together,
)
from ligertune.errors import UserError
from ligertune.models import decoder_of, load_tokenizer
from ligertune.numerics import relative_error
from ligertune.objectives import build_objective
from ligertune.objectives.preference import AnswerLogps, num_pairs, step_pair_weights
from ligertune.recipe import Recipe
from ligertune.training.build import build_head, build_model, build_preference_data, strategy
from ligertune.verify import (
    TOLERANCES,
    Case,
    LossAndGrads,
    Report,
    collect_grads,
    patch_ligertune,
    perturb_lora,
    reference_model,
    sample,
    start,
    unpatch_ligertune,
)

MODE = "pair"
"""The normalization a preference step has: the mean over its pairs (KTO: examples)."""


def verify_preference_loss(recipe: Recipe, *, samples: int = 8) -> Report:
    """Run every case of the module docstring; see `Report.passed`."""
    objective = build_objective(recipe)
    topology, device = start(recipe, samples)

    def build() -> tuple:
        tokenizer = load_tokenizer(recipe.model)
        units = sample(build_preference_data(recipe, tokenizer).prepared.train, samples, recipe.train.seed)
        units = units[: len(units) - len(units) % topology.world_size]
        if len(units) < max(2, topology.world_size):
            raise UserError(f"data: {len(units)} preference units, too few to compare over "
                            f"{topology.world_size} process(es)")
        # Built unpatched: the reference runs the model as transformers defines it. The same seed
        # gives every process the same weights.
        torch.manual_seed(recipe.train.seed)
        return units, build_model(recipe, device=device, vocab_size=len(tokenizer), kernels=False)

    units, built = together(build)
    model, dtype = built.module, built.dtype
    model.eval()  # no dropout: every case must see the same function
    with reference_model(model), torch.no_grad():
        reference_logps = [answer_logps_alone(model, u, device).tolist() for u in units]
    move_off_start(model, recipe)
    # The units' layout, with the starting model's sums, as every path gives them to the objective.
    whole = dataclasses.replace(make_preference_pack(units, range(len(units))),
                                reference_logps=[x for values in reference_logps for x in values])
    with reference_model(model):
        reference = run_reference(objective, model, units, whole, device)

    def with_reference(packs: list[PreferencePack]) -> list[PreferencePack]:
        return [dataclasses.replace(p, reference_logps=[x for i in p.example_indices for x in reference_logps[i]])
                for p in packs]

    tolerances = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    cases: list[Case] = []
    head = build_head(model, recipe.kernels, recipe.loss)
    # Capacity for two or three units a pack, so that the packed step can also be cut into micro-batches.
    capacity = max(max(len(u) for u in units), math.ceil(sum(len(u) for u in units) / 3))

    def packed(indices: Sequence[int]) -> list[PreferencePack]:
        """The units at `indices` packed best-fit into `capacity`, with their reference sums."""
        groups = best_fit_decreasing([len(units[i]) for i in indices], capacity)
        packs = [make_preference_pack(units, [indices[j] for j in group]) for group in groups]
        return [dataclasses.replace(p, reference_logps=[x for i in p.example_indices for x in reference_logps[i]])
                for p in packs]

    def one_per_row(indices: Sequence[int]) -> list[PreferencePack]:
        return [q for i in indices for q in packed([i])]

    def compare(name: str, kind: str, engine, micro: list[list[PreferencePack]], *, weighting=None,
                distributed: bool = False) -> None:
        outcome = run_candidate(objective, engine, model, micro, device, weighting=weighting, distributed=distributed)
        loss_tol, grad_tol = tolerances
        diff = abs(outcome.loss - reference.loss)
        err = relative_error(outcome.grads, reference.grads)
        ok = diff <= loss_tol * max(1.0, abs(reference.loss)) and err <= grad_tol
        cases.append(Case(name, kind, MODE, reference.loss, outcome.loss, diff, err, ok))

    everything = range(len(units))
    whole, singles = packed(everything), one_per_row(everything)
    patch_ligertune(model, recipe)
    try:
        # Every process runs these on all the units: weights counted on this process alone.
        compare(f"packed {len(whole)}, 1 micro-batch", "ligertune", head, [whole], weighting=local_weights)
        compare(f"packed {len(whole)}, {len(whole)} micro-batches", "ligertune", head, [[p] for p in whole],
                weighting=local_weights)
        compare(f"one per row, 1x{len(singles)}", "ligertune", head, [singles], weighting=local_weights)
        compare(f"one per row, {len(singles)}x1", "ligertune", head, [[s] for s in singles],
                weighting=local_weights)
        compare(f"mean per micro-batch, 1+{len(singles) - 1}", "naive", head, [singles[:1], singles[1:]],
                weighting=per_micro_batch_mean)
        if topology.distributed:
            world = topology.world_size
            engine = shard(head, decoder_of(model).layers, strategy=strategy(recipe), device=device,
                           mixed_precision=None, reshard_after_forward=recipe.distributed.reshard_after_forward)
            share = split_packs(list(everything), world, length=lambda i: len(units[i]))[topology.rank]
            compare(f"{world} processes, packed, 1 micro-batch each", "ligertune", engine, [packed(share)],
                    distributed=True)
            compare(f"{world} processes, {len(share)}x1 each", "ligertune", engine,
                    [[s] for s in one_per_row(share)], distributed=True)
    finally:
        unpatch_ligertune(model)
    return Report(cases, str(dtype).removeprefix("torch."), device.type, len(units), tolerances,
                  processes=topology.world_size, unit=recipe.objective.units)


def move_off_start(model: torch.nn.Module, recipe: Recipe) -> None:
    """Make the policy differ from the starting model (the reference): LoRA's B matrices drawn small
    and random, or every trainable weight nudged by 5% of its scale."""
    if recipe.lora is not None:
        perturb_lora(model, recipe.train.seed)
        return
    generator = torch.Generator().manual_seed(recipe.train.seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p)
                p.add_(noise * 5e-2 * p.float().std().clamp(min=1e-3).to(p.dtype))


def answer_alone(unit: PreferenceUnit, answer: int) -> tuple[list[int], list[int], list[int]]:
    """Answer `answer` of `unit` as its own sequence: its tokens (prompt + answer), and the rows and
    targets of its scored tokens (each token predicted from the row before it)."""
    start, end = unit.answer_spans[answer]
    p = unit.prompt_len
    ids = unit.input_ids[:p] + unit.input_ids[start:end]
    scored = [j for j in range(p, len(ids)) if unit.labels[start + j - p] >= 0]
    return ids, [j - 1 for j in scored], [ids[j] for j in scored]


def answer_logps_alone(model: torch.nn.Module, unit: PreferenceUnit, device: torch.device) -> torch.Tensor:
    """Each answer's sum of log p run alone (one right-padded row per answer), from the full logits
    in float64: [A] float64, differentiable."""
    alone = [answer_alone(unit, a) for a in range(len(unit.answer_lens))]
    width = max(len(ids) for ids, _, _ in alone)
    input_ids = torch.zeros(len(alone), width, dtype=torch.long)
    mask = torch.zeros(len(alone), width, dtype=torch.long)
    for i, (ids, _, _) in enumerate(alone):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    log_p = torch.log_softmax(logits.double(), dim=-1)
    sums = []
    for i, (_, rows, targets) in enumerate(alone):
        sums.append(log_p[i, rows, targets].sum())
    return torch.stack(sums)


def run_reference(objective, model: torch.nn.Module, units: Sequence[PreferenceUnit], whole: PreferencePack,
                  device: torch.device) -> LossAndGrads:
    """The loss of the definition and its gradients: every answer alone, every pair weighted 1/|P|."""
    model.zero_grad(set_to_none=True)
    logp_sum = torch.cat([answer_logps_alone(model, u, device) for u in units])
    n_tokens = torch.tensor([n for u in units for n in u.scored_tokens()], device=device)
    batch = collate_preferences([whole]).to(device)
    weights = step_pair_weights([len(units)], across_ranks=False, device=device)[0]
    if objective.kto:  # z0 from the same sums: the mean log-ratio of the mismatched completions
        mismatched = batch.answer_mismatched
        log_ratio = logp_sum.detach()[mismatched] - batch.reference_logps[mismatched].double()
        batch.kl_estimate = log_ratio.mean().clamp(min=0.0) if log_ratio.numel() else log_ratio.sum()
    loss = objective.loss(AnswerLogps(logp_sum, n_tokens), batch, weights).loss
    loss.backward()
    return LossAndGrads(loss.item(), collect_grads(model))


def run_candidate(objective, engine, model: torch.nn.Module, micro: list[list[PreferencePack]],
                  device: torch.device, *, weighting: Callable | None, distributed: bool) -> LossAndGrads:
    batches = [collate_preferences(packs).to(device) for packs in micro]
    weights = weighting(batches) if weighting is not None else objective.step_weights(batches)
    model.zero_grad(set_to_none=True)
    batches = objective.prepare_step(engine, batches)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, (batch, w) in enumerate(zip(batches, weights)):
        with accumulating(engine, last=i == len(batches) - 1):
            out = objective.forward(engine, batch, w)
            out.loss.backward()
        total += out.loss.detach().double()
    if distributed:
        total = all_reduce_sum(total)
    return LossAndGrads(total.item(), collect_grads(model))


def local_weights(batches) -> list[torch.Tensor]:
    """1/|P| with the pairs of these micro-batches alone (not summed over the processes)."""
    return step_pair_weights([num_pairs(b) for b in batches], across_ranks=False,
                             device=batches[0].answer_pair.device)


def per_micro_batch_mean(batches) -> list[torch.Tensor]:
    """Each micro-batch the mean of its own pairs, then the micro-batches averaged: the usual
    accumulation bug, which weighs a pair by the size of the micro-batch it landed in."""
    out = []
    for b in batches:
        n = num_pairs(b)
        out.append(torch.full((n,), 1.0 / (n * len(batches)), device=b.answer_pair.device))
    return out

