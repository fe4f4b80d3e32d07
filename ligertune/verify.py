"""What `ligertune verify-loss` computes: packing and batching leave the loss and its gradient unchanged.

For a sample of the recipe's conversations and the recipe's model, and for each normalization mode
(a preference recipe: `ligertune.verify_preference`, its pairs and the mean over them; a
distillation recipe: its teacher beside the model, and the loss of docs/distill.md; a Medusa recipe:
its heads, their blocks perturbed from the identity, and the loss of docs/medusa.md, each head's
targets shifted inside each conversation and normalised over themselves):

- the reference runs each conversation alone (one row each, right-padded, the model's own sdpa
  attention, no ligertune kernel) and computes the loss by the definition of docs/loss.md from the
  full logits, with its own per-conversation counts;
- ligertune's paths (packed; unpacked in one micro-batch; the step cut into several micro-batches)
  run the model as `train` runs it (the recipe's kernels; with LoRA and `kernels.lora`, the fast
  LoRA forward) with packed attention and step-level token weights;
- naive variants (no attention isolation, no position restart, plain concatenation, the wrong
  normalization) show the size of the error that the ligertune paths avoid.

Started in several processes (`--nproc N`, or under `torchrun`), every process also runs the cases
above, and then the step is dealt out: each process takes an equal share of the conversations and
runs it through the model sharded as training shards it (`distributed.strategy`), with the step's
counts summed over the processes and the gradients summed by the sharding; the loss summed over the
processes and the whole gradients are compared with the same reference. The naive variant there
normalizes each process by its own tokens and averages the processes, as plain data parallelism does.

Each case is compared with the reference on the loss (cross-entropy plus z-loss: the objective that
is differentiated) and on the gradient of every trainable parameter.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from ligertune.data import Batch, TokenizedExample, collate, collate_padded, pack, packs_of_one, prepare_data
from ligertune.distributed import (
    Topology,
    accumulating,
    all_reduce_sum,
    full_tensor,
    init_process_group,
    shard,
    split_packs,
    together,
    topology_from_environment,
)
from ligertune.errors import UserError
from ligertune.models import decoder_of, load_tokenizer, unpatch_model
from ligertune.models.lora import patch_lora, unpatch_lora
from ligertune.numerics import relative_error
from ligertune.models.head import divergence_from_logits
from ligertune.objectives import Distill, Medusa, Objective, build_objective
from ligertune.objectives.medusa import head_targets
from ligertune.objectives.normalization import step_token_weights
from ligertune.recipe import LossConfig, Recipe
from ligertune.training.build import (
    attach_teacher,
    build_device,
    build_head,
    build_medusa_heads,
    build_model,
    build_teacher_model,
    patch_kernels,
    strategy,
)
from ligertune.training.step import pad_token_id

MODES = ("token", "sequence", "sum")
T = TypeVar("T")

# (loss relative tolerance, gradient relative error tolerance) per parameter dtype. float32 runs
# differ from the reference only by summation order; half precision by its rounding of activations.
TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (1e-2, 3e-2),
}


@dataclass
class Case:
    """One comparison with the reference."""

    name: str
    kind: str  # "ligertune" | "naive"
    mode: str
    loss_reference: float
    loss_candidate: float
    abs_diff: float
    grad_rel_err: float
    passed: bool

    def to_json(self) -> dict:
        record = asdict(self)
        record["pass"] = record.pop("passed")
        return record


@dataclass
class Report:
    cases: list[Case]
    dtype: str
    device: str
    samples: int
    tolerances: tuple[float, float]
    processes: int = 1
    unit: str = "conversations"
    """What `samples` counts: conversations, or a preference recipe's pairs (KTO: examples)."""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases if c.kind == "ligertune")

    def to_json(self) -> dict:
        return {"pass": self.passed, "cases": [c.to_json() for c in self.cases]}


@dataclass
class LossAndGrads:
    """What one way of computing the step gives."""

    loss: float
    grads: torch.Tensor  # every trainable parameter's gradient, flattened, float32


