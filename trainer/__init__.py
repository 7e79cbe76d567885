"""The training loop: `Trainer`, its actions, state, optimizer and metric helpers."""

from trainer.actions import Action, FitResult, Loop, NonFiniteError, PeriodicCallback
from trainer.classification import ClassificationTrainer
from trainer.language_model import LanguageModelTrainer
from trainer.optim import create_optimizer, create_schedule
from trainer.train_state import EmaTrainState, TrainState
from trainer.trainer import Trainer, pad_batch

__all__ = [
    "Action",
    "ClassificationTrainer",
    "EmaTrainState",
    "FitResult",
    "LanguageModelTrainer",
    "Loop",
    "NonFiniteError",
    "PeriodicCallback",
    "TrainState",
    "Trainer",
    "create_optimizer",
    "create_schedule",
    "pad_batch",
]
