"""The training loop: `Trainer` and its state, optimizer and metric helpers."""

from trainer.classification import ClassificationTrainer
from trainer.language_model import LanguageModelTrainer
from trainer.optim import create_optimizer
from trainer.train_state import TrainState
from trainer.trainer import Trainer, pad_batch

__all__ = [
    "ClassificationTrainer",
    "LanguageModelTrainer",
    "TrainState",
    "Trainer",
    "create_optimizer",
    "pad_batch",
]