def verify_loss(recipe: Recipe, *, samples: int = 8, modes: Sequence[str] = ("token", "sequence")) -> Report:
    """Run every case of the module docstring for each mode; see `Report.passed`. With
    `train.precision: fp8` the cases run in `model.dtype`: float8's dynamic scales follow each batch,
    so its rounding differs with the batching that the cases vary, while the loss's math does not."""
    recipe = recipe.in_model_dtype()
    build_objective(recipe)  # an objective the trainer cannot run yet is refused before anything loads
    if recipe.objective.preference:
        from ligertune.verify_preference import verify_preference_loss

        return verify_preference_loss(recipe, samples=samples)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UserError(f"--modes: unknown mode {unknown[0]!r} (expected {', '.join(MODES)})")
    topology, device = start(recipe, samples)

    def build() -> tuple:
        tokenizer = load_tokenizer(recipe.model)
        data = prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, show_progress=False)
        examples = sample(data.train, samples, recipe.train.seed)
        examples = examples[: len(examples) - len(examples) % topology.world_size]
        if len(examples) < max(2, topology.world_size):
            raise UserError(f"data: {len(examples)} trainable conversations, too few to compare "
                            f"over {topology.world_size} process(es)")
        # Built unpatched: the reference runs the model as transformers defines it; the ligertune
        # cases patch it with the recipe's kernels. The same seed gives every process the same weights.
        torch.manual_seed(recipe.train.seed)
        built = build_model(recipe, device=device, vocab_size=len(tokenizer), kernels=False)
        teacher = build_teacher_model(recipe, tokenizer, device=device, dtype=built.dtype, kernels=False)
        return tokenizer, examples, built, teacher

    tokenizer, examples, built, teacher_model = together(build)
    model, dtype = built.module, built.dtype
    objective = build_objective(recipe)
    if teacher_model is not None:
        attach_teacher(objective, model, teacher_model, topology=Topology(), device=device, sharding="none")
    if recipe.lora is not None:
        perturb_lora(model, recipe.train.seed)
    model.eval()  # no dropout: every case must see the same function
    loss_cfg = recipe.loss
    head = build_head(model, recipe.kernels, loss_cfg)
    trained = model  # whose trainable parameters' gradients are compared
    if isinstance(objective, Medusa):
        heads = build_medusa_heads(recipe, model)
        perturb_heads(heads, recipe.train.seed)
        head.attach_medusa(heads, frozen_backbone=objective.options.frozen)
        trained = head  # the model's (none when frozen) and the heads'
    pad_id = pad_token_id(tokenizer)
    tolerances = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    max_len = max(len(e.input_ids) for e in examples)
    total = sum(len(e.input_ids) for e in examples)
    # Capacity for about four packs, so that the packed step can also be cut into micro-batches.
    capacity = max(max_len, math.ceil(total / 4))
    packs = pack(examples, capacity)
    singles = packs_of_one(examples)

    cases: list[Case] = []
    references: dict[str, LossAndGrads] = {}
    both = [model] if teacher_model is None else [model, teacher_model]
    for mode in modes:
        with reference_model(*both):
            references[mode] = reference = run_reference(model, examples, pad_id, loss_cfg, mode, device,
                                                         objective=objective, head=head)
        compare = Comparison(head, trained, reference, loss_cfg, mode, device, tolerances, cases,
                             objective=objective)
        patch_ligertune(model, recipe, teacher=teacher_model)
        try:
            whole = [collate(packs)]
            compare(f"packed {len(packs)}, 1 micro-batch", "ligertune", whole)
            compare(f"packed {len(packs)}, {len(packs)} micro-batches", "ligertune",
                    [collate([p]) for p in packs])
            compare(f"unpacked, 1x{len(singles)}", "ligertune", [collate(singles)])
            compare(f"unpacked, {len(singles)}x1", "ligertune", [collate([s]) for s in singles])
            # Without isolation the model gets transformers' own attention: the packed attention
            # would otherwise still keep conversations apart by their restarting position ids.
            with reference_model(*both):
                compare("no attention isolation", "naive", whole, isolate=False)
                compare("plain concatenation", "naive", whole, isolate=False, restart=False)
            compare("no position restart", "naive", whole, restart=False)
            if mode == "sequence":
                compare("token mean for sequence", "naive", whole,
                        weighting=lambda targets, seq_ids: step_token_weights(
                            targets, seq_ids, "token", ignore_index=loss_cfg.ignore_index,
                            across_ranks=False))
            if mode == "token":
                compare(f"mean per micro-batch, {len(singles)}x1", "naive",
                        [collate([s]) for s in singles],
                        weighting=lambda targets, _: per_micro_batch_mean(targets, loss_cfg.ignore_index))
        finally:
            unpatch_ligertune(model, teacher=teacher_model)
    if topology.distributed:
        patch_ligertune(model, recipe, teacher=teacher_model)
        engine = shard(head, decoder_of(model).layers, strategy=strategy(recipe), device=device,
                       mixed_precision=None, reshard_after_forward=recipe.distributed.reshard_after_forward)
        if teacher_model is not None:
            attach_teacher(objective, model, teacher_model, topology=topology, device=device,
                           sharding=strategy(recipe))
        share = [examples[i] for i in split_packs(range(len(examples)), topology.world_size,
                                                   length=lambda i: len(examples[i]))[topology.rank]]
        world = topology.world_size
        for mode in modes:
            compare = Comparison(engine, trained, references[mode], loss_cfg, mode, device, tolerances, cases,
                                 topology=topology, objective=objective)
            compare(f"{world} processes, packed, 1 micro-batch each", "ligertune",
                    [collate(pack(share, capacity))])
            compare(f"{world} processes, {len(share)}x1 each", "ligertune",
                    [collate([s]) for s in packs_of_one(share)])
            if mode == "token":
                compare(f"{world} processes, mean per process", "naive", [collate(packs_of_one(share))],
                        weighting=lambda targets, _: per_process_mean(targets, loss_cfg.ignore_index, world))
    return Report(cases, str(dtype).removeprefix("torch."), device.type, len(examples), tolerances,
                  processes=topology.world_size)


