"""On-policy distillation of a language model: a part of its own.

- `trainer.distill.trainer`: `DistillationTrainer`, a `LanguageModelTrainer` whose train
  step draws the student's completions (`trainer.generation.Generator`), computes the
  frozen teacher's distributions and updates the student on their divergence, in one
  program under the training layout;
- `trainer.distill.losses`: TRL 1.16's generalized Jensen-Shannon divergence (`beta`,
  `temperature`) and its reduction;
- `trainer.distill.teacher`: the teacher, any model the project loads, held frozen in the
  train state, optionally quantized;
- `trainer.distill.data`: prompt (and completion) records through the corpus pipeline;
- `trainer.distill.settings`: `config.distill`, checked before anything is built.

`configs/distill.py` holds the fields; `examples/distill_lm.py` runs it.
"""

from trainer.distill.data import example_batch
from trainer.distill.settings import Distill
from trainer.distill.trainer import DistillationTrainer

__all__ = ["Distill", "DistillationTrainer", "example_batch"]
