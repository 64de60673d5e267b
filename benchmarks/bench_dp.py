"""Workload 9: a DP-SGD step from one backward pass vs the plain gradient.

Side by side, on two models (float32):

* a 4 x 512 tanh MLP with biases, batch 128 (the sizes of `_mlp.FULL`);
* a transformer block: pre-norm attention (4 heads) and a 4x MLP, both layer norms
  with scale and offset, batch 32, 64 tokens, width 256;

five variants of one step:

* `plain`: `jax.jit(jax.grad(loss))` of the unmarked model: the floor.
* `one_pass`: `gl.reap(jax.grad(loss))` of the marked model, then `gl.per_example_clip`
  and `gl.to_param_tree`: the clipped mean gradient of every parameter (the target).
* `one_pass_noise`: the same plus `gl.add_dp_noise` (a whole DP-SGD gradient).
* `ghost`: the two-pass method of Opacus's ghost clipping and the old example 06:
  one backward pass for the norms (`gl.per_example_norms`), a second of the loss
  reweighted by the clip factors.
* `vmap`: `jax.vmap(jax.grad(example_loss))`, then clipping and the mean (jax-privacy's
  way).

Before timing, every variant's clipped gradients are checked against `vmap`'s.

Run: python benchmarks/bench_dp.py [--quick]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 9
TITLE = "DP-SGD step: one-pass clipped gradients vs plain grad, two-pass ghost, vmap"
TARGETS = {"mlp": h.Target(1.10), "transformer": h.Target(1.30)}
CLIP, SIGMA = 1.0, 1.0


def _plain_dense(x, w, b=None, *, name):
  del name
  y = x @ w
  return y if b is None else y + b


def _plain_layer_norm(x, scale, offset, *, name):
  del name
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  normalised = centred * jax.lax.rsqrt(jnp.mean(centred**2, axis=-1, keepdims=True) + 1e-6)
  return normalised * scale + offset


MARKED = {"dense": gl.dense, "layer_norm": gl.layer_norm}
PLAIN = {"dense": _plain_dense, "layer_norm": _plain_layer_norm}


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  params: dict
  data: tuple
  example_loss: Callable  # (layers, params, *example) -> loss (or (batch,) losses).
  where: dict


def mlp_model(sizes: _mlp.Sizes) -> Model:
  params, x, target = _mlp.init(sizes)
  params = {f"fc{i}": layer for i, layer in enumerate(params)}

  def example_loss(layers, params, x, y):
    for i in range(sizes.layers):
      x = jnp.tanh(layers["dense"](x, params[f"fc{i}"]["w"], params[f"fc{i}"]["b"],
                                   name=f"fc{i}"))
    return jnp.mean((x - y) ** 2, axis=-1)

  where = {name: {"w": f"{name}.w", "b": f"{name}.b"} for name in params}
  return Model(str(sizes), params, (x, target), example_loss, where)


def transformer_model(batch=32, tokens=64, width=256, heads=4, seed=1) -> Model:
  keys = jax.random.split(jax.random.PRNGKey(seed), 8)
  scale = 1 / np.sqrt(width)
  params = {
      **{n: {"w": jax.random.normal(k, (width, width)) * scale}
         for n, k in zip(("q", "k", "v"), keys[:3])},
      "o": {"w": jax.random.normal(keys[3], (width, width)) * scale, "b": jnp.zeros(width)},
      "up": {"w": jax.random.normal(keys[4], (width, 4 * width)) * scale,
             "b": jnp.zeros(4 * width)},
      "down": {"w": jax.random.normal(keys[5], (4 * width, width)) * scale / 2,
               "b": jnp.zeros(width)},
      **{n: {"w": jnp.ones(width), "b": jnp.zeros(width)} for n in ("ln1", "ln2")},
  }

  def example_loss(layers, params, x, y):
    dense, norm = layers["dense"], layers["layer_norm"]
    a = norm(x, params["ln1"]["w"], params["ln1"]["b"], name="ln1")
    q, k, v = (dense(a, params[n]["w"], name=n).reshape(a.shape[:-1] + (heads, -1))
               for n in ("q", "k", "v"))
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
    attended = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), v)
    x = x + dense(attended.reshape(x.shape), params["o"]["w"], params["o"]["b"], name="o")
    m = norm(x, params["ln2"]["w"], params["ln2"]["b"], name="ln2")
    up = dense(m, params["up"]["w"], params["up"]["b"], name="up")
    x = x + dense(jax.nn.gelu(up), params["down"]["w"], params["down"]["b"], name="down")
    return jnp.mean(jnp.sum((x - y) ** 2, axis=-1), axis=-1)

  x = jax.random.normal(keys[6], (batch, tokens, width))
  y = jax.random.normal(keys[7], (batch, tokens, width))
  where = {name: {f: f"{name}.{f}" for f in layer} for name, layer in params.items()}
  return Model(f"transformer block, batch {batch}, {tokens} tokens, width {width}, float32",
               params, (x, y), example_loss, where)


def steps(model: Model) -> dict[str, Callable]:
  """The five variants, as functions of `(params, *data)`."""
  def loss(layers):
    return lambda params, *data: jnp.mean(model.example_loss(layers, params, *data))

  def plain(params, *data):
    return jax.grad(loss(PLAIN))(params, *data)

  def clipped(params, *data):
    records = gl.reap(jax.grad(loss(MARKED)))(params, *data)
    return gl.per_example_clip(records, l2_norm_clip=CLIP)

  def one_pass(params, *data):
    return gl.to_param_tree(clipped(params, *data).layers, params, model.where)

  def one_pass_noise(params, *data):
    noisy = gl.add_dp_noise(clipped(params, *data), jax.random.PRNGKey(0),
                            noise_multiplier=SIGMA)
    return gl.to_param_tree(noisy.layers, params, model.where)

  def ghost(params, *data):
    records = gl.reap(jax.grad(loss(MARKED)))(params, *data)
    factors = jax.lax.stop_gradient(jnp.minimum(
        1.0, CLIP / jnp.maximum(gl.per_example_norms(records).norms, 1e-12)))
    reweighted = lambda p: jnp.mean(factors * model.example_loss(PLAIN, p, *data))
    return jax.grad(reweighted)(params)

  def vmapped(params, *data):
    example = lambda p, *d: model.example_loss(PLAIN, p, *d)
    in_axes = (None,) + (0,) * len(data)
    per_example = jax.vmap(jax.grad(example), in_axes=in_axes)(params, *data)
    leaves = jax.tree.leaves(per_example)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in leaves))
    factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms, 1e-12))
    return jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / g.shape[0], per_example)

  return {"plain": plain, "one_pass": one_pass, "one_pass_noise": one_pass_noise,
          "ghost": ghost, "vmap": vmapped}


LABELS = {
    "plain": "plain grad",
    "one_pass": "one-pass clipped grads",
    "one_pass_noise": "one-pass clipped grads + noise",
    "ghost": "two-pass ghost clipping",
    "vmap": "vmap(grad) clipping",
}


def variants(model: Model, tag: str) -> dict[str, h.Variant]:
  args = (model.params, *model.data)
  return {key: h.Variant(f"{tag}: {LABELS[key]}", jax.jit(fn), args)
          for key, fn in steps(model).items()}


def check(vs: dict[str, h.Variant], exact: bool = True) -> None:
  """The clipped gradients of every variant equal vmap's (and clip something); not
  `exact` (an accelerator's default precision), as whole vectors."""
  expected = vs["vmap"]()
  for key in ("one_pass", "ghost"):
    _mlp.assert_trees_close(vs[key](), expected, f"{key}: clipped gradients", rtol=1e-3,
                            exact=exact)
  plain = vs["plain"]()
  assert any(not np.allclose(a, b, rtol=1e-3) for a, b in zip(
      jax.tree.leaves(expected), jax.tree.leaves(plain))), "nothing was clipped"


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  if settings.quick:
    block = transformer_model(batch=max(2, sizes.batch // 8), tokens=16,
                              width=max(16, sizes.width // 8), heads=2)
  else:
    block = transformer_model()
  models = {"mlp": ("MLP", mlp_model(sizes)), "transformer": ("block", block)}
  measurements, comparisons = {}, []
  for key, (tag, model) in models.items():
    vs = variants(model, tag)
    check(vs, exact=settings.device == "cpu")
    m = h.measure(vs, settings)
    measurements.update({f"{key}_{name}": value for name, value in m.items()})
    for name in ("one_pass", "one_pass_noise", "ghost", "vmap"):
      target = TARGETS[key] if name == "one_pass" else None
      comparison = h.compare(NUMBER, m, name, "plain", target, settings)
      if comparison.status == "MISSED":
        comparison.explanation = h.describe_hlo_difference(m[name], m["plain"])
      comparisons.append(comparison)
  notes = [f"Models: {models['mlp'][1].name}; {models['transformer'][1].name}. Checked "
           "before timing: one-pass and two-pass clipped gradients equal the vmap(grad) "
           f"clipping reference (C = {CLIP}, some examples clipped). Noise: sigma = {SIGMA}."]
  return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
