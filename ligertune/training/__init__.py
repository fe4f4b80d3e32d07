"""Training: the builder, the run, its step, evaluation, checkpoints and the loop.

What scripts and tests use is exported here on purpose:

    run = setup(recipe, console)                       # a Run, built and (with resume) restored
    stats = train_step(run, next_batches(run))          # one optimizer step -> StepStats
    totals = forward_backward(run, batches, backward=True)
    train_loop(run); cleanup(run)                        # or train(recipe) for all of it
"""

from ligertune.objectives.normalization import step_token_weights
from ligertune.training.build import build_run
from ligertune.training.evaluation import evaluate
from ligertune.training.run import Run, RunInterrupted, StepStats, TrainingDiverged, TrainResult
from ligertune.training.step import forward_backward, next_batches, prefetch_batches, train_step
from ligertune.training.trainer import cleanup, log, setup, train, train_loop

__all__ = [
    "Run", "RunInterrupted", "StepStats", "TrainResult", "TrainingDiverged", "build_run", "cleanup",
    "evaluate", "forward_backward", "log", "next_batches", "prefetch_batches", "setup",
    "step_token_weights", "train", "train_loop", "train_step",
]
