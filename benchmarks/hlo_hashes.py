"""Hashes of compiled programs, to show that a refactoring leaves them unchanged.

Prints, for the oryx_gradlog that Python imports, a hash of the optimized HLO of
workload 12's steps (`gl.clipped_grad`, `gl.record_layers` reaped, per-example
norms, on both decoders) and of small steps that read found and hand-marked layer
records through each analysis. Source locations (metadata, stack frames) are
removed, so that two checkouts of the same program hash alike. Run it once per
checkout and compare: an equal hash is the same compiled program, so its time and
memory ratios cannot have moved.

Run:
  python benchmarks/hlo_hashes.py                              # this checkout
  PYTHONPATH=../other python ../other/benchmarks/hlo_hashes.py # another (same names)
  python benchmarks/hlo_hashes.py --quick                      # the small steps only

Sharp edges:
  * A different hash is not a regression: instruction numbering moves with any
    change to the traced program; time the two with the workloads.
"""

from __future__ import annotations

import hashlib
import re
import sys

import jax
import jax.numpy as jnp

import oryx_gradlog as gl

B, T, D, V = 8, 16, 32, 50


def digest(fn, *args) -> str:
  text = jax.jit(fn).lower(*args).compile().as_text()
  text = re.sub(r"metadata=\{[^}]*\}", "", text)
  text = "\n".join(line for line in text.splitlines()
                   if line.startswith((" ", "ENTRY", "%", "}")))
  text = re.sub(r"stack_frame_id=\d+", "", text)
  return hashlib.sha1(text.encode()).hexdigest()[:12]


def small_steps() -> dict:
  key = jax.random.PRNGKey(0)

  def block(p, ids, y):  # An embedding, 3-D attention kernels, a tied projection.
    h = jnp.take(p["emb"], ids, axis=0)
    q = jnp.einsum("btd,dhk->bthk", h, p["q"])
    a = jax.nn.softmax(jnp.einsum("bthk,bshk->bhts", q, q), -1)
    h = h + jnp.einsum("bthk,hkd->btd", jnp.einsum("bhts,bshk->bthk", a, q), p["o"]) + p["b"]
    logits = h @ p["emb"].T
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, V), (1, 2)))

  def mlp(p, x):  # Hand-marked layers.
    h = jnp.tanh(gl.dense(x, p["w1"], p["b1"], name="fc1"))
    return jnp.mean(jnp.sum(gl.dense(h, p["w2"], name="fc2") ** 2, -1))

  p = {"emb": jax.random.normal(key, (V, D)) * 0.1, "q": jax.random.normal(key, (D, 4, 8)),
       "o": jax.random.normal(key, (4, 8, D)) * 0.1, "b": jnp.zeros(D)}
  ids = jax.random.randint(key, (B, T), 0, V)
  pm = {"w1": jax.random.normal(key, (20, 30)), "b1": jnp.zeros(30),
        "w2": jax.random.normal(key, (30, 5))}
  x = jax.random.normal(key, (B, 20))
  found = lambda p, i, y: gl.reap(jax.grad(gl.record_layers(block)))(p, i, y)
  marked = lambda p, x: gl.reap(jax.grad(mlp))(p, x)
  analyses = {"per_example_norms": gl.per_example_norms, "kfac_factors": gl.kfac_factors,
              "batch_size_tests": gl.batch_size_tests, "gradient_snr": gl.gradient_snr,
              "gradient_noise_scale": gl.gradient_noise_scale}
  steps = {"found: gl.clipped_grad": (gl.clipped_grad(block, l2_norm_clip=1.0), p, ids, ids)}
  for name, analysis in analyses.items():
    if name != "gradient_noise_scale":
      steps[f"found: {name}"] = (lambda a: lambda *args: a(found(*args)))(analysis), p, ids, ids
    steps[f"marked: {name}"] = ((lambda a: lambda *args: a(marked(*args)))(analysis), pm, x)
  return steps


def workload_12_steps() -> dict:
  import bench_any_model as w  # pylint: disable=g-import-not-at-top
  steps = {}
  for d in w.FULL:
    loss, args = w.model(d)
    fns = w.steps(loss, d.batch)
    for key in ("record_layers", "norms", "clipped"):
      steps[f"workload 12, {d.tag}: {w.LABELS[key]}"] = (fns[key], *args)
  return steps


def main() -> None:
  steps = small_steps()
  if "--quick" not in sys.argv:
    steps.update(workload_12_steps())
  print(f"# oryx_gradlog at {gl.__file__}, jax {jax.__version__}")
  for name, (fn, *args) in steps.items():
    print(f"{digest(fn, *args)}  {name}", flush=True)


if __name__ == "__main__":
  main()
