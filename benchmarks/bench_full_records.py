"""Workload 1: what recording every layer's cotangents costs over the plain gradient.

Compares, on a 4 x 512 tanh MLP with batch 128 (float32):

* `jax.jit(jax.grad(loss))`, the plain parameter gradient;
* `jax.jit(gl.call_and_reap(jax.grad(loss)))` with `gl.record_vjp` on every dense
  layer, recording `(dL/dx, dL/dw, dL/db)` per layer;
* the same with `gl.tap` on every layer output, recording `dL/dh` per layer;

and, to take the ratio apart: the plain gradient with respect to the parameters
and the input `x` (the one matmul more that `record_vjp` asks for); `record_vjp`
of each layer as a function of its input alone (no weight records); and the plain
gradient jitted a second time, an A/A control whose ratio (identical programs)
shows how far noise alone moves a ratio in this run. Before timing, it checks that
every variant returns the plain gradients and that the records are the gradients
they should be.

Run: python benchmarks/bench_full_records.py [--quick] [--device gpu]
"""

from __future__ import annotations

import jax

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 1
TITLE = "Recording every layer's cotangents vs the plain gradient"
TARGET = h.Target(1.10)


def variants(sizes: _mlp.Sizes) -> dict[str, h.Variant]:
  """Returns the jitted variants of the step, keyed by short names."""
  params, x, target = _mlp.init(sizes)
  args = (params, x, target)
  return {
      "plain": h.Variant("plain grad", _mlp.plain_step(), args),
      "plain_again": h.Variant("plain grad, jitted again (A/A control)", _mlp.plain_step(),
                               args),
      "record_vjp": h.Variant("record_vjp every layer", _mlp.record_vjp_step(), args),
      "tap": h.Variant("tap every layer output", _mlp.tap_step(), args),
      "plain_dx": h.Variant(
          "plain grad w.r.t. (params, x)",
          jax.jit(jax.grad(_mlp.loss_plain, argnums=(0, 1))), args),
      "record_inputs": h.Variant(
          "record_vjp of layer inputs only",
          jax.jit(gl.call_and_reap(jax.grad(_mlp.loss_record_inputs))), args),
  }


def check(vs: dict[str, h.Variant], sizes: _mlp.Sizes) -> None:
  """Raises `AssertionError` unless every variant computes the plain gradients."""
  grads = vs["plain"]()
  grads_dx = vs["plain_dx"]()
  for key in ("record_vjp", "tap", "record_inputs"):
    _mlp.assert_trees_close(vs[key]()[0], grads, f"{key}: gradients")
  _, records = vs["record_vjp"]()
  assert sorted(records) == [_mlp.record_name(i) for i in range(sizes.layers)], records.keys()
  for i, layer_grads in enumerate(grads):
    _, dw, db = records[_mlp.record_name(i)]
    _mlp.assert_trees_close((dw, db), (layer_grads["w"], layer_grads["b"]), f"record {i}")
  _mlp.assert_trees_close(records[_mlp.record_name(0)][0], grads_dx[1], "record 0: dL/dx")
  _, input_records = vs["record_inputs"]()
  # The network input is not differentiated, so its site makes no record.
  assert sorted(input_records) == [_mlp.record_name(i) for i in range(1, sizes.layers)]
  _mlp.assert_trees_close(
      [input_records[_mlp.record_name(i)][0] for i in range(1, sizes.layers)],
      [records[_mlp.record_name(i)][0] for i in range(1, sizes.layers)],
      "record_vjp of layer inputs only")
  _, taps = vs["tap"]()
  assert sorted(taps) == [_mlp.tap_name(i) for i in range(sizes.layers)], taps.keys()


