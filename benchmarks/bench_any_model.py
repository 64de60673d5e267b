"""Workload 12: any model, unchanged: a stock Flax NNX decoder under `gl.record_layers`.

The model is example 11's GPT-style decoder (imported from
`examples/11_any_model_dp.py`, so that the benchmark measures what the example
trains): `nnx.Embed`, a learned position embedding, causal `nnx.MultiHeadAttention`,
`nnx.LayerNorm` and an `nnx.Linear` 4x GELU MLP, 4 blocks of width 256 with 4 heads,
vocabulary 256, a mean token cross-entropy per example and the mean over the batch.
No layer is marked: every analysis finds the layers in the jaxpr. Three regimes of
4,096 tokens a batch: large batches of short sequences (sequence 32, batch 128:
where DP-SGD trains, and where `vmap` pays most), sequence 128, batch 32, and
sequence 512, batch 8 (where each example's activations outweigh its gradient).

Variants of one gradient step, each a `jax.jit` of a function of `(params, inputs,
targets)` called in a Python loop, as users run it. Nothing is donated: each call
returns a fresh gradient from the same parameters (a training step would donate
the parameters and optimizer state it replaces; the gradient is the same).

* `plain`: `jax.grad(loss)`, the floor.
* `record_layers`: `gl.call_and_reap(jax.grad(gl.record_layers(loss)))`, the records
  dropped: what recording costs when nothing reads it (target <= 1.05).
* `norms`: the same, returning the gradient and `gl.per_example_norms(...).norms`
  (target <= 1.30).
* `clipped`: `gl.clipped_grad(loss, l2_norm_clip=C)`, the DP-SGD clipped mean
  gradient (target <= 1.30, and XLA's temporaries <= 1.3 x plain's).
* `jax_privacy`: jax-privacy 2.0's `clipped_grad(loss, l2_clip_norm=C,
  batch_argnums=(1, 2), normalize_by=B)`, where it imports (JAX >= 0.7.1 and the
  `bench-peers` extra, installed by `make bench-set SET=jax-0.10.2`); skipped,
  with a note, elsewhere.
* `vmap`: a hand-written `jax.vmap(jax.grad(...))`, clipped per example and
  averaged.

Before timing, every clipped variant's gradient and norms are checked against
`vmap`'s, and `record_layers`'s gradient against plain's. Then, on a 24-block model
(sequence 32, batch 128), trace plus compile time of a fresh `jax.jit` of
`record_layers` (reaped and dropped) and of `gl.clipped_grad` against plain `grad`
(target <= 1.5), timed as workload 6 does, in 3 rounds.

Run: python benchmarks/bench_any_model.py [--quick]
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import _harness as h
import _mlp
import oryx_gradlog as gl

try:
  import jax_privacy
except ImportError as error:  # Not installed, or needs a newer JAX (2.0: >= 0.7.1).
  jax_privacy, JAX_PRIVACY_MISSING = None, f"{type(error).__name__}: {error}"
else:
  JAX_PRIVACY_MISSING = ""

NUMBER = 12
TITLE = ("Stock NNX decoder, no layer marked: record_layers, per-example norms, "
         "gl.clipped_grad vs plain grad, jax-privacy, vmap")
TARGETS = {"record_layers": h.Target(1.05), "norms": h.Target(1.30),
           "clipped": h.Target(1.30)}
MEMORY_TARGET = h.Target(1.30)
# On a TPU: gl.clipped_grad within the faster of 1.20 x plain and the vmap clip.
TPU_CLIPPED_BOUND = 1.20
COMPILE_TARGET = h.Target(1.5)
# On a TPU also the clip with the Gram form everywhere: at seq 128 "auto" forms the
# attention projections' per-example gradients and holds 4.18x plain's temporaries,
# the Gram form 2.83x (tpu_compile.py, RESULTS.md); which is faster there is unmeasured.
TPU_CLIP_METHODS = ("gram",)
CLIP = 1.0

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "11_any_model_dp.py"


def _example_gpt():
  spec = importlib.util.spec_from_file_location("_any_model_example", _EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.GPT


GPT = _example_gpt()


@dataclasses.dataclass(frozen=True)
class Decoder:
  """The decoder and its batch."""

  depth: int = 4
  width: int = 256
  heads: int = 4
  vocab: int = 256
  seq: int = 32
  batch: int = 128
  dtype: str = "float32"  # The computation's; parameters are float32.

  def __str__(self) -> str:
    compute = ("float32" if self.dtype == "float32"
               else f"{self.dtype} compute, float32 parameters")
    return (f"{self.depth} blocks, width {self.width}, {self.heads} heads, vocabulary "
            f"{self.vocab}, sequence {self.seq}, batch {self.batch}, {compute}")

  @property
  def tag(self) -> str:
    return f"seq {self.seq} x batch {self.batch}" + (
        "" if self.dtype == "float32" else f", {self.dtype}")


FULL = (Decoder(seq=32, batch=128), Decoder(seq=128, batch=32), Decoder(seq=512, batch=8))
FULL_COMPILE = Decoder(depth=24, seq=32, batch=128)
QUICK = (Decoder(depth=2, width=64, vocab=64, seq=16, batch=32),
         Decoder(depth=2, width=64, vocab=64, seq=32, batch=8))
QUICK_COMPILE = Decoder(depth=2, width=64, vocab=64, seq=16, batch=32)


def model(d: Decoder, seed: int = 0):
  """Returns `(loss, (params, inputs, targets))` for `d`."""
  graphdef, params, rest = nnx.split(
      GPT(d.vocab, d.seq, d.width, d.heads, d.depth, dtype=jnp.dtype(d.dtype),
          rngs=nnx.Rngs(seed)), nnx.Param, ...)

  def loss(params, inputs, targets):
    logits = nnx.merge(graphdef, params, rest)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (d.batch, d.seq + 1), 0, d.vocab)
  return loss, (params, tokens[:, :-1], tokens[:, 1:])


def per_example_grads(loss, batch: int, params, inputs, targets):
  """`vmap(grad)` of one example's loss: per-example gradients and their norms."""
  one = lambda p, i, t: loss(p, i[None], t[None])
  grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, inputs, targets)
  return grads, jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1)
                             for g in jax.tree.leaves(grads)))


