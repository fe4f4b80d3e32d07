"""What a training step optimises: one module per objective, behind one seam (`base.Objective`)."""

from ligertune.errors import UserError
from ligertune.objectives.base import MicroBatchLoss, Objective
from ligertune.objectives.sft import SFT

__all__ = ["SFT", "MicroBatchLoss", "Objective", "build_objective"]


def build_objective(recipe) -> Objective:
    """The recipe's objective: supervised fine-tuning on its `loss` section for `objective.name: sft`.

    The one place that refuses an objective the trainer does not run yet (the preference objectives,
    whose recipe section is complete): `train`, `validate` and `verify-loss` call it before reading
    any data, so the refusal is their first line."""
    name = recipe.objective.name
    if name != "sft":
        raise UserError(f"objective.name: preference training ({name}) is not wired into the trainer yet")
    return SFT(recipe.loss)
