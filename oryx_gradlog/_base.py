"""The one `init`/`update` type of the package's stateful transformations.

`running_statistics`, `moving_average`, `dp_noise` and `training_instruments` each
return a `Transform`: a pair of pure functions in optax's order,

* `init(tree) -> state`;
* `update(inputs, state, ...) -> (outputs, state)`: what the transformation makes of
  this step's inputs, and the state with the step folded in.

The statistics only observe: their outputs are their inputs, unchanged, so they sit in
an `optax.chain` beside the optimiser (`optax.chain(gl.running_statistics(), optax.sgd(
0.1))` keeps running statistics of the gradients). DP noise outputs the noisy gradients;
the instruments output their readings.

Sharp edges:
  * The order is optax's (`update(inputs, state)`), not `lax.scan`'s carry-first
    order: in a scan body write `out, state = t.update(x, state)`.
  * `phase` is `None` except for the instruments, whose work depends on the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class Transform(NamedTuple):
  """A stateful transformation: pure `init` and `update`, as optax's
  `GradientTransformation`, which it can stand in for.

  Attributes:
    init: `init(tree) -> state`.
    update: `update(inputs, state, ...) -> (outputs, state)`.
    phase: for a transformation whose work depends on the step (the instruments'
      schedule), `phase(i)` is what the i-th update does, to pass to `update(...,
      phase=)` as a static argument of a jitted step; `None` where every update does
      the same.

  Example:
    >>> import jax.numpy as jnp, optax, oryx_gradlog as gl
    >>> tx = optax.chain(gl.running_statistics(), optax.sgd(0.5))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([2.0, 4.0])}, state)
    >>> updates["w"], state[0]["w"].max
    (Array([-1., -2.], dtype=float32), Array([2., 4.], dtype=float32))
  """

  init: Callable[..., Any]
  update: Callable[..., tuple[Any, Any]]
  phase: Callable[[int], str] | None = None


def check_order(api: str, state_type: type, first: Any) -> None:
  """Raises for `update(state, inputs)`, the order before `Transform`."""
  if any(isinstance(leaf, state_type) for leaf in jax.tree.leaves(
      first, is_leaf=lambda node: isinstance(node, state_type))):
    raise TypeError(
        f"{api}: the first argument is the state; update takes (inputs, state) in optax's "
        f"order and returns (outputs, state). Write `outputs, state = t.update(inputs, "
        f"state, ...)`.")
