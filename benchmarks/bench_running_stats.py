"""Workload 5: a 50-step training loop in `lax.scan` with running statistics vs plain.

Both loops run 50 SGD steps of a 4 x 512 tanh MLP (batch 128, float32) inside one
jitted `lax.scan`. The recorded loop also taps every layer output and folds the
records into `gl.running_statistics` (element-wise Welford mean/variance, EMA,
min/max, non-finite counts and a magnitude histogram) carried through the scan; its
state has the records' size, whatever the number of steps.

Before timing, it checks that both loops reach the same parameters.

Run: python benchmarks/bench_running_stats.py [--quick] [--device gpu]
"""

from __future__ import annotations

import jax

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 5
TARGET = h.Target(1.15)
TITLE = "50-step lax.scan training loop with running statistics vs a plain loop"
STEPS, LR = 50, 1e-3


def plain_loop():
  def train(params, x, target):
    def step(params, _):
      grads = jax.grad(_mlp.loss_plain)(params, x, target)
      return jax.tree.map(lambda p, g: p - LR * g, params, grads), None
    return jax.lax.scan(step, params, None, length=STEPS)[0]
  return jax.jit(train)


def recorded_loop():
  stats = gl.running_statistics(decay=0.9)

  def train(params, x, target):
    def step(carry, _):
      params, state = carry
      grads, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
      params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
      return (params, stats.update(records, state)[1]), None
    _, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
    carry = (params, stats.init(records))
    return jax.lax.scan(step, carry, None, length=STEPS)[0]
  return jax.jit(train)


WHY = (
    " Each step reads the record and the state (mean, m2, ema, min, max) and writes "
    "the state back, element by element, and counts the record into the histogram in "
    "one scalar variadic reduction (see workload 4); the plain loop has neither.")


def variants(sizes: _mlp.Sizes) -> dict[str, h.Variant]:
  args = _mlp.init(sizes)
  return {
      "plain": h.Variant(f"plain {STEPS}-step scan", plain_loop(), args),
      "running": h.Variant(f"{STEPS}-step scan + running statistics of every layer",
                           recorded_loop(), args),
  }


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  vs = variants(sizes)
  params, state = vs["running"]()
  _mlp.assert_trees_close(params, vs["plain"](), "parameters after the loop")
  assert int(state[_mlp.tap_name(0)].steps) == STEPS
  m = h.measure(vs, settings)
  comparison = h.compare(NUMBER, m, "running", "plain", TARGET, settings)
  if comparison.status == "MISSED":
    comparison.explanation = h.describe_hlo_difference(m["running"], m["plain"]) + WHY
  comparisons = [comparison]
  notes = [f"Sizes: {sizes}, {STEPS} steps. Checked before timing: both loops reach the "
           "same parameters and the state counted every step."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
