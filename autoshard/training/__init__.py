"""Training mode: the training step as one graph (forward, backward, gradient sync,
optimizer), planned by the same search as inference."""

from autoshard.ir.graph import PHASES
from autoshard.training.options import (
    Attention,
    Mode,
    Optimizer,
    Precision,
    Recompute,
    Training,
    TrainingError,
)
from autoshard.training.step import TrainingGraphError, training_graph

__all__ = [
    "PHASES",
    "Attention",
    "Mode",
    "Optimizer",
    "Precision",
    "Recompute",
    "Training",
    "TrainingError",
    "TrainingGraphError",
    "training_graph",
]
