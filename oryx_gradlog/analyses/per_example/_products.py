"""Each example's gradient against a direction in parameter space, from one backward
pass's records, without forming the per-example gradients; and against its own
preconditioned gradient.

`<grad l_i, v>` is the change of example i's loss along `v`. It is what TracIn needs
for an optimiser whose step is not the gradient (Adam's preconditioned direction
`P g_q` of a query, `gl.adam_preconditioner`): `<P g_q, g_i>` for every training
example of the step, exactly, at the cost of one product of each layer with `v`
(a jvp of the layer: `x_i (v_w) + v_b` against the cotangent `g_i`).
`per_example_self_products` gives `<grad l_i, P grad l_i>` for a diagonal `P`, what
TracIn's self-influence sums under Adam; it forms each layer's per-example gradients
(`P` weighs each of their elements).

Sharp edges:
  * Only the recorded layers count, as for `per_example_norms`: `gl.record_layers`
    records every use of every parameter; with hand-marked layers, a parameter used
    elsewhere is left out.
  * One direction per call: `jax.vmap` over a leading axis of directions (queries)
    gives `(n, B)`.
  * `per_example_self_products` holds one layer's per-example gradients at a time,
    `B` times its parameters (in float32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.analyses import _common
from oryx_gradlog.record._canonical import as_float

# The way out where a hand-marked layer's weight is not among the tree's leaves.
_PASS_PARAMS = ("pass params=, the parameters the step took (inside the jitted step, "
                "where its leaves are the recorded weights)")


def per_example_products(records: dict[str, Any], direction: Any, *,
                         reduction: str = "mean", params: Any = None,
                         where: Any = None) -> jax.Array:
  """Returns `(B,)`: each example's loss gradient against `direction`, `<grad l_i, v>`.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns, of the batch loss's
      backward pass (`gl.record_layers`, or hand-marked layers).
    direction: a tree shaped like the parameters the gradient was taken at.
    reduction: `"mean"` if the loss is `mean_i l_i`, `"sum"` if `sum_i l_i`; the
      products are those of the gradients of `l_i` either way.
    params: the parameters the gradient was taken at; needed only for hand-marked
      layers, to find each layer's weight among them (as the instruments do).
    where: for hand-marked layers, a tree shaped like `params` naming each leaf's
      layer, `"NAME.w"` / `"NAME.b"` (as for `gl.to_param_tree`), where the leaves
      cannot be found by identity.

  Returns:
    A `(B,)` array.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    >>> params, x = {"w": jnp.ones((3, 1)) / 3}, jnp.arange(6.0).reshape(2, 3)
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
    >>> v = {"w": jnp.array([[1.0], [0.0], [0.0]])}
    >>> per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x[:, None])
    >>> bool(jnp.allclose(gl.per_example_products(records, v),
    ...                   per_example["w"][:, 0, 0]))
    True
  """
  api = "per_example_products"
  selection = _common.select(api, records, reduction=reduction, names=None, tied=())
  split = selection.splitter(api, direction if params is None else params, where,
                             _PASS_PARAMS)
  total = selection.products(split(direction))
  return _common.loss_scale(reduction, total.shape[0]) * total


def per_example_self_products(records: dict[str, Any], preconditioner: Any, *,
                              reduction: str = "mean", params: Any = None,
                              where: Any = None) -> jax.Array:
  """Returns `(B,)`: each example's loss gradient against itself, preconditioned,
  `<grad l_i, P grad l_i>`.

  `P` is diagonal, a tree shaped like the parameters (Adam's, from
  `gl.adam_preconditioner`); all ones gives the squared per-example norms. Logged at
  every step of an Adam run, `lr_t` times these summed over the steps that saw an
  example is its TracIn self-influence (`gl.tracin_self_influence(run,
  self_products=...)`), as `per_example_products` gives the scores of queries.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns, of the batch loss's
      backward pass (`gl.record_layers`, or hand-marked layers).
    preconditioner: a tree shaped like the parameters the gradient was taken at, of
      non-negative weights.
    reduction: `"mean"` if the loss is `mean_i l_i`, `"sum"` if `sum_i l_i`; the
      products are those of the gradients of `l_i` either way.
    params, where: for hand-marked layers, as for `gl.per_example_products`.

  Returns:
    A `(B,)` array.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.sum((x @ p["w"] + p["b"]) ** 2, axis=-1))
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(params, jnp.eye(2))
    >>> ones = jax.tree.map(jnp.ones_like, params)  # P = 1: the squared norms
    >>> squares = gl.per_example_self_products(records, ones)
    >>> bool(jnp.allclose(squares, gl.per_example_norms(records).norms ** 2))
    True
  """
  api = "per_example_self_products"
  selection = _common.select(api, records, reduction=reduction, names=None, tied=())
  weights = selection.splitter(api, preconditioner if params is None else params,
                               where, _PASS_PARAMS)(preconditioner)
  total = None
  for key in selection.groups:
    formed, weight_of = selection.per_example(key), weights[key]
    for grads, weight in ((formed.w, weight_of.w), (formed.b, weight_of.b)):
      if grads is None:
        continue
      if grads.shape[1:] != weight.shape:
        raise ValueError(
            f"{api}: the per-example gradients of {key!r} are {grads.shape} (batch "
            f"first) but its preconditioner is {weight.shape}; pass a preconditioner "
            "shaped like the parameters the gradient was taken at.")
      term = jnp.sum((jnp.square(as_float(grads)) * weight).reshape(grads.shape[0], -1),
                     axis=1)
      total = term if total is None else total + term
  return _common.loss_scale(reduction, total.shape[0]) ** 2 * total
