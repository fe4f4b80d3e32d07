"""The training loop, loss normalization, optimizer, checkpoints and the live display."""

from ligertune.training.loss_weights import step_token_weights
from ligertune.training.trainer import TrainResult, train

__all__ = ["TrainResult", "step_token_weights", "train"]