def vmap_clipped(loss, batch: int):
  """The hand-written clip: per-example gradients clipped to `CLIP`, averaged."""
  def clipped(*args):
    per_example, total = per_example_grads(loss, batch, *args)
    factors = jnp.minimum(1.0, CLIP / jnp.maximum(total, 1e-12))
    return jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / batch, per_example)
  return clipped


def steps(loss, batch: int, clip_methods: tuple[str, ...] = ()) -> dict:
  """The variants, as functions of `(params, inputs, targets)`; `clip_methods` adds
  `gl.clipped_grad` with that method for every layer, as `clipped_METHOD`."""
  def plain(*args):
    return jax.grad(loss)(*args)

  def record_layers(*args):
    return gl.call_and_reap(jax.grad(gl.record_layers(loss)))(*args)[0]

  def norms(*args):
    grads, records = gl.call_and_reap(jax.grad(gl.record_layers(loss)))(*args)
    return grads, gl.per_example_norms(records).norms

  out = {"plain": plain, "record_layers": record_layers, "norms": norms,
         "clipped": gl.clipped_grad(loss, l2_norm_clip=CLIP)}
  for method in clip_methods:
    out[f"clipped_{method}"] = gl.clipped_grad(loss, l2_norm_clip=CLIP, method=method)
  if jax_privacy is not None:
    out["jax_privacy"] = jax_privacy.clipped_grad(
        loss, l2_clip_norm=CLIP, batch_argnums=(1, 2), normalize_by=batch)
  out["vmap"] = vmap_clipped(loss, batch)
  return out


LABELS = {
    "plain": "plain grad",
    "record_layers": "record_layers, reaped and dropped",
    "record_layers_in": "record_layers(in_cotangents=True), reaped and dropped",
    "norms": "grad + per-example norms (record_layers)",
    "clipped": "gl.clipped_grad",
    "clipped_gram": "gl.clipped_grad(method='gram')",
    "clipped_materialized": "gl.clipped_grad(method='materialized')",
    "jax_privacy": "jax-privacy clipped_grad",
    "vmap": "vmap(grad) + clip",
}


def variants(d: Decoder, clip_methods: tuple[str, ...] = ()) -> dict[str, h.Variant]:
  loss, args = model(d)
  return {key: h.Variant(f"{d.tag}: {LABELS[key]}", jax.jit(fn), args)
          for key, fn in steps(loss, d.batch, clip_methods).items()}