def patch_ligertune(model: torch.nn.Module, recipe: Recipe, *, teacher: torch.nn.Module | None = None) -> None:
    """What `train` runs: the recipe's kernels (in the teacher too) and, with LoRA and `kernels.lora`,
    the fast LoRA forward."""
    patch_kernels(model, recipe.kernels)
    if teacher is not None:
        patch_kernels(teacher, recipe.kernels)
    if recipe.lora is not None and recipe.kernels.lora:
        patch_lora(model)


def unpatch_ligertune(model: torch.nn.Module, *, teacher: torch.nn.Module | None = None) -> None:
    unpatch_lora(model)
    unpatch_model(model)
    if teacher is not None:
        unpatch_model(teacher)


@dataclass
class Comparison:
    """Runs one way of computing the step and records how it compares with `reference`."""

    engine: Callable  # the loss head, or the head made data-parallel
    model: torch.nn.Module  # whose trainable parameters' gradients are compared
    reference: LossAndGrads
    cfg: LossConfig
    mode: str
    device: torch.device
    tolerances: tuple[float, float]
    cases: list[Case]
    topology: Topology | None = None  # set: the loss and gradients are summed over the processes
    objective: Objective | None = None  # distillation, Medusa: their loss, not SFT's

    def __call__(self, name: str, kind: str, micro: list[Batch], *, isolate: bool = True,
                 restart: bool = True, weighting: Callable | None = None) -> None:
        outcome = run_candidate(self.engine, self.model, micro, self.cfg, self.mode, self.device,
                                isolate=isolate, restart=restart, weighting=weighting,
                                distributed=self.topology is not None, objective=self.objective)
        loss_tol, grad_tol = self.tolerances
        diff = abs(outcome.loss - self.reference.loss)
        err = relative_error(outcome.grads, self.reference.grads)
        ok = diff <= loss_tol * max(1.0, abs(self.reference.loss)) and err <= grad_tol
        self.cases.append(Case(name, kind, self.mode, self.reference.loss, outcome.loss, diff, err, ok))


def start(recipe: Recipe, samples: int) -> tuple[Topology, torch.device]:
    """The processes and the device of the check, once `samples` (conversations or pairs) is known
    to split evenly over the processes."""
    units = recipe.objective.units
    if samples < 2:
        raise UserError(f"--samples: at least 2 {units} are needed to pack, got {samples}")
    topology = topology_from_environment()
    if samples % topology.world_size:
        raise UserError(f"--samples: {samples} {units} do not split evenly over "
                        f"{topology.world_size} processes; use a multiple of {topology.world_size}")
    device = build_device(recipe.train)
    if topology.distributed:
        device = init_process_group(topology, device.type, timeout_minutes=recipe.distributed.timeout_minutes)
    return topology, device


