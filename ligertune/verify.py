"""What `ligertune verify-loss` computes: packing and batching leave the loss and its gradient unchanged.

For a sample of the recipe's conversations and the recipe's model, and for each normalization mode:

- the reference runs each conversation alone (one row each, right-padded, the model's own sdpa
  attention, no ligertune kernel) and computes the loss by the definition of docs/loss.md from the
  full logits, with its own per-conversation counts;
- ligertune's paths (packed; unpacked in one micro-batch; the step cut into several micro-batches)
  run the patched model with packed attention and step-level token weights;
- naive variants (no attention isolation, no position restart, plain concatenation, the wrong
  normalization) show the size of the error that the ligertune paths avoid.

Each case is compared with the reference on the loss (cross-entropy plus z-loss: the objective that
is differentiated) and on the gradient of every trainable parameter.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import torch

from ligertune.data import Batch, TokenizedExample, collate, collate_padded, pack, packs_of_one, prepare_data
from ligertune.errors import UserError
from ligertune.models import CausalLMLoss, load_tokenizer, unpatch_model
from ligertune.numerics import relative_error
from ligertune.recipe import LossConfig, Recipe
from ligertune.training.build import build_device, build_head, build_model, patch_kernels
from ligertune.training.loss_weights import step_token_weights
from ligertune.training.trainer import pad_token_id

MODES = ("token", "sequence", "sum")

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
    """Run every case of the module docstring for each mode; see `Report.passed`."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UserError(f"--modes: unknown mode {unknown[0]!r} (expected {', '.join(MODES)})")
    if samples < 2:
        raise UserError(f"--samples: at least 2 conversations are needed to pack, got {samples}")
    device = build_device(recipe.train)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.train.seed, show_progress=False)
    examples = sample_conversations(data.train, samples, recipe.train.seed)
    if len(examples) < 2:
        raise UserError("data: fewer than 2 trainable conversations to compare")

    # Built unpatched: the reference runs the model as transformers defines it; each mode's
    # ligertune cases patch it with the recipe's kernels.
    built = build_model(recipe, device=device, vocab_size=len(tokenizer), kernels=False)
    model, dtype = built.module, built.dtype
    if recipe.lora is not None:
        perturb_lora(model, recipe.train.seed)
    model.eval()  # no dropout: every case must see the same function
    loss_cfg = recipe.loss
    head = build_head(model, recipe.kernels, loss_cfg)
    pad_id = pad_token_id(tokenizer)
    loss_tol, grad_tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    max_len = max(len(e.input_ids) for e in examples)
    total = sum(len(e.input_ids) for e in examples)
    # Capacity for about four packs, so that the packed step can also be cut into micro-batches.
    packs = pack(examples, max(max_len, math.ceil(total / 4)))
    singles = packs_of_one(examples)

    cases: list[Case] = []
    for mode in modes:
        with reference_model(model):
            reference = run_reference(model, examples, pad_id, loss_cfg, mode, device)

        def compare(name: str, kind: str, micro: list[Batch], *, isolate: bool = True,
                    restart: bool = True, weighting: Callable | None = None) -> None:
            # Without isolation the model gets transformers' own attention: the packed attention
            # would otherwise still keep conversations apart by their restarting position ids.
            with contextlib.nullcontext() if isolate else reference_model(model):
                outcome = run_candidate(head, micro, loss_cfg, mode, device, isolate=isolate,
                                        restart=restart, weighting=weighting)
            diff = abs(outcome.loss - reference.loss)
            err = relative_error(outcome.grads, reference.grads)
            ok = diff <= loss_tol * max(1.0, abs(reference.loss)) and err <= grad_tol
            cases.append(Case(name, kind, mode, reference.loss, outcome.loss, diff, err, ok))

        patch_kernels(model, recipe.kernels)
        try:
            whole = [collate(packs)]
            compare(f"packed {len(packs)}, 1 micro-batch", "ligertune", whole)
            compare(f"packed {len(packs)}, {len(packs)} micro-batches", "ligertune", [collate([p]) for p in packs])
            compare(f"unpacked, 1x{len(singles)}", "ligertune", [collate(singles)])
            compare(f"unpacked, {len(singles)}x1", "ligertune", [collate([s]) for s in singles])
            compare("no attention isolation", "naive", whole, isolate=False)
            compare("no position restart", "naive", whole, restart=False)
            compare("plain concatenation", "naive", whole, isolate=False, restart=False)
            if mode == "sequence":
                compare("token mean for sequence", "naive", whole,
                        weighting=lambda targets, seq_ids: step_token_weights(targets, seq_ids, "token",
                                                                              ignore_index=loss_cfg.ignore_index))
            if mode == "token":
                compare(f"mean per micro-batch, {len(singles)}x1", "naive",
                        [collate([s]) for s in singles],
                        weighting=lambda targets, seq_ids: per_micro_batch_mean(targets, loss_cfg.ignore_index))
        finally:
            unpatch_model(model)
    return Report(cases, str(dtype).removeprefix("torch."), device.type, len(examples), (loss_tol, grad_tol))


