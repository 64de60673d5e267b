"""Workload 14: `gl.clipped_grad` on three more stock-module architectures vs `vmap`.

Workload 12 measures a decoder; other libraries' models showed `gl.clipped_grad`
slower than a hand-written `vmap` clip on a mixture of experts, a recurrent model
and a batch-norm-in-inference conv net (issue 28). Here are the three, built from
stock Flax NNX modules and nothing marked, each at batch 32, float32:

* `moe`: `nnx.Embed` (vocabulary 256, width 128), an `nnx.Linear` router choosing
  the top 2 of 8 experts per token (`lax.top_k`, softmax gates), each expert an
  `nnx.Linear` 128 -> 256 -> 128 GELU MLP applied to every token and weighted by
  its gate (zero where not chosen), a residual `nnx.LayerNorm`, mean pooling and
  an `nnx.Linear` head over 10 classes; 32 tokens.
* `recurrent`: `nnx.Embed`, an `nnx.RNN` of an `nnx.LSTMCell` and one of an
  `nnx.GRUCell` (width 128, `lax.scan` over 32 tokens, the cells' weights shared
  by every step), the last step's state into an `nnx.Linear` head.
* `conv_bn`: three `nnx.Conv` 3x3 (3 -> 32 -> 64 -> 64 channels, no bias), each
  followed by an `nnx.BatchNorm` reading its running statistics
  (`use_running_average=True`, the statistics set unlike a fresh model's), ReLU
  and 2x2 average pooling, on 32 x 32 x 3 images; global mean pooling and an
  `nnx.Linear` head.

Variants, each a `jax.jit` of a function of `(params, inputs, labels)` called in a
Python loop with the same arguments, nothing donated: `plain` (`jax.grad`, the
floor), `clipped` (`gl.clipped_grad(loss, l2_norm_clip=1.0)`) and `vmap` (a
hand-written `jax.vmap(jax.grad(...))` of one example's loss, clipped per example
and averaged). Before timing, `clipped`'s gradient is checked against `vmap`'s
(some examples clipped). Target: `clipped` no slower than `vmap` (the ratio
`clipped / vmap` <= 1.0).

Run: python benchmarks/bench_architectures.py [--quick]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import _harness as h
import _mlp
from bench_any_model import CLIP, per_example_grads, vmap_clipped
import oryx_gradlog as gl

NUMBER = 14
TITLE = "gl.clipped_grad vs a vmap clip on stock MoE, recurrent and conv+BN models"
TARGET = h.Target(1.0)
# Flax NNX 0.12 holds a list of modules in an `nnx.List`; older NNX in a list.
_List = getattr(nnx, "List", list)


class MoE(nnx.Module):
  """Top-2 of `experts` GELU MLP experts per token, gate-weighted, pooled."""

  def __init__(self, vocab, width, experts, *, rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.router = nnx.Linear(width, experts, rngs=rngs)
    self.up = _List([nnx.Linear(width, 2 * width, rngs=rngs) for _ in range(experts)])
    self.down = _List([nnx.Linear(2 * width, width, rngs=rngs) for _ in range(experts)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, 10, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    scores = self.router(h)
    top, chosen = jax.lax.top_k(scores, 2)
    gates = jnp.sum(jax.nn.one_hot(chosen, scores.shape[-1])
                    * jax.nn.softmax(top)[..., None], axis=-2)
    mixed = sum(gates[..., e:e + 1] * down(jax.nn.gelu(up(h)))
                for e, (up, down) in enumerate(zip(self.up, self.down)))
    return self.head(self.norm(h + mixed).mean(axis=1))


class Recurrent(nnx.Module):
  """An LSTM then a GRU over the tokens; the last state into the head."""

  def __init__(self, vocab, width, *, rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.lstm = nnx.RNN(nnx.LSTMCell(width, width, rngs=rngs))
    self.gru = nnx.RNN(nnx.GRUCell(width, width, rngs=rngs))
    self.head = nnx.Linear(width, 10, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    # Zero initial states passed in: the cells' own initialisers draw from their
    # Rngs, which a traced loss cannot update.
    zeros = jnp.zeros((tokens.shape[0], h.shape[-1]), h.dtype)
    h = self.gru(self.lstm(h, initial_carry=(zeros, zeros)), initial_carry=zeros)
    return self.head(h[:, -1])


class ConvBN(nnx.Module):
  """3x3 convolutions, each with batch norm in inference, ReLU and 2x2 pooling."""

  def __init__(self, channels, *, rngs):
    convs, norms, previous = [], [], 3
    for c in channels:
      convs.append(nnx.Conv(previous, c, (3, 3), use_bias=False, rngs=rngs))
      norms.append(nnx.BatchNorm(c, use_running_average=True, rngs=rngs))
      previous = c
    self.convs, self.norms = _List(convs), _List(norms)
    self.head = nnx.Linear(previous, 10, rngs=rngs)

  def __call__(self, images):
    x = images
    for conv, norm in zip(self.convs, self.norms):
      x = nnx.avg_pool(nnx.relu(norm(conv(x))), (2, 2), strides=(2, 2))
    return self.head(x.mean(axis=(1, 2)))


def model(name: str, batch: int, width: int, seed: int = 0):
  """Returns `(loss, (params, inputs, labels))` for architecture `name`."""
  rngs = nnx.Rngs(seed)
  k_inputs, k_labels, k_stats = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
  if name == "conv_bn":
    module = ConvBN((width // 4, width // 2, width // 2), rngs=rngs)
    inputs = jax.random.normal(k_inputs, (batch, 32, 32, 3))
    for norm, key in zip(module.norms, jax.random.split(k_stats, len(module.norms))):
      k_mean, k_var = jax.random.split(key)
      # New variables: `.value =` warns on Flax 0.12, and `[...] =` fails on 0.10.
      norm.mean = nnx.BatchStat(0.1 * jax.random.normal(k_mean, (norm.num_features,)))
      norm.var = nnx.BatchStat(1.0 + 0.5 * jax.random.uniform(k_var, (norm.num_features,)))
  else:
    module = (MoE(256, width, 8, rngs=rngs) if name == "moe"
              else Recurrent(256, width, rngs=rngs))
    inputs = jax.random.randint(k_inputs, (batch, 32), 0, 256)
  labels = jax.random.randint(k_labels, (batch,), 0, 10)
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(params, inputs, labels):
    logits = nnx.merge(graphdef, params, rest)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, (params, inputs, labels)


def variants(name: str, batch: int, width: int) -> dict[str, h.Variant]:
  loss, args = model(name, batch, width)
  fns = {"plain": jax.grad(loss), "clipped": gl.clipped_grad(loss, l2_norm_clip=CLIP),
         "vmap": vmap_clipped(loss, batch)}
  labels = {"plain": "plain grad", "clipped": "gl.clipped_grad", "vmap": "vmap(grad) + clip"}
  return {key: h.Variant(f"{name}: {labels[key]}", jax.jit(fn), args)
          for key, fn in fns.items()}


def check(name: str, vs: dict[str, h.Variant], batch: int, width: int,
          exact: bool = True) -> None:
  """`gl.clipped_grad` equals the vmap clip (not `exact`, an accelerator's default
  precision: as whole vectors), and the clip bites."""
  _mlp.assert_trees_close(vs["clipped"](), vs["vmap"](), f"{name}: clipped gradient",
                          rtol=1e-3, exact=exact)
  loss, args = model(name, batch, width)
  norms = jax.jit(lambda *a: per_example_grads(loss, batch, *a)[1])(*args)
  assert bool(jnp.any(norms > CLIP)), f"{name}: nothing was clipped"


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Times the three architectures' variants; `sizes` shrinks them for the tests."""
  batch, width = (sizes.batch, sizes.width) if sizes else (8, 32) if settings.quick else (32, 128)
  measurements, comparisons = {}, []
  for name in ("moe", "recurrent", "conv_bn"):
    print(f"[{NUMBER}] {name}, batch {batch}, width {width} ...", file=sys.stderr, flush=True)
    vs = variants(name, batch, width)
    check(name, vs, batch, width, exact=settings.device == "cpu")
    m = h.measure(vs, settings)
    measurements.update({f"{name}_{key}": value for key, value in m.items()})
    comparisons.append(h.compare(NUMBER, m, "clipped", "plain", None, settings))
    comparisons.append(h.compare(NUMBER, m, "vmap", "plain", None, settings))
    comparison = h.compare(NUMBER, m, "clipped", "vmap", TARGET, settings)
    if comparison.status == "MISSED":
      comparison.explanation = h.describe_hlo_difference(m["clipped"], m["vmap"])
    comparisons.append(comparison)
  notes = [
      f"Batch {batch}, width {width}, float32; 32 tokens (MoE, recurrent) or 32 x 32 x 3 "
      "images (conv+BN).",
      "Each variant is a `jax.jit` of a gradient function called in a Python loop with "
      "the same arguments; no buffer is donated.",
      f"Checked before timing: gl.clipped_grad's gradient equals the vmap clip's (C = {CLIP}).",
  ]
  return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