def sample(items: Sequence[T], n: int, seed: int) -> list[T]:
    """`n` items (conversations, or preference units) drawn under `seed`, kept in data order."""
    if len(items) <= n:
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def perturb_lora(model: torch.nn.Module, seed: int) -> None:
    """Give LoRA's zero-initialized B matrices small random values, so that the gradients of the A
    matrices are not all zero and the comparison covers every adapter weight."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * 1e-2)


def perturb_heads(heads: torch.nn.Module, seed: int) -> None:
    """Move the Medusa heads' residual blocks off the identity (their zero start) and their output
    layers off the model's, so that every weight of theirs has a gradient worth comparing."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * 2e-2)


@contextlib.contextmanager
def reference_model(*models: torch.nn.Module) -> Iterator[None]:
    """The models with `transformers`' own sdpa attention, for the duration of the block."""
    bases = [model.get_base_model() if hasattr(model, "get_base_model") else model for model in models]
    previous = [base.config._attn_implementation for base in bases]
    for base in bases:
        base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for base, attention in zip(bases, previous):
            base.set_attn_implementation(attention)


def definition_weights(targets: torch.Tensor, mode: str, ignore_index: int) -> torch.Tensor:
    """w_t of docs/loss.md for a padded batch with one conversation per row, counted directly."""
    supervised = (targets != ignore_index).double()
    per_row = supervised.sum(dim=1, keepdim=True)
    if mode == "sum":
        return supervised
    if mode == "token":
        return supervised / supervised.sum().clamp(min=1)
    rows_with_tokens = (per_row > 0).sum().clamp(min=1)
    return supervised / (per_row.clamp(min=1) * rows_with_tokens)


def definition_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                    cfg: LossConfig) -> torch.Tensor:
    """sum_t w_t l_t with l_t = (1-eps)(-log p_y) + eps * mean_v(-log p_v) + w_z (log Z)^2, in float64."""
    z = logits.double()
    log_z = torch.logsumexp(z, dim=-1)
    log_p = z - log_z[..., None]
    y = targets.clamp(min=0)
    nll = -log_p.gather(-1, y[..., None]).squeeze(-1)
    smooth = -log_p.mean(dim=-1)
    eps = cfg.label_smoothing
    per_token = (1 - eps) * nll + eps * smooth + cfg.z_loss_weight * log_z.square()
    return (weights * torch.where(targets != cfg.ignore_index, per_token, 0.0)).sum()


def run_reference(model: torch.nn.Module, examples: list[TokenizedExample], pad_id: int, cfg: LossConfig,
                  mode: str, device: torch.device, *, objective: Objective | None = None,
                  head: torch.nn.Module | None = None) -> LossAndGrads:
    """The loss of docs/loss.md (distillation: docs/distill.md, against the teacher's logits of each
    conversation alone; Medusa: docs/medusa.md, from each head's logits of each conversation alone,
    through the heads of `head`) in float64 from the full logits, and its gradients."""
    batch = collate_padded(examples, pad_id).to(device)
    if isinstance(objective, Medusa):
        return medusa_reference(head, batch, cfg, mode, objective)
    model.zero_grad(set_to_none=True)
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False)
    logits = model(**inputs).logits
    weights = definition_weights(batch.targets, mode, cfg.ignore_index)
    if isinstance(objective, Distill):
        vocab = objective.teacher.vocab
        with torch.no_grad():
            teacher_logits = objective.teacher.module.model(**inputs).logits[..., :vocab]
        loss = divergence_from_logits(logits[..., :vocab].double().flatten(0, 1), teacher_logits.double().flatten(0, 1),
                                      batch.targets.flatten(), token_weights=weights.flatten(),
                                      options=objective.options).loss
    else:
        loss = definition_loss(logits, batch.targets, weights, cfg)
    loss.backward()
    return LossAndGrads(loss.item(), collect_grads(model))


def medusa_reference(head: torch.nn.Module, batch, cfg: LossConfig, mode: str, objective: Medusa) -> LossAndGrads:
    """Medusa's loss by definition, one conversation per row: sum_k lambda_k L_k (+ lm_weight L_LM
    when the model trains), L_k from head k's logits of its targets, the label k places later in the
    same row, weighted by docs/loss.md over head k's own targets; gradients of the model and heads."""
    head.zero_grad(set_to_none=True)
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False)
    hidden = decoder_of(head.model)(**inputs).last_hidden_state
    rows = torch.arange(batch.targets.shape[0], device=batch.targets.device)[:, None].expand_as(batch.targets)
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for k, (lam, module) in enumerate(zip(objective.options.head_weights, head.medusa.heads), start=1):
        targets = head_targets(batch.targets, rows, k, ignore_index=cfg.ignore_index)
        weights = definition_weights(targets, mode, cfg.ignore_index)
        loss = loss + lam * definition_loss(module(hidden), targets, weights, cfg)
    if not objective.options.frozen:
        weights = definition_weights(batch.targets, mode, cfg.ignore_index)
        loss = loss + objective.options.lm_weight * definition_loss(head.output_layer(hidden), batch.targets,
                                                                    weights, cfg)
    loss.backward()
    return LossAndGrads(loss.item(), collect_grads(head))


