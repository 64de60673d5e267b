"""Workload 13: logging LoGra's projected per-example gradients every step vs the plain step.

Each call is one training step as a user runs it for TracIn and loss-spike
attribution later: the jitted step (the gradient, and `gl.projected_grads` of the
`gl.record_layers` records, `k x k` per layer with its bias in its block), then
`log.append(step, ...)` of the projected gradients and the batch's example ids,
which the writer thread copies to the host and writes. Buffers are not donated (the
harness calls each step on the same arguments). Compared on a 4 x 512 tanh MLP with
batch 128 (float32), `k = 16`:

* the plain gradient step;
* the step with every example's projected gradients, streamed to a `RunLog`.

Also reported: the stored projected gradients' size (float32, before zarr's
compression, which the timing's repeated steps flatter) against the whole
per-example gradients of the same steps.

Run: python benchmarks/bench_attribution.py [--quick] [--device gpu]
"""

from __future__ import annotations

import itertools
import os
import tempfile

import jax
import jax.numpy as jnp

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 13
TITLE = "LoGra's projected per-example gradients logged every step vs the plain step"
TARGETS = {"logged": h.Target(1.25)}
K = 16


class Logged:
  """A jitted step whose projected gradients and ids go to a `RunLog` on every call."""

  def __init__(self, step, log: gl.RunLog, ids: jax.Array):
    self.step, self.log, self.ids, self.count = step, log, ids, itertools.count()

  def lower(self, *args):  # For the harness's memory and HLO analysis of the step.
    return self.step.lower(*args)

  def __call__(self, *args):
    grads, projected = self.step(*args)
    self.log.append(next(self.count), {"train": projected, "ids": self.ids})
    return grads


def logged_step(projector: gl.Projector):
  grad = gl.call_and_reap(jax.grad(gl.record_layers(_mlp.loss_plain)))

  def step(params, x, target):
    grads, records = grad(params, x, target)
    return grads, gl.projected_grads(records, projector)
  return jax.jit(step)


def _size(folder: str) -> int:
  return sum(os.path.getsize(os.path.join(parent, name))
             for parent, _, names in os.walk(folder) for name in names)


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  args = _mlp.init(sizes)
  projector = gl.fit_projector(_mlp.loss_plain, args[0], [args[1:]], k=K)
  with tempfile.TemporaryDirectory() as folder:
    with gl.RunLog(f"{folder}/run") as log:
      vs = {
          "plain": h.Variant("plain grad", _mlp.plain_step(), args),
          "logged": h.Variant(f"grad + projected per-example gradients (k = {K}), "
                              "streamed to zarr",
                              Logged(logged_step(projector), log,
                                     jnp.arange(sizes.batch)), args),
      }
      _mlp.assert_trees_close(vs["logged"](), vs["plain"](), "gradients")
      m = h.measure(vs, settings)
      written = log.flush()
    stored = _size(f"{folder}/run")
  per_example = sum(p["w"].size + p["b"].size for p in args[0])
  projected = sum(v.size for v in jax.tree.leaves(logged_step(projector)(*args)[1]))
  whole, kept = written * sizes.batch * per_example * 4, written * projected * 4
  comparisons = [
      h.compare(NUMBER, m, "logged", "plain", TARGETS["logged"], settings,
                "The projections are two matmuls per layer on the records' layer inputs "
                "and output cotangents; the writer thread stores "
                f"{sizes.batch} x {sizes.layers} x {K} x {K} floats a step."),
  ]
  notes = [f"Sizes: {sizes}, k = {K}. {written} steps were written during the timing: "
           f"{kept / 2**20:.1f} MiB of projected gradients as float32, "
           f"{100 * kept / whole:.2f}% of the whole per-example gradients of those steps "
           f"({whole / 2**30:.1f} GiB; target <= 2%); {stored / 2**20:.1f} MiB on disk "
           "(zarr compresses the timing's repeated steps). Buffers not donated."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
