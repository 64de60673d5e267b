"""Workload 15: the one-pass analyses at the size people train, on an accelerator.

Example 11's GPT (stock Flax NNX modules, nothing marked) at GPT-2-small's shape: 12
blocks of width 768 with 12 heads, vocabulary 8192, in two regimes of 8,192 tokens a
batch, sequence 256 x batch 32 and sequence 1024 x batch 8, each in float32 and in
bfloat16 computation with float32 parameters (NNX `dtype=jnp.bfloat16`, the usual
mixed precision on TPUs; `--dtypes` picks). Variants of one gradient step, each a
`jax.jit` of a function of `(params, inputs, targets)` called in a Python loop with
the same arguments, nothing donated, at JAX's default matmul precision (what users
run; `JAX_DEFAULT_MATMUL_PRECISION=highest` gives the comparison run):

* `plain`: `jax.grad(loss)`, the floor.
* `norms`: the gradient and `gl.per_example_norms` of `gl.record_layers`' records
  (TPU target <= 1.08 x plain).
* `clipped`: `gl.clipped_grad(loss, l2_norm_clip=C)` (TPU target <= 1.10 x plain, its
  XLA temporaries <= 1.10 x plain's).
* `vmap`: a hand-written `jax.vmap(jax.grad(...))` clip, which also returns the norms.

Before timing, the clipped gradient and the norms are checked against `vmap`'s, as the
relative error of the whole vector (at the default precision on a TPU products are
one bfloat16 pass: the bound is 3e-2 there and in bfloat16, 1e-4 in float32 on a
CPU). The notes give each program's count of products (dots and convolutions,
inside fusions too) and XLA's flop count
(`cost_analysis`): the clipped step's flops over plain's are the work the clip adds,
since the plain weight gradient of a recorded layer is never formed (its products
are replaced by the reweighted sums).

On a CPU the full sizes take minutes a step: the targets are judged on a TPU only;
`--quick` runs a 2-block, width-128 version anywhere.

Run: python benchmarks/bench_train_size.py --device tpu [--dtypes float32]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import _harness as h
import _mlp
import bench_any_model as any_model
import oryx_gradlog as gl

NUMBER = 15
TITLE = ("GPT-2-small-sized decoder (12 x 768, vocabulary 8192), float32 and bfloat16: "
         "per-example norms and gl.clipped_grad vs plain grad and a vmap clip")
TPU_TARGETS = {"norms": h.Target(1.08), "clipped": h.Target(1.10)}
TPU_MEMORY_TARGET = h.Target(1.10)
CLIP = 1.0
LABELS = {"plain": "plain grad", "norms": "grad + per-example norms",
          "clipped": "gl.clipped_grad", "vmap": "vmap(grad) + clip"}


def regimes(settings: h.Settings, sizes: _mlp.Sizes | None = None):
  if sizes is not None:
    shapes = [dict(depth=sizes.layers, width=sizes.width, heads=2, vocab=32, seq=8,
                   batch=sizes.batch)]
  elif settings.quick:
    shapes = [dict(depth=2, width=128, heads=4, vocab=512, seq=64, batch=16)]
  else:
    shapes = [dict(depth=12, width=768, heads=12, vocab=8192, seq=256, batch=32),
              dict(depth=12, width=768, heads=12, vocab=8192, seq=1024, batch=8)]
  return [any_model.Decoder(**shape, dtype=dtype) for shape in shapes
          for dtype in settings.dtypes]


def steps(loss, batch: int) -> dict:
  """The variants, as functions of `(params, inputs, targets)`."""
  def plain(*args):
    return jax.grad(loss)(*args)

  def norms(*args):
    grads, records = gl.call_and_reap(jax.grad(gl.record_layers(loss)))(*args)
    return grads, gl.per_example_norms(records).norms

  def vmap(*args):
    per_example, total = any_model.per_example_grads(loss, batch, *args)
    factors = jnp.minimum(1.0, CLIP / jnp.maximum(total, 1e-12))
    return jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / batch,
                        per_example), total

  return {"plain": plain, "norms": norms,
          "clipped": gl.clipped_grad(loss, l2_norm_clip=CLIP), "vmap": vmap}


def check(vs: dict[str, h.Variant], d: any_model.Decoder, settings: h.Settings) -> str:
  """The clipped gradient and the norms against vmap's; returns a note."""
  expected, expected_norms = vs["vmap"]()
  _, norms = vs["norms"]()
  exact = settings.device == "cpu" and d.dtype == "float32"
  bound = 1e-4 if exact else _mlp.ACCELERATOR_BOUND
  errors = {"clipped gradient": _mlp.relative_error(vs["clipped"](), expected),
            "norms": _mlp.relative_error(norms, expected_norms)}
  for what, error in errors.items():
    if not error <= bound:
      raise AssertionError(f"workload {NUMBER}, {d.tag}: {what} differs from vmap's by "
                           f"{error:.2e} (relative), more than {bound:.0e}")
  if not bool(jnp.any(expected_norms > CLIP)):
    raise AssertionError(f"workload {NUMBER}, {d.tag}: nothing was clipped")
  return (f"{d.tag}: relative error against vmap of the clipped gradient "
          f"{errors['clipped gradient']:.1e}, of the norms {errors['norms']:.1e}")


