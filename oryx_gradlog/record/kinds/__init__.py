"""Layer kinds of the uses `gl.record_layers` finds: one module each, one table.

A *kind* says what the analyses can do with one use of parameters (the equation
where a parameter meets the batch): how to recognise it, how to form each
example's gradient, its canonical `(S, B, T, d)` view where it has one (Gram-form
norms, K-FAC), a cheap `sum_i grad_i^2` where there is one, and what its per-example
norms cost. Each kind is a module here (`dense`, `conv`, `embed`, `elementwise`,
`generic`) holding all of that, registered in one table keyed by the JAX primitive
objects it recognises, as JAX's own rule tables are:

    RULES[jax.lax.dot_general_p] == (dense.KIND,)

`classify(eqn, ins, w)` asks the kinds registered for the equation's primitive in
turn; a primitive with no entry, or whose kinds all decline, is a `generic` use (the
vjp of that one operation, per example), which is always exact.

Adding a kind (say, a `dynamic_slice` of a table at batched starts):

1. Write `kinds/mykind.py` with a `Kind` subclass: `name` (add it to `_kinds.py`),
   `primitives` (the `jax.lax` primitive objects, or those of `_internals.py`),
   `recognise(eqn, ins, w)` and `per_example(use)`; `view`, `sum_of_squares`,
   `data_arg` and `cost` where the kind has a cheaper form than the generic one,
   `feature_axes` where a bias may be added to its output (`gl.fit_influence` puts
   that bias in the layer's Kronecker block).
2. Register it: `KIND = register(MyKind())` at the end of the module, and import the
   module below.

Nothing else changes: `FoundUse` (`_found.py`), `gl.layer_coverage` and every
analysis read the kind through this table.

Sharp edges:
  * `recognise` sees the equation of the first trace with the walk's `Info` of each
    operand (`ins[i].batch`: the batch axis `(axis, factor)` or `None`): decline
    anything whose per-example rules would not hold, and the use stays generic.
  * The kinds here take one parameter operand and one output; uses of several
    parameter operands are generic.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._canonical import MATERIALIZED, LayerView, moveaxis_batch
from oryx_gradlog.record._canonical import choose_method, costs
from oryx_gradlog.record._kinds import EMBED, GENERIC

RULES: dict[Any, tuple] = {}
BY_NAME: dict[str, Kind] = {}


class Kind:
  """What the analyses do with one kind of use (see the module docstring)."""

  name: str = GENERIC
  primitives: tuple = ()
  # Whether the operation's parameters hold no batch size, so that a use of a slice
  # of the examples binds it as it is (`FoundUse.examples`); a generic use may bind
  # a `broadcast_in_dim` or `reshape` to the whole batch's shape.
  sliceable: bool = False

  def recognise(self, eqn, ins, w: int) -> bool:
    """Whether the equation `eqn` (parameter operand `w`) is a use of this kind."""
    del eqn, ins, w
    return True

  def data_arg(self, use) -> int | None:
    """The data operand a use is linear in (so that `sum_i c_i grad_i` may scale it
    instead of the output cotangent), or `None`."""
    del use
    return None

  def per_example(self, use) -> tuple:
    """Per parameter operand, the per-example gradients `(*calls, B, *w)`: the vjp at
    the cotangent of one example at a time (a few examples at once, so that memory
    stays a few times the output's)."""

    def masked(operands, g, _):
      axis, factor = use.spec.out_batch
      batch = g.shape[axis] // factor
      ws = [operands[i] for i in use.spec.param_args]
      _, vjp = jax.vjp(use.of_w(operands), *ws)
      owner = jnp.arange(g.shape[axis]) // factor
      shape = [1] * g.ndim
      shape[axis] = -1
      one = lambda i: vjp(g * (owner == i).astype(g.dtype).reshape(shape))
      return lax.map(one, jnp.arange(batch), batch_size=min(batch, 8))

    return use.per_call(masked)

  def weighted(self, use, c: jax.Array) -> tuple | None:
    """Per parameter operand, `sum_i c_i grad_i` `(*calls, *w)` where the kind has a
    cheaper form than the use's vjp at `c g` (which `None` asks for)."""
    del use, c
    return None

  def feature_axes(self, eqn, w: int) -> tuple[int, ...] | None:
    """The output's feature axes (those a bias added to the output varies along),
    for kinds whose output has them; `None` otherwise."""
    del eqn, w
    return None

  def view(self, use) -> LayerView | None:
    """The canonical view, or `None` where the kind has none."""
    del use
    return None

  def sum_of_squares(self, use) -> jax.Array | None:
    """`(*calls, *w)`: `sum_i grad_i^2` where a cheap form exists, else `None`."""
    del use
    return None

  def cost(self, use, method: str) -> tuple[str, int, int]:
    """`(method, multiply-adds, floats held)` of the use's per-example norms, alone
    (for `gl.layer_coverage`): here the per-example vjps materialised; a kind with a
    view costs its view where the use has one (`view_cost`)."""
    del method
    batch, w_size, out = _sizes(use)
    return MATERIALIZED, batch * out, batch * (w_size + out)


def _sizes(use) -> tuple[int, int, int]:
  """`(B, parameter operand size over all calls, output size)` of a use."""
  w_size = math.prod(use.spec.avals[use.spec.param_args[0]].shape) * math.prod(
      use.spec.calls)
  return use.batch_size, w_size, math.prod(use.g.shape)


def view_cost(view: LayerView | None, method: str) -> tuple[str, int, int] | None:
  """`(method, multiply-adds, floats)` of the per-example norms of a view (the
  method `"auto"` resolved by `choose_method`), or `None` without a view."""
  if view is None:
    return None
  chosen = choose_method(view, method)
  s, b, t, d_out = view.g.shape
  d_in = 1 if view.kind == EMBED else view.x.shape[3]
  macs, floats = costs(view.kind, b, t, d_in, d_out, view.vocabulary)[chosen]
  return chosen, s * macs, s * floats


def register(kind: Kind) -> Kind:
  """Adds `kind` to the table under each of its primitives; returns it."""
  for primitive in kind.primitives:
    RULES[primitive] = RULES.get(primitive, ()) + (kind,)
  BY_NAME[kind.name] = kind
  return kind


def classify(eqn, ins, w: int) -> str:
  """The kind of a use of one parameter operand `w` with one output."""
  for kind in RULES.get(eqn.primitive, ()):
    if kind.recognise(eqn, ins, w):
      return kind.name
  return GENERIC


def of(name: str) -> Kind:
  """The kind named `name` (`_kinds.py`)."""
  return BY_NAME[name]


__all__ = ("BY_NAME", "Kind", "RULES", "classify", "moveaxis_batch", "of", "register",
           "view_cost")

# The kinds, each registered by its own module.
from oryx_gradlog.record.kinds import generic  # noqa: E402,F401  pylint: disable=g-import-not-at-top
from oryx_gradlog.record.kinds import dense  # noqa: E402,F401  pylint: disable=g-import-not-at-top
from oryx_gradlog.record.kinds import conv  # noqa: E402,F401  pylint: disable=g-import-not-at-top
from oryx_gradlog.record.kinds import embed  # noqa: E402,F401  pylint: disable=g-import-not-at-top
from oryx_gradlog.record.kinds import elementwise  # noqa: E402,F401  pylint: disable=g-import-not-at-top
