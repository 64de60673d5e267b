"""Records under data parallelism over 8 CPU devices: jit with NamedSharding, shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, eight_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import oryx_gradlog as gl

BATCH, WIDTH = 16, 4

if hasattr(jax, "shard_map"):  # JAX >= 0.6.
  shard_map = jax.shard_map
else:
  from jax.experimental.shard_map import shard_map


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(eight_devices()), ("data",))


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
  zeros = {"x": jnp.zeros_like(x), "w": jnp.zeros_like(w), "h": jnp.zeros((BATCH, WIDTH))}
  local = lambda w, x: loss(w, x) * x.shape[0] / BATCH  # This shard's part of the mean.

  def per_shard(w, x, d):
    grads, records = gl.call_and_reap(jax.grad(local))(w, x)
    # Plain JAX in the same shard_map: its gradient, and the zero-perturbation
    # cotangents. A replicated input's cotangent is whatever this JAX's shard_map
    # makes it (per shard before JAX 0.7, summed over shards with varying types).
    def perturbed(d):
      h = jnp.tanh((x + d["x"]) @ (w + d["w"])) + d["h"]
      return jnp.mean(jnp.sin(h) ** 2) * x.shape[0] / BATCH
    plain = jax.grad(local)(w, x), jax.grad(perturbed)(d)
    return jax.lax.psum((grads, plain[0]), "data"), records, plain[1]

  specs = {"dense": (P("data"), P("data")), "h": P("data")}
  d_specs = {"x": P("data"), "w": P("data"), "h": P("data")}
  step = jax.jit(shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data"), d_specs | {"w": P()}),
                           out_specs=(P(), specs, d_specs)))
  (grads, plain_grads), records, cts = step(w, x, zeros)
  assert_trees_close(grads, plain_grads, rtol=1e-5, atol=1e-6)
  assert_trees_close(records, {"dense": (cts["x"], cts["w"]), "h": cts["h"]},
                     rtol=1e-5, atol=1e-6)
  # Per-example records match one device holding the whole batch.
  _, expected = _single_device_reference(w, x)
  assert_trees_close(records["h"], expected["h"], rtol=1e-5, atol=1e-6)
  assert_trees_close(records["dense"][0], expected["dense"][0], rtol=1e-5, atol=1e-6)
  assert records["h"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shard_map_with_the_reap_outside_is_a_clear_error(mesh, jit):
  w, x = _data()
  sharded_loss = shard_map(lambda w, x: jax.lax.psum(loss(w, x), "data"), mesh=mesh,
                           in_specs=(P(), P("data")), out_specs=P())
  reaped = gl.call_and_reap(jax.grad(sharded_loss))
  with pytest.raises(ValueError, match=r"call_and_reap: record '(dense|h)' is made inside a "
                     r"shard_map body by a reap outside it.*Reap inside the per-shard function"):
    (jax.jit(reaped) if jit else reaped)(w, x)


def test_shard_map_with_record_sites_and_no_reap_is_plain_jax(mesh):
  w, x = _data()
  body = lambda w, x: jax.lax.psum(loss(w, x) * x.shape[0] / BATCH, "data")
  sharded_loss = shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  grads = jax.jit(jax.grad(sharded_loss))(w, x)
  expected_grads, _ = _single_device_reference(w, x)
  assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