def _explain_record_vjp(m: dict[str, h.Measurement], sizes: _mlp.Sizes,
                        settings: h.Settings) -> str:
  rec, plain = m["record_vjp"], m["plain"]
  extra_dots = rec.hlo["dots"] - plain.hlo["dots"]

  def ratio(key, baseline):
    return f"{h.compare(NUMBER, m, key, baseline, None, settings).value:.3f}x"

  return (
      h.describe_hlo_difference(rec, plain)
      + f" Taken apart in this run: the extra matmul alone (plain grad w.r.t. (params, "
      f"x) vs plain) {ratio('plain_dx', 'plain')}; the copies alone (record_vjp vs that) "
      f"{ratio('record_vjp', 'plain_dx')}; recording the layer inputs only "
      f"{ratio('record_inputs', 'plain')}; the A/A control {ratio('plain_again', 'plain')}."
      + f" Two things, neither of them the record sites (they lower to nothing): "
      f"(1) {extra_dots} more matmul: `dL/dx` of the first layer is the gradient with "
      "respect to the network input, which the plain parameter gradient never forms; "
      f"with {sizes.layers} layers that is 1 matmul more on {3 * sizes.layers - 1}, "
      f"about {100 / (3 * sizes.layers - 1):.0f}% more FLOPs; the row "
      "'plain grad w.r.t. (params, x)' vs plain measures it alone. "
      f"(2) {rec.hlo['copies']} copies "
      f"({rec.hlo['copy_bytes'] / 2**20:.2f} MiB): each layer's `(dL/dw, dL/db)` "
      "record is the same array as the gradient, and a jitted function that returns one "
      "array twice gets a copy per duplicate, because each output needs its own buffer; "
      "the row 'record_vjp every layer' vs 'plain grad w.r.t. (params, x)' (same "
      "matmuls) measures the copies alone. "
      "Fix: record only what the gradient does not already return. Today that means "
      "wrapping each layer as a function of its input, `record_vjp(partial(dense, w=w, "
      "b=b), name=...)`: the row 'record_vjp of layer inputs only' has no copies and no "
      "extra matmul (the undifferentiated network input makes no record). A library "
      "option `record_vjp(f, name=..., argnums=(0,))` would say this directly. The "
      "first layer's `dL/dx` is work the user asked for, not overhead."
  )


def _explain_tap(m: dict[str, h.Measurement]) -> str:
  return (
      h.describe_hlo_difference(m["tap"], m["plain"])
      + " The records are the matmul outputs `dL/dh` that the plain step forms anyway; "
      "what changes is that they become outputs of the program instead of temporaries "
      "(more output bytes, fresh buffers every call), and the last layer's `dL/dh` is "
      "materialized by its own small fusion instead of being fused into the next "
      "operation. The zero-perturbation trick, which returns the same values, costs "
      "the same (workload 3), so this is the price of getting the values out, not of "
      "the record sites (which lower to nothing). Less of it: record fewer layers, or "
      "reduce records on the device (summaries) before returning them."
  )


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Checks, times and compares the variants; returns the workload's result."""
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  vs = variants(sizes)
  check(vs, sizes)
  m = h.measure(vs, settings)
  comparisons = [
      h.compare(NUMBER, m, "record_vjp", "plain", TARGET, settings,
                _explain_record_vjp(m, sizes, settings)),
      h.compare(NUMBER, m, "tap", "plain", TARGET, settings, _explain_tap(m)),
      h.compare(NUMBER, m, "record_vjp", "plain_dx", None, settings),
      h.compare(NUMBER, m, "record_inputs", "plain", None, settings),
      h.compare(NUMBER, m, "plain_dx", "plain", None, settings),
      h.compare(NUMBER, m, "plain_again", "plain", None, settings),
  ]
  notes = [
      (f"Sizes: {sizes}. Checked before timing: every variant returns the plain "
       "gradients, `record_vjp`'s `dL/dw`, `dL/db` equal them and its first `dL/dx` "
       "equals `grad` w.r.t. `x`; 'record_vjp of layer inputs only' records the same "
       "`dL/dx` for layers 1.. (layer 0's input `x` is not differentiated: no record).")
  ]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
