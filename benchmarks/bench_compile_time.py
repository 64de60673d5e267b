"""Workload 6: trace+compile time of the recorded step vs the plain step.

Each measurement builds a fresh function and a fresh `jax.jit` of it, so that JAX
traces again, then times `.lower(...)` (tracing, including Oryx's harvest
interpreter for the recorded steps, and lowering to StableHLO) and `.compile()`
(XLA) separately. Rounds alternate the variants as in the other workloads, after
one untimed warm-up round that pays for one-off imports and caches. Variants: the
plain gradient, `record_vjp` on every dense layer and `tap` on every layer output,
reaped with `gl.call_and_reap`, on a 4 x 512 tanh MLP with batch 128.

Run: python benchmarks/bench_compile_time.py [--quick] [--device gpu]
"""

from __future__ import annotations

import time

import jax

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 6
TITLE = "Trace+compile time, recorded step vs plain step (fresh jit each time)"
TARGET = h.Target(1.5)

_LOSSES = {
    "plain": ("plain grad", _mlp.loss_plain, False),
    "record_vjp": ("record_vjp every layer", _mlp.loss_record_vjp, True),
    "tap": ("tap every layer output", _mlp.loss_tap, True),
}


def fresh_step(key: str):
  """Returns a new jitted step function (a new function object: JAX retraces it)."""
  _, loss, recorded = _LOSSES[key]

  def step(*args):
    grad = jax.grad(loss)
    return gl.call_and_reap(grad)(*args) if recorded else grad(*args)

  return jax.jit(step)


def time_lower_compile(key: str, args: tuple) -> tuple[float, float]:
  """Returns the seconds of `.lower(*args)` and of `.compile()` for a fresh step."""
  start = time.perf_counter()
  lowered = fresh_step(key).lower(*args)
  lowered_at = time.perf_counter()
  lowered.compile()
  return lowered_at - start, time.perf_counter() - lowered_at


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Times trace+compile of each variant in alternating rounds."""
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  args = _mlp.init(sizes)
  keys = list(_LOSSES)
  for key in keys:  # Warm-up round, untimed.
    time_lower_compile(key, args)
  lower = {key: [] for key in keys}
  compile_ = {key: [] for key in keys}
  for round_index in range(settings.compile_rounds):
    for key in keys if round_index % 2 == 0 else reversed(keys):
      t_lower, t_compile = time_lower_compile(key, args)
      lower[key].append(t_lower)
      compile_[key].append(t_compile)
  m = {}
  for key in keys:
    label = _LOSSES[key][0]
    m[key] = h.Measurement(
        f"{label}: trace+compile", [a + b for a, b in zip(lower[key], compile_[key])])
    m[f"{key}_lower"] = h.Measurement(f"{label}: trace+lower", lower[key])
    m[f"{key}_compile"] = h.Measurement(f"{label}: XLA compile", compile_[key])
  comparisons = []
  for key in ("record_vjp", "tap"):
    explanation = (
        f"Trace+lower takes {m[key + '_lower'].median_s:.3f} s vs "
        f"{m['plain_lower'].median_s:.3f} s plain, XLA compile "
        f"{m[key + '_compile'].median_s:.3f} s vs {m['plain_compile'].median_s:.3f} s. "
        "XLA compile times are alike (the programs differ only by the records, see "
        "workload 1's HLO counts); the difference is Python tracing: Oryx's harvest "
        "trace wraps every primitive of the step, and bodies that hold records are "
        "traced twice to be reaped (sow-free ones, like the small jits inside "
        "`jax.numpy`, are bound unchanged: `_oryx_rules._unless_sow_free`)."
    )
    comparisons.append(h.compare(NUMBER, m, key, "plain", TARGET, settings, explanation))
    comparisons.append(h.compare(NUMBER, m, f"{key}_lower", "plain_lower", None, settings))
    comparisons.append(
        h.compare(NUMBER, m, f"{key}_compile", "plain_compile", None, settings))
  notes = [
      (f"Sizes: {sizes}. {settings.compile_rounds} alternating rounds after a warm-up "
       "round; each measurement is a fresh function under a fresh `jax.jit`.")
  ]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes, unit="s")


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
