"""Records under data parallelism over 8 CPU devices: jit with NamedSharding, shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from jax.experimental.shard_map import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import oryx_gradlog as gl

BATCH, WIDTH = 16, 4


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8, "conftest.py asks XLA for 8 CPU devices"
  return Mesh(np.array(jax.devices()), ("data",))


dense = gl.record_vjp(lambda x, w: jnp.tanh(x @ w), name="dense")


def loss(w, x):
  h = gl.tap(dense(x, w), name="h")
  return jnp.mean(jnp.sin(h) ** 2)


def _data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  return jax.random.normal(k1, (WIDTH, WIDTH)), jax.random.normal(k2, (BATCH, WIDTH))


def _single_device_reference(w, x):
  """Plain JAX on one device: perturb h and the inputs of dense."""
  def perturbed(w, x, d):
    h = jnp.tanh((x + d["x"]) @ (w + d["w"])) + d["h"]
    return jnp.mean(jnp.sin(h) ** 2)
  zeros = {"x": jnp.zeros_like(x), "w": jnp.zeros_like(w), "h": jnp.zeros((BATCH, WIDTH))}
  cts = jax.grad(perturbed, argnums=2)(w, x, zeros)
  return jax.grad(loss)(w, x), {"dense": (cts["x"], cts["w"]), "h": cts["h"]}


def test_jit_with_named_sharding_keeps_records_sharded_like_activations(mesh):
  w, x = _data()
  replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  step = jax.jit(gl.call_and_reap(jax.grad(loss)), in_shardings=(replicated, by_example))
  grads, records = step(w, x)
  expected_grads, expected = _single_device_reference(w, x)
  assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
  assert_trees_close(records, expected, rtol=1e-5, atol=1e-6)
  # Per-example records stay split over the devices, like x and h: no gather.
  for record in (records["h"], records["dense"][0]):
    assert record.sharding.is_equivalent_to(by_example, record.ndim)
    assert len(record.addressable_shards) == 8
    assert record.addressable_shards[0].data.shape == (BATCH // 8, WIDTH)


def test_sharded_jit_inside_the_reap(mesh):
  w, x = _data()
  replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  inner = jax.jit(jax.grad(loss), in_shardings=(replicated, by_example))
  grads, records = gl.call_and_reap(inner)(w, x)
  expected_grads, expected = _single_device_reference(w, x)
  assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
  assert_trees_close(records, expected, rtol=1e-5, atol=1e-6)
  assert records["h"].sharding.is_equivalent_to(by_example, 2)


def test_data_parallel_training_matches_one_device(mesh):
  w, x = _data()
  replicated, by_example = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def train(w, x):
    def step(w, _):
      grads, records = gl.call_and_reap(jax.grad(loss))(w, x)
      return w - 0.5 * grads, records
    return jax.lax.scan(step, w, None, length=3)

  sharded = jax.jit(train, in_shardings=(replicated, by_example))
  (w_sharded, records_sharded), (w_single, records_single) = sharded(w, x), jax.jit(train)(w, x)
  assert_trees_close(w_sharded, w_single, rtol=1e-5, atol=1e-6)
  assert_trees_close(records_sharded, records_single, rtol=1e-5, atol=1e-6)
  assert records_sharded["h"].shape == (3, BATCH, WIDTH)  # (step, example, ...)


def test_shard_map_with_the_reap_inside_the_per_shard_function(mesh):
  w, x = _data()

  def per_shard(w, x):
    # Each shard differentiates its part of the mean; psum gives the global gradient.
    local = lambda w, x: loss(w, x) * x.shape[0] / BATCH
    grads, records = gl.call_and_reap(jax.grad(local))(w, x)
    return jax.lax.psum(grads, "data"), records

  specs = {"dense": (P("data"), P("data")), "h": P("data")}
  step = jax.jit(shard_map(per_shard, mesh, in_specs=(P(), P("data")), out_specs=(P(), specs)))
  grads, records = step(w, x)
  expected_grads, expected = _single_device_reference(w, x)
  assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
  assert_trees_close(records["h"], expected["h"], rtol=1e-5, atol=1e-6)
  assert_trees_close(records["dense"][0], expected["dense"][0], rtol=1e-5, atol=1e-6)
  # The weight's cotangent is per shard (its psum is the gradient's share): stacked by shard.
  per_shard_w = records["dense"][1].reshape(8, WIDTH, WIDTH)
  assert_trees_close(per_shard_w.sum(0), expected["dense"][1], rtol=1e-5, atol=1e-5)
  assert records["h"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_shard_map_with_the_reap_outside_is_a_clear_error(mesh):
  w, x = _data()
  sharded_loss = shard_map(lambda w, x: jax.lax.psum(loss(w, x), "data"), mesh,
                           in_specs=(P(), P("data")), out_specs=P())
  with pytest.raises(ValueError, match=r"call_and_reap: record '(dense|h)' is made inside a "
                     r"shard_map body by a reap outside it.*Reap inside the per-shard function"):
    jax.jit(gl.call_and_reap(jax.grad(sharded_loss)))(w, x)