def check(vs: dict[str, h.Variant], d: Decoder, exact: bool = True) -> None:
  """Every clipped gradient equals vmap's; record_layers's gradient equals plain's
  (`exact`: element by element; else as vectors, at an accelerator's precision)."""
  expected = vs["vmap"]()
  plain = vs["plain"]()
  _mlp.assert_trees_close(vs["record_layers"](), plain, "record_layers: gradient",
                          exact=exact)
  grads, norms = vs["norms"]()
  _mlp.assert_trees_close(grads, plain, "norms: gradient", exact=exact)
  for key in vs:
    if key.startswith("clipped") or key == "jax_privacy":
      _mlp.assert_trees_close(vs[key](), expected, f"{key}: clipped gradient", rtol=1e-3,
                              exact=exact)
  loss, args = model(d)
  expected_norms = jax.jit(lambda *a: per_example_grads(loss, d.batch, *a)[1])(*args)
  _mlp.assert_trees_close(norms, expected_norms, "per-example norms", rtol=1e-4,
                          exact=exact)
  assert bool(jnp.any(expected_norms > CLIP)), "nothing was clipped"


def memory_comparison(m: dict[str, h.Measurement], key: str, settings: h.Settings,
                      target: h.Target | None) -> h.Comparison:
  """XLA's temporaries of `key` over plain's (a ratio of bytes, not of times)."""
  return h.Comparison(
      workload=NUMBER, what=f"{m[key].label}: XLA temp memory",
      baseline=f"{m['plain'].label}: XLA temp memory",
      value=m[key].memory["temp"] / m["plain"].memory["temp"], target=target,
      judged=settings.judge_targets)


def _trace_compile(fn, args) -> tuple[float, float]:
  start = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  lowered_at = time.perf_counter()
  lowered.compile()
  return lowered_at - start, time.perf_counter() - lowered_at


