"""Workload 4: on-device summaries of every layer's cotangent vs the plain gradient.

Compares, on a 4 x 512 tanh MLP with batch 128 (float32), side by side:

* `jax.jit(jax.grad(loss))`, the plain parameter gradient;
* the floor: the gradient plus one `jnp.sum` of each layer output's cotangent (the
  least that reads every record once);
* the gradient plus `gl.summarize` of every layer output's `tap` record: statistics
  only (norm, mean, variance, min, max, non-finite count; `bins=None`), statistics
  with the default 26-bin magnitude histogram, and both per example
  (`keep_axes=1`); plus, for reference, a histogram with 29 log10-spaced edges
  (not powers of two, so binned by comparisons). Only the summaries leave the
  program, not the records.

Before timing, it checks the gradients and that the summaries' norms equal the
norms of the full records.

Run: python benchmarks/bench_summaries.py [--quick] [--device gpu] [--no-scan]
(prints the four issue-10 targets in one table: with workload 5, the 50-step
scan with running statistics, unless --no-scan)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 4
TITLE = "Summaries (every layer) vs the plain gradient"
TARGETS = {"statistics": h.Target(1.05), "summaries": h.Target(1.15),
           "per_example": h.Target(1.20)}


def summary_step(keep_axes: int, bins=gl.magnitude_bins()):
  """The parameter gradients and the summaries (only) of every layer's `tap` record."""
  def step(params, x, target):
    grads, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
    return grads, gl.summarize(records, keep_axes=keep_axes, bins=bins)
  return jax.jit(step)


def floor_step():
  """The parameter gradients and one sum of each `tap` record: reads each once."""
  def step(params, x, target):
    grads, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
    return grads, {name: jnp.sum(record) for name, record in records.items()}
  return jax.jit(step)


def variants(sizes: _mlp.Sizes) -> dict[str, h.Variant]:
  args = _mlp.init(sizes)
  return {
      "plain": h.Variant("plain grad", _mlp.plain_step(), args),
      "floor": h.Variant("grad + one jnp.sum of each record (the floor)", floor_step(), args),
      "statistics": h.Variant("grad + statistics only (bins=None)", summary_step(0, None),
                              args),
      "summaries": h.Variant("grad + statistics and 26-bin histogram", summary_step(0), args),
      "per_example": h.Variant("grad + per-example statistics and histogram",
                               summary_step(1), args),
      "log10": h.Variant("grad + statistics and 30-bin log10 histogram",
                         summary_step(0, gl.magnitude_bins(1e-10, 1e4, 29)), args),
  }


def check(vs: dict[str, h.Variant]) -> None:
  plain = vs["plain"]()
  _, records = _mlp.tap_step()(*vs["plain"].args)
  for key, axis in (("statistics", None), ("summaries", None), ("per_example", 1),
                    ("log10", None)):
    grads, logged = vs[key]()
    _mlp.assert_trees_close(grads, plain, f"{key}: gradients")
    for name, record in records.items():
      expected = np.linalg.norm(np.asarray(record).reshape(
          (record.shape[0], -1) if axis else -1), axis=axis)
      _mlp.assert_trees_close(logged[name].summary.norm, expected, f"{key}: {name} norm")


WHY = (
    " XLA on CPU compiles a reduction with a fused producer to a scalar loop (about a "
    "cycle per entry and operation) and never merges sibling reductions; `summarize` "
    "therefore reads each record in two variadic `reduce`s over chunks of <= 255 "
    "entries (one for sum, sum of squares, min and max; one for seven int32 counters "
    "that pack four 8-bit bin counts each), masks nothing unless an entry is "
    "non-finite, and reads the bin off the float exponent. What is left is that scalar "
    "pass per record; a vectorised or Pallas kernel would be needed to go lower. On "
    "JAX 0.10's XLA the same HLO runs slower: a variadic reduction of the four "
    "statistics takes about 3.8x four plain `jnp` reductions there (0.36x on JAX "
    "0.5.0), so neither formulation is best on both.")


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  vs = variants(sizes)
  check(vs)
  m = h.measure(vs, settings)
  comparisons = [h.compare(NUMBER, m, "floor", "plain", None, settings)]
  for key in ("statistics", "summaries", "per_example"):
    comparison = h.compare(NUMBER, m, key, "plain", TARGETS[key], settings)
    if comparison.status == "MISSED":
      comparison.explanation = h.describe_hlo_difference(m[key], m["plain"]) + WHY
    comparisons.append(comparison)
  comparisons.append(h.compare(NUMBER, m, "log10", "plain", None, settings))
  notes = [f"Sizes: {sizes}. Checked before timing: gradients equal the plain ones and "
           "summary norms equal the norms of the full records."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


def main() -> None:
  """Runs workload 4 (and 5) and prints the issue-10 targets in one table first."""
  import bench_running_stats

  argv = sys.argv[1:]
  scan = "--no-scan" not in argv
  args = h.parse_args(__doc__.splitlines()[0], [arg for arg in argv if arg != "--no-scan"])
  settings = h.Settings.make(args.quick, args.device)
  if args.malloc == "retain":
    h.retain_freed_memory()
  with jax.default_device(h.device_for(settings)):
    results = [run(settings)] + ([bench_running_stats.run(settings)] if scan else [])
  print(f"\n## Issue 10 targets (jax {jax.__version__}, {jax.default_backend()})\n")
  print("\n".join(h.format_comparisons([c for r in results for c in r.comparisons])))
  for result in results:
    h.print_result(result)


if __name__ == "__main__":
  main()
