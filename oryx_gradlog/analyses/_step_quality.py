"""Step quality: where the step landed on a local quadratic, and how far it went.

Cockpit's alpha (Schneider et al. 2021, after Mahsereci and Hennig's probabilistic
line search): along the update `d = theta_1 - theta_0`, fit a parabola
`p(tau) = a tau^2 + b tau + c` by least squares to the losses `f0, f1` and the
directional derivatives `s0 = <grad f(theta_0), d>`, `s1 = <grad f(theta_1), d>` at
`tau = 0, 1`. Its minimum is at `tau* = -b / (2a)`; the step landed at `tau = 1`, so

    alpha = 1 / tau* - 1 = -2a / b - 1,

0 when the step went to the minimum, -1 when it did not move (tiny steps tend to
-1), 1 when it overshot to the point of equal loss on the other side. For a
quadratic loss the fit is exact.

`update_size` is `|d|`; the distance from the initial parameters is
`update_size(params - initial)`.

Sharp edges:
  * The fit is unweighted (Cockpit weights by the batch noise of each observation).
  * In training, `f0, s0` and `f1, s1` come from consecutive batches, so alpha holds
    their noise; average it over steps.
  * Without positive curvature (`a <= 0`) along the step there is no minimum: NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Rows: p(0) = c, p'(0) = b, p(1) = a + b + c, p'(1) = 2a + b; columns (a, b, c).
_FIT = np.linalg.pinv(np.array([[0, 0, 1], [0, 1, 0], [1, 1, 1], [2, 1, 0]], np.float64))


def step_alpha(loss_0: jax.Array, slope_0: jax.Array, loss_1: jax.Array,
               slope_1: jax.Array) -> jax.Array:
  """Returns Cockpit's alpha from the losses and slopes at both ends of a step.

  Args:
    loss_0: the loss before the step.
    slope_0: `<grad f(theta_0), d>`, the directional derivative along the update `d`.
    loss_1: the loss after the step.
    slope_1: `<grad f(theta_1), d>`.

  Returns:
    A scalar in about `[-1, 1]` (see the module docstring); NaN without curvature.

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> # f(t) = (t - 1)^2 along the step: it lands on the minimum.
    >>> gl.step_alpha(jnp.float32(1), jnp.float32(-2), jnp.float32(0), jnp.float32(0))
    Array(0., dtype=float32)
  """
  observed = jnp.stack([jnp.asarray(v, jnp.float32) for v in (loss_0, slope_0, loss_1, slope_1)])
  a, b, _ = jnp.asarray(_FIT, jnp.float32) @ observed
  return jnp.where(a > 0, -2 * a / b - 1, jnp.nan)


def update_size(update: Any) -> jax.Array:
  """Returns the L2 norm of a pytree (an update, or `params - initial`).

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> gl.update_size({"w": jnp.array([3.0]), "b": jnp.array([4.0])})
    Array(5., dtype=float32)
  """
  return jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(update)))


def inner_products(pairs: dict[str, tuple[Any, Any]]) -> dict[str, jax.Array]:
  """`{name: <a, b>}` for pairs of pytrees of one structure, in one pass per leaf.

  One variadic `lax.reduce` per leaf reads the leaf of every pair once, summing each
  row (all axes but the first) into a partial sum; the partials are then summed. XLA's
  CPU backend runs each reduction as a loop of its own: for the five sums of the
  economy preset over 4 x 512^2 parameters this measured 2.1 ms against 3.1 ms for
  separate `jnp.sum`s (JAX 0.5.0) and 1.7 against 1.9 ms (JAX 0.10.2), and rows keep
  float32 sums over large leaves as accurate as `jnp.sum` (one sequential sum over
  a 4096^2 leaf was off by 3e-4).
  """
  names = list(pairs)
  leaves = [(jax.tree.leaves(a), jax.tree.leaves(b)) for a, b in pairs.values()]
  totals = [jnp.zeros((), jnp.float32)] * len(names)
  add = lambda x, y: tuple(u + v for u, v in zip(x, y))
  for i in range(len(leaves[0][0])):
    operands = [jnp.asarray(a[i], jnp.float32) * jnp.asarray(b[i], jnp.float32)
                for a, b in leaves]
    rows = tuple(range(1, operands[0].ndim)) or tuple(range(operands[0].ndim))
    partials = jax.lax.reduce(operands, [jnp.float32(0)] * len(names), add, rows)
    totals = [t + jnp.sum(v) for t, v in zip(totals, partials)]
  return dict(zip(names, totals))
