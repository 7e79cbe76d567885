r"""lm-evaluation-harness over a trained state: its model interface, a command and an action.

    pip install -e ".[eval]"      # lm-eval and what it pulls in (datasets, evaluate, ...)

    from trainer.harness import HarnessLM, evaluate
    lm = HarnessLM.from_trainer(trainer, state, tokenizer="/path/tokenizer.json")
    results = evaluate(lm, ["hellaswag"], include_path="my_tasks/")  # lm_eval's results

    python -m trainer.harness --workdir=/tmp/finetune --tasks=my_task \
        --include_path=my_tasks/ [--limit=100] [--num_cpu_devices=8]

`HarnessLM` implements lm-evaluation-harness's model interface
(`lm_eval.api.model.TemplateLM`, so the harness's own context/continuation split
applies) over a state in the layout it trained in:

- `loglikelihood`: each request's context and continuation as one right-padded row
  of the model's `max_len` positions (truncated on the left, as the harness's HF
  model does), scored by one compiled program (`strategy.compile_eval_step`:
  parameters stay where the strategy placed them): the continuation's summed log
  probability, and whether each of its tokens is the argmax;
- `loglikelihood_rolling`: the harness's disjoint rolling windows of `max_len`
  tokens, each scored as above, summed per document;
- `generate_until`: `trainer.generation.Generator` (one program, a key/value cache),
  the text cut at the first `until` string.

`HarnessEval` runs tasks as a training action every `every_steps` and writes each
task's metrics to the run's writers (`harness/<task>/<metric>`) and, for fixed
prompts, the generations as text.

Requests run on one process (the harness's `rank` 0 of 1); a multi-process run is
refused naming `jax.process_count()`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.tree import to_host
from trainer.generation import Generator, Sampling, logits_of
from trainer.loop.actions import Action

try:
  from lm_eval.api.model import TemplateLM as _TemplateLM
except ImportError:  # The optional extra: refused where it is used.
  _TemplateLM = object

PyTree = Any


def _require_lm_eval():
  try:
    import lm_eval  # noqa: F401
  except ImportError:
    raise ImportError("trainer.harness needs lm-evaluation-harness: pip install -e "
                      "'.[eval]' (or pip install lm-eval).") from None


def _one_process(what: str) -> None:
  if jax.process_count() > 1:
    raise ValueError(f"{what} runs on one process; this run has "
                     f"jax.process_count()={jax.process_count()}.")


class Scorer:
  """Log-likelihoods of token continuations under a state: one program, compiled by the
  trainer's strategy on the first call and reused for every later state of that layout
  (rows of the model's `max_len` positions)."""

  def __init__(self, trainer, *, rows: int = 8):
    self.trainer = trainer
    self.max_len = trainer.config.model.max_len
    self.vocab_size = trainer.config.model.vocab_size
    multiple = trainer.strategy.batch_multiple
    self.rows = math.ceil(rows / multiple) * multiple
    self._program = None

  def _compile(self, state):
    mv, vocab = self.trainer.model_variables, self.vocab_size

    def score(state, batch):
      outputs, _ = mv.apply(state.params, state.model_state, ((batch["inputs"],), {}),
                            rngs={"params": jax.random.PRNGKey(0),
                                  "dropout": jax.random.PRNGKey(0)}, train=False)
      logits = logits_of(outputs).astype(jnp.float32)
      if vocab is not None:
        logits = logits[..., :vocab]
      log_probs = jax.nn.log_softmax(logits, axis=-1)
      picked = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
      weights = batch["weights"]
      greedy = (jnp.argmax(logits, axis=-1) == batch["targets"]) | (weights == 0)
      return (picked * weights).sum(axis=1), jnp.all(greedy, axis=1)

    return self.trainer.strategy.compile_eval_step(score, state)

  def __call__(self, state, pairs: Sequence[tuple[list[int], list[int]]]
               ) -> list[tuple[float, bool]]:
    """`(log P(continuation | context), greedy)` under `state` for each `(context,
    continuation)` of ids."""
    if self._program is None:
      self._program = self._compile(state)
    out: list[tuple[float, bool]] = []
    for start in range(0, len(pairs), self.rows):
      chunk = pairs[start:start + self.rows]
      inputs = np.zeros((self.rows, self.max_len), np.int32)
      targets = np.zeros_like(inputs)
      weights = np.zeros((self.rows, self.max_len), np.float32)
      for i, (context, continuation) in enumerate(chunk):
        if not continuation:
          raise ValueError(f"harness request {start + i}: an empty continuation.")
        whole = (list(context) + list(continuation))[-(self.max_len + 1):]
        n = len(whole) - 1
        inputs[i, :n], targets[i, :n] = whole[:-1], whole[1:]
        weights[i, n - len(continuation[-n:]):n] = 1.0
      strategy = self.trainer.strategy
      batch = strategy.put_batch(strategy.local_rows(
          dict(inputs=inputs, targets=targets, weights=weights)))
      sums, greedy = to_host(self._program(state, batch))
      out += [(float(sums[i]), bool(greedy[i])) for i in range(len(chunk))]
    return out


class HarnessLM(_TemplateLM):
  """lm-evaluation-harness's model interface over a trainer's state (module docstring).

  Args:
    trainer: the run's `LanguageModelTrainer` (its model, strategy and `config.model`).
    state: a train state as the trainer holds it; `state` may be replaced by a later one of
      the same layout (the compiled programs are kept).
    tokenizer: a `trainer.data.corpus.Tokenizer`, or a path to one (a `tokenizer.json`
      or a model directory).
    batch_size: rows scored per program call (rounded up to the strategy's multiple).
  """

  backend = "causal"

  def __init__(self, trainer, state, tokenizer, *, batch_size: int = 8):
    _require_lm_eval()
    super().__init__()
    _one_process("trainer.harness")
    from trainer.data.corpus import Tokenizer
    if isinstance(tokenizer, str):
      tokenizer = Tokenizer(tokenizer, add_eos=False)
    self.tok = tokenizer
    self.trainer, self.state = trainer, state
    self.scorer = Scorer(trainer, rows=batch_size)
    self.generator = Generator.from_trainer(trainer)
    self.max_len = trainer.config.model.max_len

  @classmethod
  def from_trainer(cls, trainer, state, tokenizer=None, **kwargs) -> HarnessLM:
    """`tokenizer` by default the run's `config.data.tokenizer`, else its
    `config.init_from.path`'s."""
    config = trainer.config
    tokenizer = tokenizer or config.data.tokenizer or config.init_from.path
    return cls(trainer, state, tokenizer, **kwargs)

  @property
  def eot_token_id(self) -> int:
    for token in (self.tok.eos_id, self.tok.bos_id):
      if token is not None:
        return token
    return 0

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
    if add_special_tokens is False:
      return self.tok.tokenizer.encode(string, add_special_tokens=False).ids
    return self.tok.encode_text(string)

  def tok_decode(self, ids) -> str:
    return self.tok.tokenizer.decode(list(ids), skip_special_tokens=True)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    return self.scorer(self.state,
                       [(context, continuation) for _, context, continuation in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    pairs, owners = [], []
    for i, request in enumerate(requests):
      (string,) = request.args
      windows = get_rolling_token_windows(self.tok_encode(string, add_special_tokens=False),
                                          prefix_token=self.eot_token_id,
                                          max_seq_len=self.max_len, context_len=1)
      for window in map(make_disjoint_window, windows):
        pairs.append(window)
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self.scorer(self.state, pairs), strict=True):
      totals[owner] += logprob
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out: list[str | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, request in enumerate(requests):
      kwargs = dict(request.args[1])
      until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
      if isinstance(until, str):
        until = [until]
      steps = int(kwargs.pop("max_gen_toks", 32))
      sample = bool(kwargs.pop("do_sample", False))
      temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
      key = (tuple(until), steps, temperature, float(kwargs.pop("top_p", 1.0) or 1.0),
             int(kwargs.pop("top_k", 0) or 0))
      groups.setdefault(key, []).append(i)
    for (until, steps, temperature, top_p, top_k), members in groups.items():
      steps = min(steps, self.max_len - 1)
      prompts = [self.tok_encode(requests[i].args[0])[-(self.max_len - steps):] or
                 [self.eot_token_id] for i in members]
      sampling = Sampling(max_new_tokens=steps, temperature=temperature, top_p=top_p,
                          top_k=top_k, stop_tokens=(self.eot_token_id,))
      result = self.generator(self.state, prompts, sampling)
      for i, tokens in zip(members, result.tokens, strict=True):
        text = self.tok_decode(tokens)
        for stop in until:
          if stop and stop in text:
            text = text[:text.index(stop)]
        out[i] = text
    return out


def task_manager(include_path: str | Sequence[str] | None = None, *, builtin: bool = True):
  """The harness's `TaskManager` with `include_path` (task YAMLs of one's own) added; without
  `builtin`, those alone (the built-in index of some 15,000 tasks takes seconds to scan)."""
  _require_lm_eval()
  from lm_eval.tasks import TaskManager
  manager = TaskManager(include_path=include_path, include_defaults=builtin)
  if not hasattr(manager, "include_defaults"):  # What check_tasks names as searched.
    manager.include_defaults = builtin
  return manager


def check_tasks(tasks: Sequence[str], manager) -> None:
  """Raises ValueError for a task name the harness does not know, listing where it looked."""
  known = set(manager.all_tasks)
  missing = [t for t in tasks if t not in known]
  if missing:
    paths = getattr(manager, "include_path", None)
    builtin = getattr(manager, "include_defaults", True)
    raise ValueError(
        f"harness tasks {missing} are not known to lm-evaluation-harness: looked among "
        f"{len(known)} tasks, groups and tags"
        + (" (its built-in ones" if builtin else " (no built-in ones")
        + (f", and the include_path {paths!r})" if paths else ", no include_path given)")
        + ". Pass the directory of your task YAMLs as include_path.")


def evaluate(lm: HarnessLM, tasks: Sequence[str], *, include_path=None,
             limit: int | float | None = None, num_fewshot: int | None = None,
             manager=None) -> dict:
  """`lm_eval.simple_evaluate` of `tasks` on `lm` (tasks checked first); its results dict."""
  import lm_eval
  manager = manager or task_manager(include_path)
  check_tasks(tasks, manager)
  return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager,
                                 limit=limit, num_fewshot=num_fewshot, log_samples=True,
                                 bootstrap_iters=0, verbosity="WARNING")


def scalar_metrics(results: dict) -> dict[str, float]:
  """`harness/<task>/<metric>` -> value for every numeric metric of `results`."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for name, value in metrics.items():
      if (isinstance(value, int | float) and not isinstance(value, bool)
          and "stderr" not in name and name != "sample_len"):
        out[f"harness/{task}/{name.split(',')[0]}"] = float(value)
  return out


def _arguments(sample: Mapping) -> list[tuple]:
  """A logged sample's requests' arguments (a list of tuples, or lm-eval's dict of them)."""
  args = sample.get("arguments") or []
  if isinstance(args, Mapping):
    args = [tuple(a.values()) if isinstance(a, Mapping) else a for a in args.values()]
  return [tuple(a) if isinstance(a, list | tuple) else (a,) for a in args]


def _response(sample: Mapping, args: list[tuple]) -> str:
  """What the model answered: a generation's text, a multiple choice's most likely choice,
  or a score."""
  responses = sample.get("filtered_resps")
  if isinstance(responses, list) and responses and all(isinstance(r, str) for r in responses):
    return responses[0]
  if isinstance(responses, list) and len(responses) == len(args) > 1:
    scores = [r[0] if isinstance(r, list | tuple) else r for r in responses]
    best = max(range(len(scores)), key=lambda i: float(scores[i]))
    return str(args[best][1]) if len(args[best]) > 1 else str(best)
  return str(responses)


def sample_tables(results: dict, rows: int = 4) -> dict[str, str]:
  """`harness/samples/<task>` -> a Markdown table of the task's first `rows` logged samples
  (`evaluate` logs them): the input, the model's response, the target and the sample's
  metrics."""
  from trainer.writers import markdown_table
  out = {}
  for task, samples in (results.get("samples") or {}).items():
    if not samples:
      continue
    names = [k for k, v in samples[0].items() if isinstance(v, int | float)
             and not isinstance(v, bool) and k not in ("doc_id", "target")]
    table = []
    for sample in samples[:rows]:
      args = _arguments(sample)
      table.append([args[0][0] if args else "", _response(sample, args),
                    sample.get("target", ""), *(sample.get(n, "") for n in names)])
    out[f"harness/samples/{task}"] = markdown_table(["input", "response", "target", *names],
                                                    table)
  return out


class HarnessEval(Action):
  """Runs harness tasks on the training state every `every_steps` (and at the last step),
  writing each task's metrics to `writer` as `harness/<task>/<metric>`, a table of each
  task's first samples as text (`harness/samples/<task>`: input, response, target), and the
  greedy continuations of `prompts` as text (`harness/generations`).

  The state stays in the training layout: scoring and generation compile through the
  trainer's strategy, nothing is gathered to one device. One `HarnessLM` serves every run,
  each with that step's state, so its programs compile once.
  """

  reads_state = True
  time_category = "eval"

  def __init__(self, trainer, writer, tasks: Sequence[str], *, every_steps: int,
               tokenizer=None, include_path=None, limit: int | float | None = None,
               prompts: Sequence[str] = (), max_new_tokens: int = 32, batch_size: int = 8,
               builtin_tasks: bool = True):
    super().__init__(every_steps=every_steps)
    _one_process("HarnessEval")  # Refused before training, not at the first evaluation.
    self.trainer, self.writer = trainer, writer
    self.tasks, self.limit = list(tasks), limit
    self.manager = task_manager(include_path, builtin=builtin_tasks)
    check_tasks(self.tasks, self.manager)  # Before training starts.
    self.tokenizer, self.batch_size = tokenizer, batch_size
    self.prompts, self.max_new_tokens = tuple(prompts), max_new_tokens
    self._lm: HarnessLM | None = None

  def triggers(self, view) -> bool:
    return bool(view.crossed(self.every_steps)) or view.is_last

  def run(self, view) -> None:
    if self._lm is None:
      self._lm = HarnessLM.from_trainer(self.trainer, view.state, self.tokenizer,
                                        batch_size=self.batch_size)
    lm = self._lm
    lm.state = view.state
    results = evaluate(lm, self.tasks, limit=self.limit, manager=self.manager)
    self.writer.write_scalars(view.step, scalar_metrics(results))
    self.writer.write_texts(view.step, sample_tables(results))
    if self.prompts:
      texts = lm.generate_until([_Request((p, {"max_gen_toks": self.max_new_tokens}))
                                 for p in self.prompts])
      self.writer.write_texts(view.step, {"harness/generations": "\n\n".join(
          f"{p!r} -> {t!r}" for p, t in zip(self.prompts, texts, strict=True))})


@dataclasses.dataclass
class _Request:
  args: tuple


def main(argv):
  from absl import flags
  flags_ = flags.FLAGS
  if len(argv) > 1:
    raise SystemExit(f"Unexpected arguments: {argv[1:]}")
  from trainer import generate as command
  from trainer.distributed import devices
  devices.initialize(flags_.num_cpu_devices)
  tasks = [t for t in flags_.tasks.split(",") if t]
  if not tasks:
    raise ValueError("--tasks: give one or more task names, comma-separated.")
  manager = task_manager(flags_.include_path, builtin=flags_.builtin_tasks)
  check_tasks(tasks, manager)
  config = command.run_config(flags_.workdir, flags_.init_from, flags_.config)
  trainer = command.build_trainer(config, step=flags_.step, member=flags_.member,
                                  strategy=flags_.strategy)
  lm = HarnessLM.from_trainer(trainer, command.restored_state(trainer), flags_.tokenizer)
  results = evaluate(lm, tasks, limit=flags_.limit or None, manager=manager)
  for name, value in sorted(scalar_metrics(results).items()):
    print(f"{name.removeprefix('harness/')}: {value:.4f}")


def _define_flags():
  from absl import flags

  from trainer.generate import define_model_flags
  define_model_flags("Evaluate")
  flags.DEFINE_string("tasks", "", "Task names, comma-separated.")
  flags.DEFINE_string("include_path", None, "A directory of task YAMLs of one's own.")
  flags.DEFINE_boolean("builtin_tasks", True, "Also index the harness's built-in tasks.")
  flags.DEFINE_float("limit", 0, "Documents per task (0: all; below 1: a fraction).")


if __name__ == "__main__":
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  _define_flags()
  from trainer import config as config_lib
  config_lib.run(main, flags_parser=None)
