"""The embedding kind: whole rows (or columns) of a table gathered at batched ids.

`table[ids]`, `jnp.take`, Equinox's `weight[id]` under vmap (which also indexes the
other axes at starts that a whole-width slice clamps to 0, and keeps the row axis as
size 1), and penzai's `EmbeddingLookup` (a named-axis gather of a transposed table:
the vocabulary on the operand's last axis, the embedding axis first in the output).
Canonically `ids` `(*calls, B, T)` and `g` `(*calls, B, T, d)`, `d` the table's other
axes in order. Example i's gradient scatters the rows of `g_i` into the table rows
its ids name; its squared norm is `sum_{t,s} [id_t == id_s] <g_t, g_s>`.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._canonical import LayerView, as_float, finish, fold_tied
from oryx_gradlog.record._kinds import EMBED
from oryx_gradlog.record.kinds import Kind, register, view_cost


class Embed(Kind):
  name = EMBED
  primitives = (lax.gather_p,)
  sliceable = True

  def recognise(self, eqn, ins, w) -> bool:
    dims = eqn.params["dimension_numbers"]
    operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
    start = tuple(dims.start_index_map)
    if w != 0 or not start:
      return False
    v = start[0]  # The vocabulary axis, indexed by the ids.
    collapsed = tuple(dims.collapsed_slice_dims)
    axis = ins[1].batch
    return (collapsed in ((v,), ())
            and (len(start) == 1 or eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP)
            and not tuple(getattr(dims, "operand_batching_dims", ()))
            and tuple(eqn.params["slice_sizes"]) == tuple(
                1 if a == v else size for a, size in enumerate(operand.shape))
            and indices.shape[-1] == len(start) and axis is not None and axis[1] == 1
            and axis[0] < indices.ndim - 1
            and len(dims.offset_dims) == operand.ndim - len(collapsed))

  def per_example(self, use) -> tuple:
    """`(*calls, B, *table)`: each example's `g` rows scattered into a zero table."""
    n = use.n_calls
    ids, g = canonical(use)
    table_shape, v = use.spec.avals[0].shape, _vocabulary_axis(use)

    def scatter(ids, g):
      return jnp.zeros((table_shape[v], g.shape[-1]), g.dtype).at[ids].add(g)

    fn = jax.vmap(scatter)
    for _ in range(n):
      fn = jax.vmap(fn)
    pe = fn(ids, g)  # (*calls, B, V, d)
    rest = tuple(size for a, size in enumerate(table_shape) if a != v)
    pe = pe.reshape(pe.shape[:n + 2] + rest)
    return (jnp.moveaxis(pe, n + 1, n + 1 + v),)

  def view(self, use) -> LayerView:
    n = use.n_calls
    x, g = canonical(use)
    x, g = x.reshape((-1,) + x.shape[n:]), g.reshape((-1,) + g.shape[n:])
    x, g, stack = fold_tied(x, g, tuple(use.g.shape[:n]), use.tied_calls)
    vocabulary = use.spec.avals[0].shape[_vocabulary_axis(use)]
    return finish(EMBED, x, g, stack, 1, vocabulary, False)

  def cost(self, use, method: str) -> tuple[str, int, int]:
    return view_cost(use.view(), method) or super().cost(use, method)


def _vocabulary_axis(use) -> int:
  return use.spec.params["dimension_numbers"].start_index_map[0]


def canonical(use):
  """`ids` `(*calls, B, T)` and `g` `(*calls, B, T, d)`, out-of-range ids as the
  gather's vjp has them: clamped with `mode="clip"`, else dropped (`g` zero)."""
  spec, n = use.spec, use.n_calls
  dims = spec.params["dimension_numbers"]
  axis, _ = spec.batch[1]
  table_shape = spec.avals[0].shape
  vocabulary = table_shape[_vocabulary_axis(use)]
  ids = use.operands[1][..., 0]
  ids = jnp.moveaxis(ids, n + axis, n)
  calls, batch = ids.shape[:n], ids.shape[n]
  ids = ids.reshape(calls + (batch, -1))
  # The output's axes: the ids' (in order), then the table's slice (in its order).
  offset = tuple(dims.offset_dims)
  rank = use.g.ndim - n
  order = [a for a in range(rank) if a not in offset] + list(offset)
  g = jnp.transpose(use.g, tuple(range(n)) + tuple(n + a for a in order))
  d = math.prod(table_shape) // vocabulary
  g = jnp.moveaxis(g, n + axis, n).reshape(calls + (batch, -1, d))
  if spec.params["mode"] != lax.GatherScatterMode.CLIP:
    # The gather's transpose drops out-of-range ids (fill, and the in-bounds promise
    # of `table[ids]`); only mode="clip" sends them to the row it clamps them to.
    valid = (ids >= 0) & (ids < vocabulary)
    g = jnp.where(valid[..., None], g, 0)
  return jnp.clip(ids, 0, vocabulary - 1), as_float(g)


KIND = register(Embed())
