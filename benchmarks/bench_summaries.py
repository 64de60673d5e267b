"""Workload 4: on-device summaries of every layer's cotangent vs the plain gradient.

Compares, on a 4 x 512 tanh MLP with batch 128 (float32):

* `jax.jit(jax.grad(loss))`, the plain parameter gradient;
* the gradient plus `gl.summarize` of every layer output's `tap` record (norm, mean,
  variance, min, max, non-finite count and a 30-bin magnitude histogram), for the
  whole batch and, as a second variant, per example (`keep_axes=1`). Only the
  summaries leave the program, not the records.

Before timing, it checks the gradients and that the summaries' norms equal the
norms of the full records.

Run: python benchmarks/bench_summaries.py [--quick] [--device gpu]
"""

from __future__ import annotations

import jax
import numpy as np

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 4
TITLE = "Summaries only (every layer) vs the plain gradient"
TARGET = h.Target(1.05)


def summary_step(keep_axes: int, bins=gl.magnitude_bins()):
  """The parameter gradients and the summaries (only) of every layer's `tap` record."""
  def step(params, x, target):
    grads, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
    return grads, gl.summarize(records, keep_axes=keep_axes, bins=bins)
  return jax.jit(step)


def variants(sizes: _mlp.Sizes) -> dict[str, h.Variant]:
  args = _mlp.init(sizes)
  return {
      "plain": h.Variant("plain grad", _mlp.plain_step(), args),
      "summaries": h.Variant("grad + summaries of every layer", summary_step(0), args),
      "per_example": h.Variant("grad + per-example summaries of every layer",
                               summary_step(1), args),
      "coarse": h.Variant("grad + summaries, 8-bin histogram",
                          summary_step(0, gl.magnitude_bins(1e-8, 1e-1, 8)), args),
  }


def check(vs: dict[str, h.Variant]) -> None:
  plain = vs["plain"]()
  _, records = _mlp.tap_step()(*vs["plain"].args)
  for key, axis in (("summaries", None), ("per_example", 1), ("coarse", None)):
    grads, logged = vs[key]()
    _mlp.assert_trees_close(grads, plain, f"{key}: gradients")
    for name, record in records.items():
      expected = np.linalg.norm(np.asarray(record), axis=axis)
      _mlp.assert_trees_close(logged[name].summary.norm, expected, f"{key}: {name} norm")


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  vs = variants(sizes)
  check(vs)
  m = h.measure(vs, settings)
  comparisons = [
      h.compare(NUMBER, m, "summaries", "plain", TARGET, settings,
                h.describe_hlo_difference(m["summaries"], m["plain"]) +
                " On CPU, XLA makes a separate pass over each record for every statistic "
                "and compares every entry with each of the 29 histogram edges; at "
                "128 x 512 entries a layer's summary costs about as much as two of its "
                "matmuls. The 8-bin row shows the histogram's share. What would fix it: "
                "one fused pass computing all statistics and the bin index per entry (a "
                "Pallas or custom kernel); on a GPU these passes are memory-bound."),
      h.compare(NUMBER, m, "coarse", "plain", None, settings),
      h.compare(NUMBER, m, "per_example", "plain", None, settings,
                h.describe_hlo_difference(m["per_example"], m["plain"])),
  ]
  notes = [f"Sizes: {sizes}. Checked before timing: gradients equal the plain ones and "
           "summary norms equal the norms of the full records."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
