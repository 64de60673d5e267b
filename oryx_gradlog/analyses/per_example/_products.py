"""Each example's gradient against a direction in parameter space, from one backward
pass's records, without forming the per-example gradients.

`<grad l_i, v>` is the change of example i's loss along `v`. It is what TracIn needs
for an optimiser whose step is not the gradient (Adam's preconditioned direction
`P g_q` of a query, `gl.adam_preconditioner`): `<P g_q, g_i>` for every training
example of the step, exactly, at the cost of one product of each layer with `v`
(a jvp of the layer: `x_i (v_w) + v_b` against the cotangent `g_i`).

Sharp edges:
  * Only the recorded layers count, as for `per_example_norms`: `gl.record_layers`
    records every use of every parameter; with hand-marked layers, a parameter used
    elsewhere is left out.
  * One direction per call: `jax.vmap` over a leading axis of directions (queries)
    gives `(n, B)`.
"""

from __future__ import annotations

from typing import Any

import jax

from oryx_gradlog.analyses import _common


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
  split = selection.splitter(api, direction if params is None else params, where)
  total = selection.products(split(direction))
  return _common.loss_scale(reduction, total.shape[0]) * total
