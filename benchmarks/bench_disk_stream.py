"""Workload 8: streaming every step's records to disk with `RunLog` vs the plain step.

Each call is one training step as a user runs it: the jitted step, then
`log.append(step, ...)`, which queues the step's device arrays for the writer thread
(copy to host and zarr write happen there). With `when_full="block"`, a writer that
falls behind makes `append` wait, so the ratio measures sustained throughput.
Compared on a 4 x 512 tanh MLP with batch 128 (float32):

* the plain gradient step;
* the step with summaries of every layer (`gl.summarize`), streamed;
* the step with full `tap` records of every layer (4 x 128 x 512 floats), streamed.

Run: python benchmarks/bench_disk_stream.py [--quick] [--device gpu]
"""

from __future__ import annotations

import itertools
import tempfile

import jax

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 8
TITLE = "Records streamed to disk every step (RunLog) vs the plain step"


class Streamed:
  """A jitted step whose outputs (but the gradients) go to a `RunLog` on every call."""

  def __init__(self, step, log: gl.RunLog):
    self.step, self.log, self.count = step, log, itertools.count()

  def lower(self, *args):  # For the harness's memory and HLO analysis of the step.
    return self.step.lower(*args)

  def __call__(self, *args):
    grads, logged = self.step(*args)
    self.log.append(next(self.count), logged)
    return grads


def summary_step():
  def step(params, x, target):
    grads, records = gl.call_and_reap(jax.grad(_mlp.loss_tap))(params, x, target)
    return grads, gl.summarize(records)
  return jax.jit(step)


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  args = _mlp.init(sizes)
  with tempfile.TemporaryDirectory() as folder, \
       gl.RunLog(f"{folder}/summaries") as summaries, gl.RunLog(f"{folder}/full") as full:
    vs = {
        "plain": h.Variant("plain grad", _mlp.plain_step(), args),
        "summaries": h.Variant("grad + summaries, streamed to zarr",
                               Streamed(summary_step(), summaries), args),
        "full": h.Variant("grad + full records of every layer, streamed to zarr",
                          Streamed(_mlp.tap_step(), full), args),
    }
    _mlp.assert_trees_close(vs["full"](), vs["plain"](), "gradients")
    m = h.measure(vs, settings)
    written = full.flush()
    run_dir = f"{folder}/full"
    stored = gl.open_run(run_dir)[f"{_mlp.tap_name(0)}"]
  comparisons = [
      h.compare(NUMBER, m, "summaries", "plain", None, settings,
                "The writer thread keeps up with a summary per layer per step."),
      h.compare(NUMBER, m, "full", "plain", None, settings,
                f"Each step writes {sizes.layers} arrays of {sizes.batch} x {sizes.width} "
                "float32; the ratio is the writer's sustained throughput (zarr chunk "
                "compression and file writes) against the step's."),
  ]
  notes = [f"Sizes: {sizes}. {written} full-record steps were written and committed "
           f"(stored shape {tuple(stored.shape)}) during the timing."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