def compile_times(d: Decoder, settings: h.Settings) -> dict[str, h.Measurement]:
  """Trace+lower and XLA compile of fresh jits, in alternating rounds (as workload 6).

  A third of workload 6's rounds and no warm-up round (the regimes before have
  traced the same modules): on JAX 0.5.0 one XLA compile of the 24-block gradient
  takes about a minute on 2 cores.
  """
  loss, args = model(d)
  fresh = {key: (lambda key=key: steps(loss, d.batch)[key])
           for key in ("plain", "record_layers", "clipped")}
  # Beside it, the two record sites per use that input cotangents take.
  fresh["record_layers_in"] = lambda: (lambda *a: gl.call_and_reap(
      jax.grad(gl.record_layers(loss, in_cotangents=True)))(*a)[0])
  lower = {key: [] for key in fresh}
  compile_ = {key: [] for key in fresh}
  for round_index in range(max(1, settings.compile_rounds // 3)):
    for key in fresh if round_index % 2 == 0 else reversed(fresh):
      t_lower, t_compile = _trace_compile(fresh[key](), args)
      lower[key].append(t_lower)
      compile_[key].append(t_compile)
  m = {}
  for key in fresh:
    label = f"{d.depth} blocks: {LABELS[key]}"
    m[f"compile_{key}"] = h.Measurement(
        f"{label}: trace+compile", [a + b for a, b in zip(lower[key], compile_[key])])
    m[f"compile_{key}_lower"] = h.Measurement(f"{label}: trace+lower", lower[key])
    m[f"compile_{key}_xla"] = h.Measurement(f"{label}: XLA compile", compile_[key])
  return m


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Times the variants in both regimes, then trace+compile on the deep model.

  `sizes` (the test suite's tiny MLP sizes) shrinks the decoder to `sizes.layers`
  blocks of width `sizes.width` and batch `sizes.batch`.
  """
  if sizes is not None:
    tiny = Decoder(depth=sizes.layers, width=sizes.width, heads=2, vocab=16, seq=8,
                   batch=sizes.batch)
    regimes, deep = (tiny,), tiny
  else:
    regimes, deep = (QUICK, QUICK_COMPILE) if settings.quick else (FULL, FULL_COMPILE)
  measurements, comparisons = {}, []
  for index, d in enumerate(regimes):
    print(f"[{NUMBER}] {d} ...", file=sys.stderr, flush=True)
    vs = variants(d, TPU_CLIP_METHODS if settings.device == "tpu" else ())
    check(vs, d, exact=settings.device == "cpu")
    m = h.measure(vs, settings)
    measurements.update({f"{index}_{key}": value for key, value in m.items()})
    vmap_ratio = h.compare(NUMBER, m, "vmap", "plain", None, settings).value
    tpu_targets = {"clipped": h.Target(min(TPU_CLIPPED_BOUND, vmap_ratio))}
    for key in vs:
      if key == "plain":
        continue
      target = settings.target(TARGETS.get(key), tpu_targets.get(key))
      comparison = h.compare(NUMBER, m, key, "plain", target, settings)
      if comparison.status == "MISSED":
        comparison.explanation = h.describe_hlo_difference(m[key], m["plain"])
      comparisons.append(comparison)
    for key in vs:
      if key != "plain":
        comparison = memory_comparison(m, key, settings,
                                       MEMORY_TARGET if key == "clipped" else None)
        if comparison.status == "MISSED":
          comparison.explanation = h.describe_hlo_difference(m[key], m["plain"])
        comparisons.append(comparison)
    if "jax_privacy" in vs:
      comparisons.append(h.compare(NUMBER, m, "jax_privacy", "clipped", None, settings))
    comparisons.append(h.compare(NUMBER, m, "vmap", "clipped", None, settings))
    if "clipped_gram" in vs:
      comparisons.append(h.compare(NUMBER, m, "clipped_gram", "clipped", None, settings))
  notes = []
  if settings.device != "cpu":  # Its target is a CPU's; a TPU compiles 24 blocks slowly.
    notes.append("Trace+compile on 24 blocks: measured on a CPU only.")
    return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, notes + _notes(
        regimes, deep, settings))
  print(f"[{NUMBER}] trace+compile, {deep} ...", file=sys.stderr, flush=True)
  m = compile_times(deep, settings)
  measurements.update(m)
  for key in ("record_layers", "record_layers_in", "clipped"):
    target = COMPILE_TARGET if key == "record_layers" else None
    explanation = (
        f"Trace+lower takes {m[f'compile_{key}_lower'].median_s:.2f} s vs "
        f"{m['compile_plain_lower'].median_s:.2f} s plain, XLA compile "
        f"{m[f'compile_{key}_xla'].median_s:.2f} s vs "
        f"{m['compile_plain_xla'].median_s:.2f} s.")
    comparisons.append(h.compare(NUMBER, m, f"compile_{key}", "compile_plain", target,
                                 settings, explanation))
    comparisons.append(h.compare(NUMBER, m, f"compile_{key}_lower", "compile_plain_lower",
                                 None, settings))
    comparisons.append(h.compare(NUMBER, m, f"compile_{key}_xla", "compile_plain_xla",
                                 None, settings))
  return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, _notes(
      regimes, deep, settings))


def _notes(regimes, deep, settings) -> list[str]:
  notes = [
      f"Models: {'; '.join(str(d) for d in regimes)}; trace+compile on {deep}, "
      f"{max(1, settings.compile_rounds // 3)} alternating rounds of fresh `jax.jit`s.",
      "Each variant is a `jax.jit` of a gradient function called in a Python loop with "
      "the same arguments; no buffer is donated.",
      f"Checked before timing: gl.clipped_grad{', jax-privacy' if jax_privacy else ''} "
      f"and vmap(grad) + clip give the same clipped gradient (C = {CLIP}, some examples "
      "clipped); the per-example norms equal vmap(grad)'s; record_layers's gradient "
      "equals plain grad's.",
      ("jax-privacy: " + (f"{jax_privacy.__name__} "
                          f"{importlib.metadata.version('jax-privacy')}" if jax_privacy
                          else f"not measured here ({JAX_PRIVACY_MISSING}); it needs JAX "
                          ">= 0.7.1 and the `bench-peers` extra")),
      ("On a TPU gl.clipped_grad's target is the faster of "
       f"{TPU_CLIPPED_BOUND} x plain and the vmap clip, judged per regime; the checks "
       "compare whole vectors there (default precision, one bfloat16 pass)."
       if settings.device == "tpu" else ""),
  ]
  return [note for note in notes if note]


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
