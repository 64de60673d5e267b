"""Workload 3: the zero-perturbation trick vs this package, for the same values.

The trick: add a zero `delta` where you want a cotangent and differentiate with
respect to it, returning the deltas' gradients alongside the parameter gradients.
Compared, on a 4 x 512 tanh MLP with batch 128 (float32):

* deltas on every layer output vs `gl.tap` on every layer output (`dL/dh`);
* deltas on every layer input vs `gl.record_vjp` on every layer. The trick's
  parameter gradients are the `dL/dw`, `dL/db` records, so it returns them once,
  while `record_vjp` returns them as gradients and again as records.

Before timing, it checks that both sides return the same values.

Run: python benchmarks/bench_zero_perturbation.py [--quick] [--device gpu]
"""

from __future__ import annotations

import jax

import _harness as h
import _mlp

NUMBER = 3
TITLE = "Zero-perturbation trick vs this package (same values)"
TARGET = h.Target(1.08)


def variants(sizes: _mlp.Sizes) -> dict[str, h.Variant]:
  """Returns the jitted variants of the step, keyed by short names."""
  params, x, target = _mlp.init(sizes)
  args = (params, x, target)
  perturbed = (params, _mlp.zero_deltas(sizes), x, target)
  return {
      "tap": h.Variant("tap every layer output", _mlp.tap_step(), args),
      "perturb_outputs": h.Variant(
          "zero deltas on layer outputs",
          jax.jit(jax.grad(_mlp.loss_perturb_outputs, argnums=(0, 1))), perturbed),
      "record_vjp": h.Variant("record_vjp every layer", _mlp.record_vjp_step(), args),
      "perturb_inputs": h.Variant(
          "zero deltas on layer inputs",
          jax.jit(jax.grad(_mlp.loss_perturb_inputs, argnums=(0, 1))), perturbed),
  }


def check(vs: dict[str, h.Variant], sizes: _mlp.Sizes) -> None:
  """Raises `AssertionError` unless each pair returns the same values."""
  grads, taps = vs["tap"]()
  p_grads, d_outputs = vs["perturb_outputs"]()
  _mlp.assert_trees_close(p_grads, grads, "perturbed outputs: gradients")
  _mlp.assert_trees_close(
      [taps[_mlp.tap_name(i)] for i in range(sizes.layers)], d_outputs, "dL/dh")
  grads, records = vs["record_vjp"]()
  p_grads, d_inputs = vs["perturb_inputs"]()
  _mlp.assert_trees_close(p_grads, grads, "perturbed inputs: gradients")
  expected = [
      (dx, layer["w"], layer["b"]) for dx, layer in zip(d_inputs, p_grads)
  ]
  _mlp.assert_trees_close(
      [records[_mlp.record_name(i)] for i in range(sizes.layers)], expected,
      "(dL/dx, dL/dw, dL/db)")


def _explain_record_vjp(m: dict[str, h.Measurement]) -> str:
  rec = m["record_vjp"]
  return (
      h.describe_hlo_difference(rec, m["perturb_inputs"])
      + f" Same matmuls; the difference is the {rec.hlo['copies']} copies: "
      "`record_vjp` returns each layer's `dL/dw` and `dL/db` twice (as the gradient and "
      "inside the record), and XLA gives each output of a program its own buffer, so "
      "it copies. The trick returns them once because the user assembles the records "
      "from the gradients. Fix: record only the layer inputs (`record_vjp` of "
      "`partial(dense, w=w, b=b)`, or a future `argnums=` option on `record_vjp`), or "
      "drop the gradient's copy and read `dL/dw` from the records; the package itself "
      "adds no instructions (its sites lower to nothing)."
  )


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Checks, times and compares the variants; returns the workload's result."""
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  vs = variants(sizes)
  check(vs, sizes)
  m = h.measure(vs, settings)
  comparisons = [
      h.compare(NUMBER, m, "tap", "perturb_outputs", TARGET, settings,
                h.describe_hlo_difference(m["tap"], m["perturb_outputs"])),
      h.compare(NUMBER, m, "record_vjp", "perturb_inputs", TARGET, settings,
                _explain_record_vjp(m)),
  ]
  notes = [
      (f"Sizes: {sizes}. Checked before timing: `tap` records equal the output deltas' "
       "gradients, `record_vjp` records equal (input delta gradient, parameter "
       "gradients), and all gradients agree.")
  ]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
