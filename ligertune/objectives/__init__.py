"""What a training step optimises: one module per objective, behind one seam (`base.Objective`)."""

from ligertune.objectives.base import MicroBatchLoss, Objective
from ligertune.objectives.sft import SFT

__all__ = ["SFT", "MicroBatchLoss", "Objective", "build_objective"]


def build_objective(recipe) -> Objective:
    """The recipe's objective (today: supervised fine-tuning on its `loss` section)."""
    return SFT(recipe.loss)
