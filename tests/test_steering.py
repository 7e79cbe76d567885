"""The one helper through which a strategy steers a model while its step is traced
(`strategies.tracing.Steering`), as the pipeline, context and expert plans use it."""

import threading

import jax
import jax.numpy as jnp
import pytest

from strategies import context, expert, pipeline
from strategies.tracing import Steering


def test_a_plan_is_set_around_the_trace_and_restored_after():
  plans = Steering("test")
  seen = []

  def step(x):
    seen.append(plans.current())
    return x + 1

  assert plans.current() is None
  with plans.active("outer"):
    with plans.active("inner"):
      jax.jit(step).lower(jnp.zeros(2))
    assert plans.current() == "outer"
    with pytest.raises(RuntimeError), plans.active("failed"):
      raise RuntimeError
    assert plans.current() == "outer"
  assert plans.current() is None and seen == ["inner"]


def test_a_step_that_records_no_use_is_refused_once_traced():
  plans = Steering("test")
  refuse = lambda: ValueError("the model never used the plan")  # noqa: E731

  def uses(x):
    plans.record("used")
    return x * 2

  assert float(jax.jit(plans.requiring(uses, refuse))(jnp.float32(2))) == 4.0
  with pytest.raises(ValueError, match="never used the plan"):
    jax.jit(plans.requiring(lambda x: x * 2, refuse))(jnp.float32(2))
  plans.record("outside any requiring: ignored")  # Nothing counts outside a trace.


def test_each_thread_sees_its_own_plan():
  plans, seen = Steering("test"), {}

  def worker(name):
    with plans.active(name):
      seen[name] = plans.current()

  threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert seen == {"a": "a", "b": "b"} and plans.current() is None


def test_the_three_plans_steer_through_it():
  for module in (pipeline, context, expert):
    assert isinstance(module.STEERING, Steering)
    assert module.current == module.STEERING.current
    assert module.active == module.STEERING.active
