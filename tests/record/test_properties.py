"""Property tests: the records of random small MLPs equal the perturbation reference.

Hypothesis draws a tanh MLP (depth 1-4, widths 1-8, batch 1-5, float32 or bfloat16)
whose layers are recorded with `record_vjp` (plain or `full=True`) and whose hidden
activations are tapped, and runs it under `jit`, with or without `vmap` for
per-example records. The reference is plain JAX in the same dtype: a zero `delta` added
to each recorded value, differentiated w.r.t. the deltas (also under `jit`, so both
sides round the same way). A second property checks stacking: layers that share one
record name, run by a Python loop or by `lax.scan`, stack their records in forward
order.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oryx_gradlog as gl

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

# bfloat16 keeps 8 bits of mantissa; the two programs may fuse and round differently.
TOLERANCES = {"float32": (1e-5, 1e-6), "bfloat16": (2e-2, 2e-2)}


@st.composite
def mlps(draw, uniform_width=False):
  """`(widths, batch, dtype, seed)` of a random small MLP."""
  depth = draw(st.integers(1, 4))
  if uniform_width:
    widths = (draw(st.integers(1, 8)),) * (depth + 1)
  else:
    widths = tuple(draw(st.lists(st.integers(1, 8), min_size=depth + 1, max_size=depth + 1)))
  return (widths, draw(st.integers(1, 5)), draw(st.sampled_from(["float32", "bfloat16"])),
          draw(st.integers(0, 2**31 - 1)))


def _init(widths, batch, dtype, seed):
  """Random `[(kernel, bias), ...]`, inputs and targets, in `dtype`."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * len(widths) + 2))
  layers = [
      (jax.random.normal(next(keys), (din, dout)) / np.sqrt(din),
       0.1 * jax.random.normal(next(keys), (dout,)))
      for din, dout in itertools.pairwise(widths)
  ]
  x = jax.random.normal(next(keys), (batch, widths[0]))
  t = jax.random.normal(next(keys), (batch, widths[-1]))
  return jax.tree.map(lambda a: a.astype(dtype), (layers, x, t))


def _affine(x, kernel, bias):
  return x @ kernel + bias


def _loss(y, t):
  """Mean over the batch of the squared error; one example's squared error if 1-D."""
  return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))


def _block(h, layer, *, layer_name, act_name, full=False):
  """A recorded hidden layer: `record_vjp` on the affine map, `tap` on the tanh."""
  y = gl.record_vjp(_affine, name=layer_name, full=full)(h, *layer)
  return gl.tap(jnp.tanh(y), name=act_name)


def _mlp(layers, x, *, full):
  """The recorded model: hidden blocks `layer{i}`/`act{i}`, then a recorded output layer."""
  for i, layer in enumerate(layers[:-1]):
    x = _block(x, layer, layer_name=f"layer{i}", act_name=f"act{i}", full=full)
  return gl.record_vjp(_affine, name=f"layer{len(layers) - 1}", full=full)(x, *layers[-1])


def _reference(layers, x, t, final_tanh=False):
  """What each layer's records must be, in plain JAX.

  True computation: zero perturbations of each layer's inputs, output and tanh
  activation, differentiated w.r.t. the deltas.

  Returns:
    Per layer, `(in_cotangents, out_cotangent, act_cotangent, input)`: the cotangents
    of the affine map's (input, kernel, bias), of its output and of its tanh
    activation (zero for an output layer without one, unless `final_tanh`), and the
    layer's input value.
  """
  zeros, inputs, h = [], [], x
  for kernel, bias in layers:
    out = _affine(h, kernel, bias)
    zeros.append(((jnp.zeros_like(h), jnp.zeros_like(kernel), jnp.zeros_like(bias)),
                  jnp.zeros_like(out), jnp.zeros_like(out)))
    inputs.append(h)
    h = jnp.tanh(out)

  def perturbed(deltas):
    h = x
    for i, ((kernel, bias), ((dx, dkernel, dbias), dout, dact)) in enumerate(
        zip(layers, deltas)):
      h = _affine(h + dx, kernel + dkernel, bias + dbias) + dout
      if final_tanh or i < len(layers) - 1:
        h = jnp.tanh(h) + dact
    return _loss(h, t)

  cotangents = jax.grad(perturbed)(zeros)
  return [(*cts, h) for cts, h in zip(cotangents, inputs)]