def hlo_note(m: dict[str, h.Measurement], d: any_model.Decoder) -> str:
  parts = []
  for key, value in m.items():
    flops = value.hlo.get("flops")
    parts.append(f"{key} {value.hlo.get('all_dots', '-')} products"
                 + ("" if flops is None else f", {flops / 1e9:.1f} GFLOP"))
  plain = m["plain"].hlo.get("flops")
  clipped = m["clipped"].hlo.get("flops")
  extra = (f"; clipped adds {clipped / plain - 1:+.1%} of plain's flops"
           if plain and clipped else "")
  return f"{d.tag}, compiled: " + "; ".join(parts) + extra


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  measurements, comparisons, notes = {}, [], []
  for d in regimes(settings, sizes):
    print(f"[{NUMBER}] {d} ...", file=sys.stderr, flush=True)
    loss, args = any_model.model(d)
    vs = {key: h.Variant(f"{d.tag}: {LABELS[key]}", jax.jit(fn), args)
          for key, fn in steps(loss, d.batch).items()}
    notes.append(check(vs, d, settings))
    m = h.measure(vs, settings)
    measurements.update({f"{d.tag}_{key}": value for key, value in m.items()})
    for key in ("norms", "clipped", "vmap"):
      target = settings.target(None, TPU_TARGETS.get(key))
      comparison = h.compare(NUMBER, m, key, "plain", target, settings)
      if comparison.status == "MISSED":
        comparison.explanation = h.describe_hlo_difference(m[key], m["plain"])
      comparisons.append(comparison)
    for key in ("norms", "clipped"):
      target = settings.target(None, TPU_MEMORY_TARGET if key == "clipped" else None)
      comparison = h.Comparison(
          workload=NUMBER, what=f"{m[key].label}: XLA temp memory",
          baseline=f"{m['plain'].label}: XLA temp memory",
          value=m[key].memory["temp"] / m["plain"].memory["temp"], target=target,
          judged=settings.judge_targets)
      if comparison.status == "MISSED":
        comparison.explanation = h.describe_hlo_difference(m[key], m["plain"])
      comparisons.append(comparison)
    notes.append(hlo_note(m, d))
    # A regime of this size takes minutes: print it as soon as it is done.
    print("\n".join(h.format_comparisons(comparisons[-5:]) + h.format_measurements(
        h.WorkloadResult(NUMBER, TITLE, m, [])) + notes[-2:]), file=sys.stderr, flush=True)
  notes.append("Each variant is a `jax.jit` called in a Python loop with the same "
               "arguments; no buffer is donated. Default matmul precision: "
               f"{jax.config.jax_default_matmul_precision or 'JAX default'}.")
  return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
