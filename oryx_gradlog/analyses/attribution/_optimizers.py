"""The step directions of optimisers other than plain SGD, for TracIn.

TracIn credits a training example z with the change its step made to a query's
loss: `-<g(q), delta(z)>` to first order, `delta(z)` z's part of the update. Plain
SGD moves by `-lr g(z) / B`, so the score is `lr <g(q), g(z)>` (`gl.tracin` from
projected gradients). Adam moves by `-lr P m_hat` with the diagonal preconditioner
`P = 1 / (sqrt(nu_hat) + eps)`; z's gradient enters `m` once with weight `(1 - b1)`
and is carried by the following steps with weights `b1^k`, which sum to one, so with
`P` and `lr` taken at the step that saw z (they change slowly) its part of the total
update is `-lr P g(z) / B`, and the score `lr <P g(q), g(z)>` (LESS, Xia et al.
2024). `adam_preconditioner` reads `P` from optax's state; the products `<P g(q),
g(z)>` of every training example of a step come from its records
(`gl.per_example_products`), logged at each step and summed by
`gl.tracin(run, products=...)`.

Sharp edges:
  * The momentum's spread over later steps and the change of `P` between them are
    taken as the step's own (the usual approximation, exact for `b1 = 0` and a
    preconditioner that changes slowly).
  * `b2` and `eps` are not in optax's state: pass those the optimiser was made with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _is_adam_state(node: Any) -> bool:
  return all(hasattr(node, field) for field in ("count", "mu", "nu"))


def adam_preconditioner(opt_state: Any, *, b2: float = 0.999, eps: float = 1e-8,
                        eps_root: float = 0.0) -> Any:
  """Returns Adam's diagonal preconditioner `1 / (sqrt(nu_hat + eps_root) + eps)`.

  From the state of an optax optimiser that scales by Adam (`optax.adam`,
  `optax.adamw`, or a chain holding `optax.scale_by_adam`), after the step's update:
  the preconditioner that step applied, shaped like the parameters. Multiply a
  query's gradient by it to get the direction whose products with the step's
  per-example gradients are its TracIn scores (see the module docstring).

  Args:
    opt_state: the optimiser's state, holding one `ScaleByAdamState`.
    b2, eps, eps_root: the optimiser's (optax's defaults).

  Returns:
    A tree shaped like the parameters.

  Example:
    >>> import jax.numpy as jnp, optax, oryx_gradlog as gl
    >>> opt = optax.adam(0.1)
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> _, state = opt.update({"w": jnp.array([2.0, -0.5])}, state)
    >>> gl.adam_preconditioner(state)["w"].round(3)  # 1 / (|g| + eps) after one step
    Array([0.5, 2. ], dtype=float32)
  """
  api = "adam_preconditioner"
  states = [node for node in jax.tree.leaves(opt_state, is_leaf=_is_adam_state)
            if _is_adam_state(node)]
  if len(states) != 1:
    raise ValueError(
        f"{api}: the optimiser state holds {len(states)} Adam states (optax's "
        "ScaleByAdamState, with count, mu and nu); pass the state of one optimiser "
        "that scales by Adam (optax.adam, optax.adamw), or its ScaleByAdamState.")
  state = states[0]
  count = jnp.asarray(state.count)
  # Before any update nu is 0 and so is the correction: the preconditioner is 1/eps.
  correction = jnp.where(count > 0, 1 - b2 ** count.astype(jnp.float32), 1.0)
  return jax.tree.map(lambda nu: 1 / (jnp.sqrt(nu / correction.astype(nu.dtype)
                                                + eps_root) + eps), state.nu)
