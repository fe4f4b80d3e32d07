"""What a training step optimises: one module per objective, behind one seam (`base.Objective`)."""

from ligertune.errors import UserError
from ligertune.kernels import DivergenceOptions
from ligertune.objectives.base import MicroBatchLoss, Objective
from ligertune.objectives.distill import Distill, Teacher
from ligertune.objectives.medusa import Medusa, MedusaOptions
from ligertune.objectives.preference import Preference, PreferenceConfig
from ligertune.objectives.sft import SFT

__all__ = ["SFT", "Distill", "Medusa", "MedusaOptions", "MicroBatchLoss", "Objective", "Preference", "Teacher",
           "build_objective"]


def build_objective(recipe) -> Objective:
    """The recipe's objective: supervised fine-tuning on its `loss` section for `objective.name: sft`;
    distillation (`Distill`, its teacher attached when the run is built) for `distill`; Medusa heads
    (`Medusa`, the heads attached to the loss head when the run is built) for `medusa`; a
    `Preference` objective (DPO, IPO, SimPO, ORPO, KTO) on the `objective` section otherwise.

    The one place that refuses what the trainer does not run yet: `train`, `validate` and
    `verify-loss` call it before reading any data, so the refusal is their first line. Refused:
    preference training without packed attention (each answer attends to its prompt through its own
    key range)."""
    cfg = recipe.objective
    if cfg.name == "sft":
        return SFT(recipe.loss)
    if cfg.name == "distill":
        return Distill(recipe.loss, divergence_options(recipe))
    if cfg.name == "medusa":
        frozen = cfg.backbone == "frozen"
        return Medusa(recipe.loss, MedusaOptions(heads=cfg.heads, head_weights=tuple(cfg.head_weights),
                                                 lm_weight=0.0 if frozen else cfg.lm_weight, frozen=frozen))
    if recipe.model.attention != "packed":
        raise UserError(f"model.attention: preference training ({cfg.name}) needs `packed` attention (each "
                        f"answer attends to its prompt through its own key range); got {recipe.model.attention}")
    return Preference(PreferenceConfig(
        loss=cfg.name, beta=cfg.beta if cfg.beta is not None else 0.1, label_smoothing=cfg.label_smoothing,
        gamma=cfg.gamma if cfg.gamma is not None else 1.0,
        orpo_lambda=cfg.orpo_lambda if cfg.orpo_lambda is not None else 0.1,
        desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight,
    ))


def divergence_options(recipe) -> DivergenceOptions:
    """The options of distillation's fused loss, from the recipe's `objective`, `loss` and `kernels`
    sections (the logit caps are the models' own: `training.build.attach_teacher` sets them)."""
    cfg = recipe.objective
    return DivergenceOptions(
        divergence=cfg.loss, beta=cfg.beta, temperature=cfg.temperature, ce_weight=cfg.alpha,
        ignore_index=recipe.loss.ignore_index, reduction="sum", chunk_bytes=recipe.kernels.loss_chunk_mib * 2**20,
    )