def medusa_weights(objective: Medusa, micro: list[Batch], weigh: Callable, ignore_index: int) -> list[torch.Tensor]:
    """Each micro-batch's [1 + K, ...] weights (`Medusa.step_weights`'s layout) from `weigh(targets,
    seq_ids)`, applied to the model's own targets and to each head's over the whole step."""
    seq_ids = [b.seq_ids for b in micro]
    rows = [weigh([b.targets for b in micro], seq_ids)]
    for k in range(1, objective.options.heads + 1):
        shifted = [head_targets(b.targets, b.seq_ids, k, ignore_index=ignore_index) for b in micro]
        rows.append(weigh(shifted, seq_ids))
    return [torch.stack(per_batch) for per_batch in zip(*rows)]


def run_candidate(engine: Callable, model: torch.nn.Module, micro: list[Batch], cfg: LossConfig, mode: str,
                  device: torch.device, *, isolate: bool, restart: bool, weighting: Callable | None,
                  distributed: bool = False, objective: Objective | None = None) -> LossAndGrads:
    micro = [b.to(device) for b in micro]
    targets = [b.targets for b in micro]
    seq_ids = [b.seq_ids for b in micro]
    weigh = weighting or (lambda targets, seq_ids: step_token_weights(
        targets, seq_ids, mode, ignore_index=cfg.ignore_index, across_ranks=distributed))
    if isinstance(objective, Medusa):
        weights = medusa_weights(objective, micro, weigh, cfg.ignore_index)
    else:
        weights = weigh(targets, seq_ids)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, (batch, w) in enumerate(zip(micro, weights)):
        position_ids = batch.position_ids if restart else torch.arange(
            batch.num_tokens, device=device).unsqueeze(0)
        if isolate:
            boundaries = {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}
        else:
            # An explicit all-ones mask: without any mask, transformers itself infers the
            # conversations from restarting position ids and would isolate them after all.
            boundaries = {"attention_mask": torch.ones_like(batch.input_ids)}
        with accumulating(engine, last=i == len(micro) - 1):
            if isinstance(objective, Distill):
                out = objective.loss_of(engine, batch.input_ids, position_ids, batch.targets, w, **boundaries)
            elif isinstance(objective, Medusa):
                out = objective.loss_of(engine, batch.input_ids, position_ids, batch.targets, w, batch.seq_ids,
                                        **boundaries)
            else:
                out = engine(batch.input_ids, position_ids, batch.targets, w, **boundaries)
            out.loss.backward()
        total += out.loss.detach().double()
    if distributed:
        total = all_reduce_sum(total)
    return LossAndGrads(total.item(), collect_grads(model))


def per_micro_batch_mean(targets: list[torch.Tensor], ignore_index: int) -> list[torch.Tensor]:
    """Each micro-batch normalized by its own token count, then averaged: the usual accumulation bug."""
    weights = []
    for t in targets:
        supervised = (t != ignore_index).float()
        weights.append(supervised / supervised.sum().clamp(min=1) / len(targets))
    return weights


def per_process_mean(targets: list[torch.Tensor], ignore_index: int, world_size: int) -> list[torch.Tensor]:
    """Each process normalized by its own token count, then the processes averaged: what plain data
    parallelism (a per-process mean loss, gradients averaged) computes."""
    supervised = [(t != ignore_index).float() for t in targets]
    count = sum(s.sum() for s in supervised).clamp(min=1)
    return [s / count / world_size for s in supervised]


def collect_grads(model: torch.nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient, whole (gathered from the shards), flattened, float32."""
    grads = [
        full_tensor(p.grad).detach().float().reshape(-1) if p.grad is not None
        else torch.zeros(p.numel(), device=p.device)
        for p in model.parameters() if p.requires_grad
    ]
    return torch.cat(grads)
