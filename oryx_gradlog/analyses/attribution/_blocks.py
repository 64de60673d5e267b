"""The blocks of influence functions and LoGra's projections, and what one batch
gives each.

A block is one parameter, or a layer's weight with its bias: `block_layout` reads a
`Selection` of layer uses and says which are Kronecker blocks (a dense, convolution
or embedding use, the only use of its parameter, of a view of it, with the bias
added to its output) and which are diagonal (every other parameter).
`block_arrays` gives, for one backward pass's records, each Kronecker block's
layer inputs and output cotangents `(x, g)` (an embedding's ids for `x`) and each
diagonal block's flattened per-example gradients, all of the per-example losses.

Sharp edges:
  * A bias is in its layer's block as a 1 appended to `x` (the last row of the
    block's gradient).
  * Diagonal blocks form each example's gradient of their parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.attribution import _batches
from oryx_gradlog.record._kinds import CONV, DENSE, ELEMENTWISE, EMBED, NORM_KINDS
from oryx_gradlog.record._selection import Selection, collect

KRONECKER, DIAGONAL = "kronecker", "diagonal"
TAG = "gradlog_influence"  # The records' Oryx tag, our own.


def block_layout(selection: Selection) -> tuple[dict, dict]:
  """The blocks of one selection: `{key: (LayerView, bias key or None)}` for the
  Kronecker blocks (a dense, convolution or embedding use, the only use of its
  parameter, of a view of it), `{key: None}` for the diagonal ones (every other
  parameter)."""
  by_position = {}
  for use in selection.uses:
    spec = getattr(use, "spec", None)
    if spec is not None:
      by_position[spec.position] = use
  kronecker, diagonal, taken = {}, {}, set()
  single = lambda key: len(selection.groups.get(key, ())) == 1
  biases = {}
  for use in selection.uses:
    spec = getattr(use, "spec", None)
    if (spec is not None and use.kind == ELEMENTWISE and spec.shifts in by_position
        and single(use.keys[0]) and len(use.keys) == 1):
      biases[spec.shifts] = use.keys[0]
  for use in selection.uses:
    if use.kind not in (DENSE, CONV, EMBED) or len(use.keys) != 1 or not single(use.keys[0]):
      continue
    view = use.view()  # None for an operand that is not a view of its leaf (LoRA's).
    if view is None:
      continue
    spec = getattr(use, "spec", None)
    bias = biases.get(spec.position) if spec is not None and use.kind != EMBED else None
    if bias is not None and selection.groups[bias][0].tied_calls != use.tied_calls:
      bias = None  # A bias shared by calls whose weights are not (or the other way).
    kronecker[use.keys[0]] = (view, bias)
    taken.update(use.keys if bias is None else (*use.keys, bias))
  for key in selection.groups:
    if key not in taken:
      diagonal[key] = None
  return kronecker, diagonal


def _view_arrays(view, bias: str | None, scale: float):
  """`x` `(S, B, T, i(+1))`, `g` `(S, B, T, o)` of the per-example losses."""
  x, g = view.x, scale * view.g
  if bias is not None or view.bias_g is not None:
    x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)
  return x, g


class Layout(NamedTuple):
  """A block's static description: its kind (`KRONECKER`, `EMBED` or `DIAGONAL`),
  its layer's bias (a parameter path) and an embedding's vocabulary."""

  kind: str
  bias: str | None = None
  vocabulary: int = 0


def block_arrays(api: str, records: dict) -> tuple[dict[str, Any], dict[str, Layout]]:
  """Per block of `records`: Kronecker `(x, g)` (an embedding's ids `(S, B, T)` for
  `x`), diagonal `(B, n)` per-example gradients, of the per-example losses; and
  each block's `Layout`."""
  selection = collect(api, records, None, NORM_KINDS)
  scale = float(_common.one_batch_size(api, selection.batch_sizes))
  kronecker, diagonal = block_layout(selection)
  out, layout = {}, {}
  for key, (view, bias) in kronecker.items():
    if view.kind == EMBED:
      layout[key] = Layout(EMBED, None, view.vocabulary)
      out[key] = (view.x, scale * view.g)
    else:
      layout[key] = Layout(KRONECKER, bias)
      out[key] = _view_arrays(view, bias, scale)
  for key in diagonal:
    grad = selection.per_example(key)
    leaves = [v for v in (grad.w, grad.b) if v is not None]
    layout[key] = Layout(DIAGONAL)
    out[key] = scale * jnp.concatenate([v.reshape(v.shape[0], -1) for v in leaves], 1)
  return out, layout


