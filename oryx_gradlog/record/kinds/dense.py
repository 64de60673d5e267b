"""The dense kind: a `dot_general` of a batched input with a parameter.

Dense layers, attention's 3-D kernels, `einsum`s and a tied output projection.
Canonically `x` `(*calls, G, B, T, d_in)` and `g` `(*calls, G, B, T, d_out)`, with G
the product of the `dot_general`'s batch dimensions (independent dense layers,
folded into S), T the positions (the input's free axes other than the batch's),
`d_in` the contracted axes and `d_out` the weight's free axes. Example i's gradient
is `x_i^T g_i`; with one position, `sum_i (x_i^T g_i)^2 = (x^2)^T (g^2)`.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._canonical import LayerView, as_float, dot, finish, fold_tied
from oryx_gradlog.record._kinds import DENSE
from oryx_gradlog.record.kinds import Kind, register, view_cost


class Dense(Kind):
  name = DENSE
  primitives = (lax.dot_general_p,)
  sliceable = True

  def recognise(self, eqn, ins, w) -> bool:
    """A dot_general whose data operand has its batch axis among its free axes."""
    x = 1 - w
    contract, batch_dims = eqn.params["dimension_numbers"]
    axis = ins[x].batch
    return (axis is not None and axis[1] == 1 and axis[0] not in contract[x]
            and axis[0] not in batch_dims[x])

  def data_arg(self, use) -> int:
    return 1 - use.w_arg

  def feature_axes(self, eqn, w: int) -> tuple[int, ...]:
    """The output axes of the weight's free axes: a dot_general's output has its
    batch dimensions, then the left operand's free axes, then the right one's."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    free = lambda i, c, b: [a for a in range(eqn.invars[i].aval.ndim) if a not in c + b]
    n_left = len(free(0, lc, lb))
    n_w = len(free(w, rc if w else lc, rb if w else lb))
    start = len(lb) + (n_left if w == 1 else 0)
    return tuple(range(start, start + n_w))

  def per_example(self, use) -> tuple:
    """`(*calls, B, *w)`: `x_i^T g_i` per example, in the parameter operand's layout.

    Calls that share one weight (an RNN cell's steps) are contracted with the
    positions, as the gradient sums them, and kept as axes of size 1: forming each
    step's gradient first would take `calls` times the memory (a parameter made by
    a chain of functions keeps its calls, which the chain's vjp reads one by one).
    """
    x, g, _ = canonical(use)
    return (layout(use, _contract(use, "gbti,gbto->bgio", x, g), use.n_calls + 1),)

  def weighted(self, use, c) -> tuple | None:
    """`sum_i c_i x_i^T g_i` in one product over the calls that share one weight
    (the use's vjp would form each call's sum first); `None` without such calls."""
    if use.spec.chain is not None or not any(use.tied_calls):
      return None
    x, g, _ = canonical(use)  # (*calls, G, B, T, d); one row an example (`recognise`)
    x = x * c.reshape(c.shape + (1, 1)).astype(jnp.promote_types(x.dtype, jnp.float32))
    total = layout(use, _contract(use, "gbti,gbto->gio", x, g), use.n_calls)
    return (total.astype(use.spec.avals[use.w_arg].dtype),)

  def view(self, use) -> LayerView:
    n = use.n_calls
    x, g, groups = canonical(use)  # (*calls, G, B, T, d); `finish` casts to float32

    def flat(a):  # Groups as the major factor of the features, as `finish` expects.
      a = jnp.moveaxis(a, n, n + 2)  # (*calls, B, T, G, d)
      return a.reshape((math.prod(a.shape[:n]),) + a.shape[n:n + 2] + (-1,))

    x, g, stack = fold_tied(flat(x), flat(g), tuple(use.g.shape[:n]), use.tied_calls)
    return finish(DENSE, x, g, stack, groups, 0, False)

  def sum_of_squares(self, use) -> jax.Array | None:
    """`(*calls, *w)`: `sum_i (x_i^T g_i)^2` with one position per example and no
    shared calls, as `(x^2)^T (g^2)`; else `None`."""
    if any(use.tied_calls):
      return None
    x, g, _ = canonical(use)
    if x.shape[-2] != 1:
      return None
    sq = dot("...gbi,...gbo->...gio", as_float(x[..., 0, :]) ** 2,
             as_float(g[..., 0, :]) ** 2)
    return layout(use, sq, use.n_calls)

  def cost(self, use, method: str) -> tuple[str, int, int]:
    return view_cost(use.view(), method) or super().cost(use, method)


