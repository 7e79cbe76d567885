"""A run: what `Trainer.fit` does, as a part of its own.

- `runner`: `Runner`, built once by the Trainer from its parts; `Runner.fit`
  is one run (start, throughput, calls, the loop, the watchdog);
- `start`: where a run starts (resume from the latest checkpoint, a given
  state, or a new one), `step_of`;
- `state`: `States`, which makes a new placed state (with `config.init_from`
  and a sweep's hyperparameters) or restores one;
- `calls`: the compiled calls the loop advances with (host batches fed ahead,
  or a device dataset);
- `options`: `RunOptions`, the run's own config fields;
- `workdir`: the `--workdir` an entry point writes to, checked before anything runs.
"""
