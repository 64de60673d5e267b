"""The model every benchmark differentiates: a tanh MLP, in each recording style.

`layers` dense layers `h -> tanh(h @ w + b)` of `width` units on a `(batch, width)`
float32 input, and a mean squared error. The same network is written once per way
of getting at its backward pass, so that the benchmarks compare like with like:

* `loss_plain`: nothing recorded.
* `loss_record_vjp`: every layer wrapped with `gl.record_vjp`, recording the
  cotangents of its inputs `(dL/dx, dL/dw, dL/db)` as `layerNN`.
* `loss_tap`: every layer output tapped, recording `dL/dh` as `hNN`.
* `loss_perturb_outputs` / `loss_perturb_inputs`: the zero-perturbation trick; a
  zero delta added to each layer's output (the values `loss_tap` records) or input
  (the `dL/dx` of `loss_record_vjp`), differentiated along with the parameters.
* `loss_host_callback`: each layer output passed through a `custom_vjp` identity
  whose backward rule sends `dL/dh` to a host list with a callback.

Record names are zero-padded (`h00`, `h01`, ...), so the sorted record dict is in
layer order.

Sharp edges:
  * `record_vjp` records `dL/dx` of the first layer, the network input, which a
    gradient with respect to the parameters alone never forms: one extra matmul.
  * `record_vjp`'s `dL/dw` and `dL/db` records are the very arrays that the
    gradient returns; returning one array twice from a `jit` costs a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import oryx_gradlog as gl


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The network and batch.

  Attributes:
    layers: number of dense layers.
    width: units per layer (and input features).
    batch: examples per step.
  """

  layers: int = 4
  width: int = 512
  batch: int = 128

  def __str__(self) -> str:
    return f"{self.layers} x {self.width} MLP, batch {self.batch}, float32"


FULL = Sizes()
QUICK = Sizes(layers=4, width=256, batch=64)


def init(sizes: Sizes, seed: int = 0) -> tuple[list[dict[str, jax.Array]], jax.Array, jax.Array]:
  """Returns `(params, x, target)` for `sizes`, on the default device."""
  keys = jax.random.split(jax.random.PRNGKey(seed), sizes.layers + 2)
  scale = 1.0 / np.sqrt(sizes.width)
  params = [
      {
          "w": scale * jax.random.normal(k, (sizes.width, sizes.width), jnp.float32),
          "b": jnp.zeros((sizes.width,), jnp.float32),
      }
      for k in keys[:-2]
  ]
  x = jax.random.normal(keys[-2], (sizes.batch, sizes.width), jnp.float32)
  target = jax.random.normal(keys[-1], (sizes.batch, sizes.width), jnp.float32)
  return params, x, target


def dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.tanh(x @ w + b)


def _mse(h: jax.Array, target: jax.Array) -> jax.Array:
  return jnp.mean((h - target) ** 2)


def record_name(i: int) -> str:
  return f"layer{i:02d}"


def tap_name(i: int) -> str:
  return f"h{i:02d}"


@functools.cache
def _recorded_dense(i: int) -> Callable[..., jax.Array]:
  return gl.record_vjp(dense, name=record_name(i))


def loss_plain(params, x, target):
  h = x
  for layer in params:
    h = dense(h, layer["w"], layer["b"])
  return _mse(h, target)


def loss_record_vjp(params, x, target):
  h = x
  for i, layer in enumerate(params):
    h = _recorded_dense(i)(h, layer["w"], layer["b"])
  return _mse(h, target)


@functools.cache
def _recorded_input(i: int) -> Callable[..., jax.Array]:
  return gl.record_vjp(dense, name=record_name(i), argnums=0)


def loss_record_inputs(params, x, target):
  """`record_vjp(..., argnums=0)` of each layer: records `(dL/dx, None, None)`."""
  h = x
  for i, layer in enumerate(params):
    h = _recorded_input(i)(h, layer["w"], layer["b"])
  return _mse(h, target)


def loss_tap(params, x, target):
  h = x
  for i, layer in enumerate(params):
    h = gl.tap(dense(h, layer["w"], layer["b"]), name=tap_name(i))
  return _mse(h, target)


