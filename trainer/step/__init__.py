"""The train step and its recipe.

- `functions`: the pure init/train/eval/predict functions built from the
  Trainer's hooks, and their compiled forms;
- `recipe`: the step transforms (precision, accumulation, EMA, skipping
  non-finite updates) and `Recipe`, their ordered list; `stages`: the
  signatures they wrap;
- `model_variables`: Linen and NNX models as pure functions of
  `(params, model_state)`; `train_state`: the state pytree; `optim`: the
  optimizer and schedule from the config; `precision`, `accumulation`: the
  helpers two transforms use; `errors`: errors while tracing, explained.
"""
