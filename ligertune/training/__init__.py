"""The training loop, loss normalization, optimizer, checkpoints and the live display."""

from ligertune.training.loss_weights import step_token_weights
from ligertune.training.trainer import RunInterrupted, TrainResult, train

__all__ = ["RunInterrupted", "TrainResult", "step_token_weights", "train"]