def loss_perturb_outputs(params, deltas, x, target):
  h = x
  for layer, delta in zip(params, deltas):
    h = dense(h, layer["w"], layer["b"]) + delta
  return _mse(h, target)


def loss_perturb_inputs(params, deltas, x, target):
  h = x
  for layer, delta in zip(params, deltas):
    h = dense(h + delta, layer["w"], layer["b"])
  return _mse(h, target)


def zero_deltas(sizes: Sizes) -> list[jax.Array]:
  return [jnp.zeros((sizes.batch, sizes.width), jnp.float32) for _ in range(sizes.layers)]


class HostLog:
  """A host-side list of `(name, numpy array)` that backward callbacks append to."""

  def __init__(self):
    self.entries: list[tuple[str, np.ndarray]] = []

  def append(self, name: str, value: Any) -> None:
    self.entries.append((name, np.array(value)))  # A copy: the buffer is XLA's.

  def clear(self) -> None:
    self.entries.clear()

  def by_name(self) -> dict[str, np.ndarray]:
    return dict(sorted(self.entries))


def host_callback_identity(name: str, log: HostLog, kind: str) -> Callable[[Any], Any]:
  """Returns an identity whose backward rule sends the cotangent to `log`.

  Args:
    name: the name the cotangent is logged under.
    log: the host list.
    kind: `"debug"` for `jax.debug.callback`, `"io"` for
      `jax.experimental.io_callback` (unordered).

  Returns:
    A `custom_vjp` identity.
  """
  send = functools.partial(log.append, name)

  @jax.custom_vjp
  def identity(x):
    return x

  def identity_fwd(x):
    return x, None

  def identity_bwd(_, g):
    if kind == "debug":
      jax.debug.callback(send, g)
    else:
      io_callback(send, None, g, ordered=False)
    return (g,)

  identity.defvjp(identity_fwd, identity_bwd)
  return identity


def make_loss_host_callback(layers: int, log: HostLog, kind: str) -> Callable[..., jax.Array]:
  """Returns the loss with a host-callback identity after each layer."""
  identities = [host_callback_identity(tap_name(i), log, kind) for i in range(layers)]

  def loss_host_callback(params, x, target):
    h = x
    for identity, layer in zip(identities, params):
      h = identity(dense(h, layer["w"], layer["b"]))
    return _mse(h, target)

  return loss_host_callback


def plain_step() -> Callable[..., Any]:
  """`jax.jit(jax.grad(loss_plain))`: the parameter gradients."""
  return jax.jit(jax.grad(loss_plain))


def record_vjp_step() -> Callable[..., Any]:
  """The parameter gradients and every layer's `record_vjp` records."""
  return jax.jit(gl.call_and_reap(jax.grad(loss_record_vjp)))


def tap_step() -> Callable[..., Any]:
  """The parameter gradients and every layer output's `tap` record."""
  return jax.jit(gl.call_and_reap(jax.grad(loss_tap)))


# On an accelerator a float32 product at the default precision is one bfloat16 pass
# (~1e-3 relative): values are compared as whole vectors there, to this bound.
ACCELERATOR_BOUND = 3e-2


def relative_error(actual: Any, expected: Any) -> float:
  """`|a - e| / |e|` of the two pytrees' leaves as one vector, in float64."""
  flat = lambda tree: np.concatenate([np.ravel(np.asarray(v, np.float64))
                                      for v in jax.tree.leaves(tree)])
  a, e = flat(actual), flat(expected)
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def assert_trees_close(actual: Any, expected: Any, what: str, rtol: float = 2e-4,
                       exact: bool = True) -> None:
  """Raises `AssertionError` naming `what` unless the two pytrees match: element by
  element to `rtol`, or, not `exact` (an accelerator's default precision, bfloat16),
  as whole vectors to `ACCELERATOR_BOUND`."""
  if jax.tree.structure(actual) != jax.tree.structure(expected):
    raise AssertionError(
        f"{what}: tree structures differ: {jax.tree.structure(actual)} vs "
        f"{jax.tree.structure(expected)}"
    )
  if not exact:
    error = relative_error(actual, expected)
    if not error <= ACCELERATOR_BOUND:
      raise AssertionError(f"{what}: relative error {error:.2e} > {ACCELERATOR_BOUND}")
    return
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=1e-6, err_msg=what
    )