def _contract(use, spec: str, x: jax.Array, g: jax.Array) -> jax.Array:
  """`dot(spec)` of canonical `x` and `g` with the call axes in front; the calls
  that share one weight are summed in the product and kept as axes of size 1."""
  n = use.n_calls
  tied = use.tied_calls if use.spec.chain is None else (False,) * n
  calls = "".join(chr(ord("A") + i) for i in range(n))
  kept = "".join(a for a, t in zip(calls, tied) if not t)
  ins, out = spec.split("->")
  x_in, g_in = ins.split(",")
  q = dot(f"{calls}{x_in},{calls}{g_in}->{kept}{out}", x, g)
  return jnp.expand_dims(q, tuple(i for i, t in enumerate(tied) if t))


def _parts(use):
  spec = use.spec
  w_arg = use.w_arg
  x_arg = 1 - w_arg
  (lc, rc), (lb, rb) = spec.params["dimension_numbers"]
  cx, cw = (lc, rc) if x_arg == 0 else (rc, lc)
  bx_dims, bw_dims = (lb, rb) if x_arg == 0 else (rb, lb)
  x_rank = len(spec.avals[x_arg].shape)
  w_rank = len(spec.avals[w_arg].shape)
  free_x = [a for a in range(x_rank) if a not in cx and a not in bx_dims]
  free_w = [a for a in range(w_rank) if a not in cw and a not in bw_dims]
  return x_arg, tuple(cx), tuple(cw), tuple(bx_dims), tuple(bw_dims), free_x, free_w


def canonical(use):
  """`x` `(*calls, G, B, T, d_in)`, `g` `(*calls, G, B, T, d_out)`, G; in the records'
  dtypes (bfloat16 stays bfloat16: `dot` sums its products in float32, and a
  bfloat16 model's activations are not copied to float32 first)."""
  n = use.n_calls
  x_arg, cx, _, bx_dims, _, free_x, free_w = _parts(use)
  batch_axis = use.spec.batch[x_arg][0]
  rest = [a for a in free_x if a != batch_axis]
  x = use.operands[x_arg]
  x_shape = x.shape[n:]
  x = jnp.transpose(x, tuple(range(n)) + tuple(
      n + a for a in (*bx_dims, batch_axis, *rest, *cx)))
  groups = math.prod(x_shape[a] for a in bx_dims)
  calls = x.shape[:n]
  x = x.reshape(calls + (groups, x_shape[batch_axis], -1, math.prod(
      x_shape[a] for a in cx)))
  nb = len(bx_dims)
  if x_arg == 0:
    x_pos = {a: nb + i for i, a in enumerate(free_x)}
    w_pos = [nb + len(free_x) + i for i in range(len(free_w))]
  else:
    w_pos = [nb + i for i in range(len(free_w))]
    x_pos = {a: nb + len(free_w) + i for i, a in enumerate(free_x)}
  order = (*range(nb), x_pos[batch_axis], *(x_pos[a] for a in rest), *w_pos)
  g = jnp.transpose(use.g, tuple(range(n)) + tuple(n + p for p in order))
  g_shape = use.g.shape[n:]
  g = g.reshape(calls + (groups, x_shape[batch_axis], -1, math.prod(
      g_shape[p] for p in w_pos)))
  return x, g, groups


def layout(use, q: jax.Array, lead: int) -> jax.Array:
  """A canonical `(*lead, G, d_in, d_out)` in the parameter operand's layout."""
  _, _, cw, _, bw_dims, _, free_w = _parts(use)
  w_shape = use.spec.avals[use.w_arg].shape
  order = (*bw_dims, *cw, *free_w)
  q = q.reshape(q.shape[:lead] + tuple(w_shape[a] for a in order))
  inverse = [order.index(a) for a in range(len(w_shape))]
  return jnp.transpose(q, tuple(range(lead)) + tuple(lead + a for a in inverse))


KIND = register(Dense())