def _assert_close(actual, expected, dtype):
  rtol, atol = TOLERANCES[dtype]
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype == jnp.dtype(dtype) and a.shape == e.shape, (a, e)
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    scale = max(1.0, float(np.max(np.abs(e), initial=0.0)))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale)


@pytest.mark.slow
@hypothesis.settings(max_examples=16, deadline=None)
@hypothesis.given(mlp=mlps(), per_example=st.booleans(), full=st.booleans())
def test_records_of_random_mlps_equal_the_reference(mlp, per_example, full):
  dtype = mlp[2]
  layers, x, t = _init(*mlp)
  depth = len(layers)

  def loss(layers, x, t):
    return _loss(_mlp(layers, x, full=full), t)

  grad, reference = jax.grad(loss), _reference
  if per_example:
    grad = jax.vmap(grad, in_axes=(None, 0, 0))
    reference = jax.vmap(reference, in_axes=(None, 0, 0))
  grads, records = jax.jit(gl.call_and_reap(grad))(layers, x, t)
  expected = jax.jit(reference)(layers, x, t)

  assert sorted(records) == sorted(
      [f"layer{i}" for i in range(depth)] + [f"act{i}" for i in range(depth - 1)])
  for i, (in_cotangents, out_cotangent, act, h) in enumerate(expected):
    record = records[f"layer{i}"]
    if full:
      assert isinstance(record, gl.VJPRecord)
      # Under vmap the input is per example; the shared kernel and bias are not.
      _assert_close(record.primals, (h, *layers[i]), dtype)
      _assert_close(record.out_cotangent, out_cotangent, dtype)
      record = record.in_cotangents
    _assert_close(record, in_cotangents, dtype)
    if i < depth - 1:
      _assert_close(records[f"act{i}"], act, dtype)
  # The gradients are the records of the parameters (summed over examples when batched).
  _assert_close(grads, [cts[1:] for cts, *_ in expected], dtype)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(mlp=mlps(uniform_width=True), per_example=st.booleans(), scan=st.booleans())
def test_one_name_for_all_layers_stacks_records_in_forward_order(mlp, per_example, scan):
  dtype = mlp[2]
  layers, x, t = _init(*mlp)
  depth = len(layers)
  block = lambda h, layer: _block(h, layer, layer_name="layer", act_name="act")

  def loss(layers, x, t):
    if scan:
      stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
      h, _ = jax.lax.scan(lambda h, layer: (block(h, layer), None), x, stacked)
    else:
      h = x
      for layer in layers:
        h = block(h, layer)
    return _loss(h, t)

  grad, reference = jax.grad(loss), lambda *a: _reference(*a, final_tanh=True)
  if per_example:
    grad = jax.vmap(grad, in_axes=(None, 0, 0))
    reference = jax.vmap(reference, in_axes=(None, 0, 0))
  records = jax.jit(gl.reap(grad))(layers, x, t)
  expected = jax.jit(reference)(layers, x, t)

  # Stacked on a new leading axis in forward order (a scan always stacks its
  # iterations; one Python call is not stacked), then the examples under vmap.
  stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  if not scan and depth == 1:
    stack = lambda trees: trees[0]
  assert sorted(records) == ["act", "layer"]
  _assert_close(records["layer"], stack([cts for cts, *_ in expected]), dtype)
  _assert_close(records["act"], stack([act for _, _, act, _ in expected]), dtype)