def sample_conversations(examples: list[TokenizedExample], n: int, seed: int) -> list[TokenizedExample]:
    """`n` conversations drawn under `seed`, kept in data order."""
    if len(examples) <= n:
        return list(examples)
    chosen = sorted(random.Random(seed).sample(range(len(examples)), n))
    return [examples[i] for i in chosen]


def perturb_lora(model: torch.nn.Module, seed: int) -> None:
    """Give LoRA's zero-initialized B matrices small random values, so that the gradients of the A
    matrices are not all zero and the comparison covers every adapter weight."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * 1e-2)


@contextlib.contextmanager
def reference_model(model: torch.nn.Module) -> Iterator[None]:
    """The model with `transformers`' own sdpa attention, for the duration of the block."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = base.config._attn_implementation
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(previous)


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
                  mode: str, device: torch.device) -> LossAndGrads:
    batch = collate_padded(examples, pad_id).to(device)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False).logits
    weights = definition_weights(batch.targets, mode, cfg.ignore_index)
    loss = definition_loss(logits, batch.targets, weights, cfg)
    loss.backward()
    return LossAndGrads(loss.item(), collect_grads(model))


def run_candidate(head: CausalLMLoss, micro: list[Batch], cfg: LossConfig, mode: str, device: torch.device, *,
                  isolate: bool, restart: bool, weighting: Callable | None) -> LossAndGrads:
    micro = [b.to(device) for b in micro]
    targets = [b.targets for b in micro]
    seq_ids = [b.seq_ids for b in micro]
    if weighting is None:
        weights = step_token_weights(targets, seq_ids, mode, ignore_index=cfg.ignore_index)
    else:
        weights = weighting(targets, seq_ids)
    head.zero_grad(set_to_none=True)
    total = 0.0
    for batch, w in zip(micro, weights):
        position_ids = batch.position_ids if restart else torch.arange(
            batch.num_tokens, device=device).unsqueeze(0)
        if isolate:
            out = head(batch.input_ids, position_ids, batch.targets, w, cu_seqlens=batch.cu_seqlens,
                       max_seqlen=batch.max_seqlen)
        else:
            # An explicit all-ones mask: without any mask, transformers itself infers the
            # conversations from restarting position ids and would isolate them after all.
            out = head(batch.input_ids, position_ids, batch.targets, w,
                       attention_mask=torch.ones_like(batch.input_ids))
        out.loss.backward()
        total += out.loss.item()
    return LossAndGrads(total, collect_grads(head.model))


def per_micro_batch_mean(targets: list[torch.Tensor], ignore_index: int) -> list[torch.Tensor]:
    """Each micro-batch normalized by its own token count, then averaged: the usual accumulation bug."""
    weights = []
    for t in targets:
        supervised = (t != ignore_index).float()
        weights.append(supervised / supervised.sum().clamp(min=1) / len(targets))
    return weights


def collect_grads(model: torch.nn.Module) -> torch.Tensor:
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1)
        for p in model.parameters() if p.requires_grad
    ]
    return torch.cat(grads)