def per_example(layout: Layout, value) -> jax.Array:
  """`(S, B, i, o)`: a Kronecker block's gradient `sum_t a_t g_t^T` of each example
  from its arrays `(x, g)` (an embedding's `a_t` is the one-hot of its id, so its
  rows are scattered into the vocabulary); a diagonal block's `(B, n)` as it is."""
  if layout.kind == DIAGONAL:
    return value
  x, g = value
  if layout.kind == EMBED:
    def scatter(ids, g):
      return jnp.zeros((layout.vocabulary, g.shape[-1]), g.dtype).at[ids].add(g)
    return jax.vmap(jax.vmap(scatter))(x, g)
  return _common.dot("sbti,sbto->sbio", x, g)


def factor_sums(layout: Layout, value) -> list:
  """One batch's sums for a block, as device arrays (traced inside a pass's program):
  `[A, S, positions]` (an embedding's `A` as the `(S, V)` counts of its ids), or a
  diagonal block's `[sum of squares, examples]`."""
  if layout.kind == DIAGONAL:  # Summed in float32 at least (bfloat16 records too).
    value = value.astype(jnp.result_type(value, jnp.float32))
    return [jnp.sum(value * value, axis=0), as_count(value.shape[0])]
  x, g = value
  if layout.kind == EMBED:
    dtype = jnp.result_type(g, jnp.float32)
    count = lambda ids: jnp.zeros(layout.vocabulary, dtype).at[ids.ravel()].add(1)
    a = jax.vmap(count)(x)
  else:
    a = _common.dot("sbti,sbtj->sij", x, x)
  s = _common.dot("sbto,sbtp->sop", g, g)
  return [a, s, as_count(g.shape[1] * g.shape[2])]


def as_count(number: int) -> jax.Array:
  """A count of examples or positions, as a float (the default: float32, float64 with
  x64), summed over batches with the rest: an int32 would overflow past 2**31
  positions; float32 rounds only past 2**24, to a relative 6e-8 of a divisor."""
  return jnp.asarray(float(number))


@functools.partial(jax.jit, donate_argnums=0)
def _added(total, new):
  return jax.tree.map(jnp.add, total, new)


def summed(batch_sums: Iterable) -> Any:
  """The sum of the pytrees `batch_sums` (one per batch, of the same structure),
  kept on the device and read back once, as float64 NumPy arrays; `None` for none.
  The running total's buffers are reused (donated), and at most two batches are in
  flight (`_batches.one_ahead`). (Reading every batch's sums back to add them in
  float64 on the host took 5 s a batch at GPT-2's size on a TPU, the time of 200 of
  its training steps.)"""
  total = None
  for sums in _batches.one_ahead(batch_sums):
    total = sums if total is None else _added(total, sums)
  if total is None:
    return None
  return jax.tree.map(lambda v: np.asarray(v, np.float64), total)


class Gradients:
  """The layer records of one function's backward pass, from `gl.record_layers`
  under a tag of its own (internal)."""

  def __init__(self, api: str, fun: Callable, argnums: int, batch_argnums):
    from oryx_gradlog.record._reap import call_and_reap  # pylint: disable=g-import-not-at-top
    from oryx_gradlog.record.record_layers import recorder  # pylint: disable=g-import-not-at-top
    self.api, self.fun = api, fun
    recorded = recorder(fun, argnums=argnums, batch_argnums=batch_argnums, tag=TAG,
                        api=api)
    self.reaped = call_and_reap(jax.grad(recorded, argnums=argnums), tag=TAG)
    self.argnums, self.batch_argnums = argnums, batch_argnums

  def arrays(self, params, batch: tuple) -> tuple[dict[str, Any], dict[str, Layout]]:
    """`block_arrays` of the records of `batch` (the loss's batch arguments, and any
    others after them). A batch of one example is recorded as two copies of it, and
    the copy dropped (see `_batches`)."""
    args = list(batch)
    args.insert(self.argnums, params)
    _batches.check_call(self.api, self.fun, args)
    positions = _batches.positions(self.argnums, self.batch_argnums, len(args))
    one = _batches.size([args[i] for i in positions]) == 1
    if one:
      args = [_batches.twice(a) if i in positions else a for i, a in enumerate(args)]
    _, records = self.reaped(*args)
    if not records:
      raise ValueError(
          f"{self.api}: no parameter of argnums={self.argnums} meets the batch in the "
          "loss, so no example has a gradient. Check argnums and batch_argnums.")
    out, layout = block_arrays(self.api, records)
    if one:
      out = {key: _first(layout[key], value) for key, value in out.items()}
    return out, layout


def _first(layout: Layout, value):
  """A block's arrays of the first example only."""
  if layout.kind == DIAGONAL:
    return value[:1]
  return tuple(a[:, :1] for a in value)
