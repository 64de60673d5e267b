"""`gl.record_layers` finds at least the layers kfac-jax's graph matcher finds.

kfac-jax registers layers automatically by matching patterns in the jaxpr
(`kfac_jax.tag_graph_matcher.auto_register_tags`): dense, conv2d and
scale-and-shift layers, and a generic tag for any other parameter. On the same
small MLP/CNN (Haiku, and plain JAX), every parameter kfac-jax tags must have uses
that `gl.layer_coverage` reports as covered, of the matching kind: a dense or conv2d
tag's kernel a `dense` or `conv` use, its bias and a scale-and-shift tag's
parameters `elementwise` uses.

kfac-jax 0.0.8 runs on JAX 0.8.2, not on 0.10 (the extra `peers` of that set only);
elsewhere these tests are skipped.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from per_example import path_name

import oryx_gradlog as gl

kfac_jax = pytest.importorskip("kfac_jax")
hk = pytest.importorskip("haiku")

B = 4


def _haiku_mlp_cnn():
  def net(images, x):
    y = jnp.mean(jax.nn.relu(hk.Conv2D(3, 3, name="conv")(images)), axis=(1, 2))
    h = jnp.tanh(hk.Linear(4, name="fc1")(x)) + hk.Linear(4, name="fc_img")(y)
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="norm")(h)
    return hk.Linear(2, name="out")(jnp.tanh(h))

  model = hk.without_apply_rng(hk.transform(net))
  images = jax.random.normal(jax.random.PRNGKey(1), (B, 6, 6, 2))
  x = jax.random.normal(jax.random.PRNGKey(2), (B, 5))
  return model.apply, model.init(jax.random.PRNGKey(0), images, x), (images, x)


def _plain_mlp_cnn():
  def apply(p, images, x):
    y = lax.conv_general_dilated(images, p["conv"]["w"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = jnp.mean(jnp.tanh(y), axis=(1, 2))
    h = jnp.tanh(x @ p["fc1"]["w"] + p["fc1"]["b"]) + y @ p["fc_img"]["w"]
    h = h * p["affine"]["scale"] + p["affine"]["shift"]
    return jnp.tanh(h) @ p["out"]["w"]

  key = iter(jax.random.split(jax.random.PRNGKey(0), 8))
  normal = lambda *shape: 0.5 * jax.random.normal(next(key), shape)
  params = {"conv": {"w": normal(3, 3, 2, 3)}, "fc1": {"w": normal(5, 4), "b": normal(4)},
            "fc_img": {"w": normal(3, 4)},
            "affine": {"scale": 1 + normal(4), "shift": normal(4)},
            "out": {"w": normal(4, 2)}}
  images = jax.random.normal(jax.random.PRNGKey(1), (B, 6, 6, 2))
  x = jax.random.normal(jax.random.PRNGKey(2), (B, 5))
  return apply, params, (images, x)


def _kfac_tags(apply, params, batch, targets) -> dict[str, str]:
  """Per parameter path, the kind of layer kfac-jax's automatic registration tags it
  as (`dense`, `conv2d`, `scale_and_shift`, `generic`), or `None` if untagged."""
  def loss(params, data):
    *batch, targets = data
    prediction = apply(params, *batch)
    kfac_jax.register_squared_error_loss(prediction, targets)
    return jnp.mean(jnp.sum((prediction - targets) ** 2, axis=-1))

  tagged = kfac_jax.tag_graph_matcher.auto_register_tags(loss, (params, (*batch, targets)))
  # kfac-jax 0.0.8 keeps the registrations in the TaggedFunction (as it logs them).
  graph = tagged._func_graph  # pylint: disable=protected-access
  labels = tagged._param_labels  # pylint: disable=protected-access
  kinds = []
  for var in graph.params_vars:
    names = labels.get(var, [])
    variants = {re.search(r"tag_variant=([a-z_0-9]+?)(\(\d+\))?[|\]]", n).group(1)
                for n in names}
    assert len(variants) <= 1, names
    kinds.append(variants.pop() if variants else None)
  tree = jax.tree_util.tree_unflatten(graph.params_tree, kinds)
  return {path_name(p): k for p, k in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda v: v is None)[0]}


# What record_layers must call the uses of a parameter kfac-jax tags, by tag kind and
# by whether the parameter is the layer's kernel (rank >= 2).
_EXPECTED = {
    ("dense", True): {"dense"}, ("dense", False): {"elementwise"},
    ("conv2d", True): {"conv"}, ("conv2d", False): {"elementwise"},
    ("scale_and_shift", False): {"elementwise"},
}


@pytest.mark.parametrize("model", [_haiku_mlp_cnn, _plain_mlp_cnn], ids=["haiku", "plain"])
def test_record_layers_finds_every_layer_kfac_jax_finds(model):
  apply, params, batch = model()
  kfac = _kfac_tags(apply, params, batch, jnp.zeros((B, 2)))
  assert {k for k in kfac.values() if k} >= {"dense", "conv2d", "scale_and_shift"}, kfac
  loss = lambda p, *batch: jnp.mean(jnp.sum(apply(p, *batch) ** 2, axis=-1))
  coverage = gl.layer_coverage(loss, params, *batch)
  assert set(coverage.params) == set(kfac)
  for path, kind in kfac.items():
    if kind is None:
      continue
    found = coverage.params[path]
    assert found.covered and found.uses, (path, kind, found)
    kinds = {use.kind for use in found.uses}
    expected = _EXPECTED.get((kind, len(found.shape) >= 2))
    if expected is None:  # kfac-jax's generic tag: any use we cover.
      assert "unsupported" not in kinds, (path, kinds)
    else:
      assert kinds == expected, (path, kind, kinds)
