"""The layer view: the canonical form of a layer, and the uses found in a jaxpr.

Two kinds of record describe a layer. A hand-marked layer (`gl.dense`, `gl.conv2d`,
`gl.embed`, `gl.layer_norm`) records a `LayerInputs` (`x`, `w`, `b`, kind, options);
a use that `gl.record_layers` found in a jaxpr records a `LayerUse` (the operands of
the operation where parameters meet the batch, and a static `UseSpec`). Both are
read as *layer uses* with one interface (`FoundUse` here, `MarkedUse` in
`_marked.py`), which `_selection.collect` hands to every analysis:

* `keys`, the result keys a use contributes to (parameter paths; a hand-marked
  record's name), `kind` (`_kinds.py`), `batch_size`;
* `view()`, the canonical `LayerView` `(S, B, T, d)` of a layer that is dense over
  positions: S stacked calls (and feature groups), B examples, T positions (tokens,
  output pixels of a convolution, whose input becomes its patches, and calls that
  share one weight), d features, or `None` where the use has none. Per-example
  gradient norms, K-FAC factors and the Gram forms of the batch-size tests are
  computed from it;
* `weighted_grads(c)`, `per_example_grads()`, `inner_products(v)`,
  `sum_of_squares()`: `sum_i c_i grad_i` (one vjp), each example's gradient
  (materialised), `<grad_i, v>` (one jvp) and `sum_i grad_i^2` where a cheap form
  exists, by key as `LayerParams`.

A found use computes these through the operation itself and the map from the
operand's space to the parameters' (through the views and chain that made the
operand).

Layouts. A hand-marked record is `(*calls, batch, *positions, features)`; a found
use's operands are `(*calls, *operand)` with the batch axis where its `UseSpec`
says. Calls are the stacked iterations of enclosing scans (and repeated calls of one
name); a found use knows which of its calls are a `scan` over stacked parameters
("stacked": the calls have their own weights) and which reuse one weight ("tied").

Sharp edges:
  * Views are read from records as the reap returns them, inside any vmap or scan
    that made them; a vmap outside the reap adds axes that would be taken for calls.
  * A found use's per-example gradients are formed (materialised) where no Gram
    form exists or a parameter has several uses; `gl.layer_coverage` says where.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._kinds import CONV, DENSE, ELEMENTWISE, EMBED
from oryx_gradlog.record._layers import HIGHEST, LayerInputs, WEIGHT_RANK
from oryx_gradlog.record._record import VJPRecord
from oryx_gradlog.record._record_layers import LayerUse, Lineage


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class LayerParams:
  """A per-parameter quantity of one layer, shaped like its parameters.

  Attributes:
    w: like the weight, `(*calls, d_in, d_out)` for a dense layer (the kernel, table
      or layer-norm scale for the other layer kinds; the parameter itself for a
      parameter path of `gl.record_layers`).
    b: like the bias (or layer-norm offset), or `None` for a layer without one (and
      for a parameter path).
  """

  w: jax.Array
  b: jax.Array | None

  def __add__(self, other: LayerParams) -> LayerParams:
    b = (self.b if other.b is None else other.b if self.b is None
         else self.b + other.b)
    return LayerParams(self.w + other.w, b)


@dataclasses.dataclass(frozen=True)
class LayerView:
  """A layer record as `(S, B, T, d)` arrays (internal; not a pytree).

  Attributes:
    kind: the layer kind (`"dense"` for convolutions and found dense uses too, once
      they are in this form; `"embed"`, `"layer_norm"`, `"conv2d"`).
    x: `(S, B, T, d_in)` inputs per position (patches for a convolution, the
      normalised input for a layer norm); token ids `(S, B, T)` for an embedding.
    g: `(S, B, T, d_out)` output cotangents per position.
    bias_g: `(S, B, d_out)` sums of `g` over positions if the layer has a bias.
    stack_shape: the call axes `S` was flattened from (`()` when tied).
    groups: feature groups (convolutions; batch dimensions of a `dot_general`),
      folded into `S` after `stack_shape`.
    vocabulary: the embedding table's number of rows.
  """

  kind: str
  x: jax.Array
  g: jax.Array
  bias_g: jax.Array | None
  stack_shape: tuple
  groups: int = 1
  vocabulary: int = 0

  @property
  def batch_size(self) -> int:
    return self.g.shape[1]


def is_layer_record(record: Any) -> bool:
  """Whether `record` was made by a layer helper (`dense`, `conv2d`, `embed`, ...)."""
  return (isinstance(record, VJPRecord) and isinstance(record.primals, tuple)
          and len(record.primals) == 1 and isinstance(record.primals[0], LayerInputs))


def is_found_record(record: Any) -> bool:
  """Whether `record` is a use that `record_layers` found."""
  return (isinstance(record, VJPRecord) and isinstance(record.primals, tuple)
          and len(record.primals) == 1 and isinstance(record.primals[0], LayerUse))


def call_axes(record: VJPRecord) -> int:
  """The number of leading call axes of a layer record (hand-marked or found)."""
  layer = record.primals[0]
  if isinstance(layer, LayerUse):
    return len(layer.spec.calls)
  return layer.w.ndim - WEIGHT_RANK[layer.kind]


def as_float(x: jax.Array) -> jax.Array:
  """`x` in at least float32."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ----------------------------------------------------------------------------------
# The canonical view.


def finish(kind, x, g, stack, groups, vocabulary, has_bias) -> LayerView:
  """Casts to float, adds the bias sums and folds feature groups into S."""
  g = as_float(g)
  if kind != EMBED:
    x = as_float(x)
  bias_g = jnp.sum(g, axis=2) if has_bias else None
  if groups > 1:  # Groups are independent dense layers: fold them into S.
    s, b, t = g.shape[:3]
    x = jnp.moveaxis(x.reshape(s, b, t, groups, -1), 3, 1).reshape(s * groups, b, t, -1)
    g = jnp.moveaxis(g.reshape(s, b, t, groups, -1), 3, 1).reshape(s * groups, b, t, -1)
  return LayerView(kind, x, g, bias_g, tuple(stack), groups, vocabulary)


def fold_tied(x, g, stack, tied_calls):
  """Moves the calls that share one weight into positions: `(S, B, T, d)` arrays
  whose S was flattened from `stack`, to S over the stacked calls only."""
  if not any(tied_calls):
    return x, g, stack
  keep = tuple(n for n, t in zip(stack, tied_calls) if not t)
  fold = tuple(n for n, t in zip(stack, tied_calls) if t)
  order = [i for i, t in enumerate(tied_calls) if not t] + [
      i for i, t in enumerate(tied_calls) if t]

  def fold_one(a):
    a = a.reshape(stack + a.shape[1:])
    a = jnp.transpose(a, order + list(range(len(stack), a.ndim)))
    k, f = len(keep), len(fold)
    a = a.reshape((math.prod(keep),) + (math.prod(fold),) + a.shape[k + f:])
    a = jnp.moveaxis(a, 1, 2)  # (S, B, calls, T, ...)
    return a.reshape(a.shape[:2] + (-1,) + a.shape[4:])

  return fold_one(x), fold_one(g), keep


def conv_patches(x, w_shape, g, spec, options, n, lead):
  """Patches of the input and cotangents per output pixel, `(S, B, T, d)`.

  `x` is `(*calls, *lead axes, C and spatial axes...)` laid out by `spec` over its
  last axes; the first lead axis is the example axis (the rest, and the conv's own N
  axis, count as positions). For a found convolution `lead` is 1 and N holds the
  batch (of size `B * k` where k examples... are merged).
  """
  rank = len(w_shape)
  m = n + lead - 1  # Axes before the conv's own N axis.
  x = jnp.transpose(x, tuple(range(m)) + tuple(m + a for a in spec.lhs_spec))
  g = jnp.transpose(g, tuple(range(m)) + tuple(m + a for a in spec.out_spec))
  filter_shape = tuple(w_shape[a] for a in spec.rhs_spec[2:])
  canonical = ("NC" + "HWDXYZ"[:rank - 2], "OI" + "HWDXYZ"[:rank - 2],
               "NC" + "HWDXYZ"[:rank - 2])
  patches = lax.conv_general_dilated_patches(
      x.reshape((-1,) + x.shape[m + 1:]), filter_shape, options["window_strides"],
      options["padding"], options["lhs_dilation"], options["rhs_dilation"],
      canonical, precision=HIGHEST)
  if patches.shape[2:] != g.shape[m + 2:]:
    raise ValueError(
        f"the patches of a convolution's input have spatial shape {patches.shape[2:]} "
        f"but its output cotangent has {g.shape[m + 2:]}.")
  stack = x.shape[:n]
  size = math.prod(stack)
  batch = x.shape[n] if lead > 1 else x.shape[n] // options.get("merged", 1)
  patches = patches.reshape(patches.shape[:2] + (-1,))
  patches = jnp.swapaxes(patches, 1, 2).reshape(size, batch, -1, patches.shape[1])
  g = g.reshape(g.shape[:m + 2] + (-1,))
  g = jnp.swapaxes(g, -1, -2).reshape(size, batch, -1, g.shape[m + 1])
  return patches, g


# ----------------------------------------------------------------------------------
# Found uses.


def _moveaxis_batch(a, n, axis, factor):
  """`a` `(*calls, ...)` with its batch axis (of size B * factor, examples outer) at
  `n + axis`: returns `(*calls, B, factor, rest...)`."""
  a = jnp.moveaxis(a, n + axis, n)
  size = a.shape[n]
  return a.reshape(a.shape[:n] + (size // factor, factor) + a.shape[n + 1:])


@dataclasses.dataclass(frozen=True)
class FoundUse:
  """One use found by `record_layers`, from its record (internal).

  Attributes:
    name: the record name.
    spec: the use's `UseSpec`.
    operands: the operands, `(*calls, *operand)`.
    chain_inputs: the inputs of the function of parameters that made the parameter
      operand (`(*calls, *input)`), or `()`.
    g: the output cotangent, `(*calls, *output)`.
  """

  name: str
  spec: Any
  operands: tuple
  chain_inputs: tuple
  g: Any

  @classmethod
  def of(cls, name: str, record: VJPRecord) -> FoundUse:
    use = record.primals[0]
    out = use.spec.avals[-1]
    extra = 0
    if isinstance(record.out_cotangent, jax.Array) and out is not None:
      extra = jnp.ndim(record.out_cotangent) - len(use.spec.calls) - len(out.shape)
    if extra:
      raise ValueError(
          f"record {name!r} (found by gl.record_layers) has {extra} more leading axes "
          "than the scans around its use. Call the analyses on the records of one call "
          "of the recorded function, inside any vmap or scan that made them.")
    return cls(name, use.spec, use.operands, use.chain_inputs, record.out_cotangent)

  @property
  def n_calls(self) -> int:
    return len(self.spec.calls)

  @property
  def w_arg(self) -> int:
    (w,) = self.spec.param_args
    return w

  @property
  def batch_size(self) -> int:
    axis, factor = self.spec.out_batch
    return self.g.shape[self.n_calls + axis] // factor

  @property
  def tied_calls(self) -> tuple[bool, ...]:
    """Per call axis, whether the calls share one weight."""
    lineages = (self.spec.lineages if self.spec.chain is None
                else [l for l in self.spec.chain.inputs if l is not None])
    kinds = lineages[0].calls if lineages else ()
    return tuple(k == "tied" for k in kinds) if len(kinds) == self.n_calls else (
        (False,) * self.n_calls)

  @property
  def simple(self) -> bool:
    """Whether the operand is a view that keeps its parameter's per-example norms."""
    return (self.spec.chain is None and len(self.spec.param_args) == 1
            and self.spec.lineages[0].isometric)

  @property
  def kind(self) -> str:
    return self.spec.kind

  @property
  def keys(self) -> tuple[str, ...]:
    """The parameter paths this use reads: its result keys."""
    return self.spec.paths or (self.name,)

  @property
  def keeps_calls(self) -> bool:
    """Results are per parameter path: the calls are summed into the parameter."""
    return False

  def values(self) -> None:
    """A found use holds no parameter values of its own (the analyses take `params`)."""
    return None

  # The interface every layer use has (`MarkedUse` too), by result key.
  def weighted_grads(self, c: jax.Array) -> dict[str, LayerParams]:
    """Per parameter path, `sum_i c_i grad_i` (of the recorded loss)."""
    return {path: LayerParams(grad, None)
            for path, grad in self.to_params(self.weighted(c), lead=0).items()}

  def per_example_grads(self) -> dict[str, LayerParams]:
    """Per parameter path, each example's gradient (of the recorded loss), `(B, *w)`."""
    return {path: LayerParams(grad, None)
            for path, grad in self.to_params(self.per_example(), lead=1).items()}

  def inner_products(self, directions: dict[str, LayerParams]) -> jax.Array:
    """`(B,)`: `<grad_i, v>` (of the recorded loss), `v` by parameter path."""
    return self.products(self.from_params({p: d.w for p, d in directions.items()}))

  def sum_of_squares(self, chunk_size: int | None = None) -> dict[str, LayerParams] | None:
    """`sum_i grad_i^2` (of the recorded loss) of a dense use of a view of one leaf
    with one position per example, as `(x^2)^T (g^2)`; else `None`."""
    del chunk_size
    square = self.dense_sum_of_squares() if self.simple else None
    if square is None:
      return None
    # Views of one leaf carry squares as they carry values.
    return {path: LayerParams(value, None)
            for path, value in self.to_params([square], lead=0).items()}

  # Per call, the use as a function of its parameter operand(s).
  def _per_call(self, fn):
    """`fn(operands, g, chain_inputs)` vmapped over the call axes."""
    for _ in range(self.n_calls):
      fn = jax.vmap(fn)
    return fn(self.operands, self.g, self.chain_inputs)

  def _of_w(self, operands):
    def apply(*ws):
      ops = list(operands)
      for i, w in zip(self.spec.param_args, ws):
        ops[i] = w
      return self.spec.apply(ops)
    return apply

  def _example_weights(self, c, a, batch):
    """`c` (B,) shaped to multiply the per-call `a` along its batch axis `batch`."""
    axis, factor = batch
    c = jnp.repeat(c, factor) if factor > 1 else c
    shape = [1] * a.ndim
    shape[axis] = -1
    return c.reshape(shape).astype(a.dtype)

  def weighted(self, c: jax.Array) -> tuple:
    """Per parameter operand, `sum_i c_i (dl_i/dy_i) dy_i/dw` (the recorded loss's
    scale), `(*calls, *w)`: the operation's vjp at the cotangent `c g`.

    A dense or convolution use is linear in its data operand too, so `c` scales
    whichever of the data operand and `g` is smaller (`sum_i c_i x_i^T g_i =
    (c x)^T g`); uses that read one input (query, key and value) then scale one copy.
    """
    x_arg = {DENSE: 1 - self.spec.param_args[0], CONV: 0}.get(self.spec.kind)

    def fn(operands, g, _):
      ws = [operands[i] for i in self.spec.param_args]
      if x_arg is not None and jnp.size(operands[x_arg]) <= jnp.size(g):
        operands = list(operands)
        x = operands[x_arg]
        operands[x_arg] = self._example_weights(c, x, self.spec.batch[x_arg]) * x
        _, vjp = jax.vjp(self._of_w(operands), *ws)
        return vjp(g)
      _, vjp = jax.vjp(self._of_w(operands), *ws)
      return vjp(self._example_weights(c, g, self.spec.out_batch) * g)
    return self._per_call(fn)

  def products(self, directions: Sequence[jax.Array]) -> jax.Array:
    """`(B,)`: `<dl/dy_i, J_i v>` summed over calls, `v` per parameter operand
    `(*calls, *w)` (the recorded loss's scale)."""
    axis, factor = self.spec.out_batch

    def fn(operands, g, _, v):
      ws = [operands[i] for i in self.spec.param_args]
      _, tangent = jax.jvp(self._of_w(operands), ws, [t.astype(w.dtype) for t, w in zip(v, ws)])
      p = as_float(g) * as_float(tangent)
      p = jnp.moveaxis(p, axis, 0)
      return jnp.sum(p.reshape(p.shape[0] // factor, -1), axis=1)

    for _ in range(self.n_calls):
      fn = jax.vmap(fn)
    out = fn(self.operands, self.g, self.chain_inputs, tuple(directions))
    return jnp.sum(out.reshape(-1, out.shape[-1]), axis=0)

  def per_example(self) -> tuple:
    """Per parameter operand, the per-example gradients `(B, *calls, *w)` (of the
    recorded loss), formed."""
    kind = self.spec.kind
    if kind == DENSE:
      grads = (self._dense_per_example(),)
    elif kind == EMBED:
      grads = (self._embed_per_example(),)
    elif kind == ELEMENTWISE:
      grads = (self._per_call(self._elementwise_per_example),)
    elif kind == CONV:
      grads = (self._per_call(self._sliced_per_example),)
    else:
      grads = self._per_call(self._masked_per_example)
    n = self.n_calls
    return tuple(jnp.moveaxis(g, n, 0) for g in grads)  # (*calls, B, ...) -> (B, ...)

  def _elementwise_per_example(self, operands, g, _):
    """An element-wise operation (or a broadcast) of the parameter: the vjp with
    respect to the parameter broadcast to the output's shape, summed per example
    over the axes it was broadcast along."""
    w = operands[self.w_arg]
    if self.spec.primitive.name == "broadcast_in_dim":
      shape = [1] * g.ndim  # The parameter with the output's rank.
      for axis, size in zip(self.spec.params["broadcast_dimensions"], jnp.shape(w)):
        shape[axis] = size
      ct = g
    else:  # Operands of the same rank, or a scalar.
      shape = list(jnp.shape(w)) or [1] * g.ndim
      _, vjp = jax.vjp(self._of_w(operands), jnp.broadcast_to(w, g.shape))
      (ct,) = vjp(g)
    axis, factor = self.spec.out_batch
    broadcast = [a for a in range(g.ndim) if a != axis and shape[a] == 1 and g.shape[a] != 1]
    ct = jnp.sum(ct, axis=tuple(broadcast), keepdims=True)
    ct = _moveaxis_batch(ct, 0, axis, factor).sum(1)  # (B, rest with 1 at axis...)
    return ct.reshape((ct.shape[0],) + tuple(jnp.shape(w)))

  def _masked_per_example(self, operands, g, _):
    """Any operation: the vjp at the cotangent of one example at a time (a few
    examples at once, so that memory stays a few times the output's)."""
    axis, factor = self.spec.out_batch
    batch = g.shape[axis] // factor
    ws = [operands[i] for i in self.spec.param_args]
    _, vjp = jax.vjp(self._of_w(operands), *ws)
    owner = jnp.arange(g.shape[axis]) // factor
    shape = [1] * g.ndim
    shape[axis] = -1
    one = lambda i: vjp(g * (owner == i).astype(g.dtype).reshape(shape))
    return lax.map(one, jnp.arange(batch), batch_size=min(batch, 8))

  def _sliced_per_example(self, operands, g, _):
    """A convolution: the vjp of each example's own slice of the batch."""
    axis, factor = self.spec.batch[0]
    x = _moveaxis_batch(operands[0], 0, axis, factor)  # (B, k, ...)
    out_axis, _ = self.spec.out_batch
    gg = _moveaxis_batch(g, 0, out_axis, factor)
    w = operands[1]

    def one(x_i, g_i):
      x_i = jnp.moveaxis(x_i, 0, axis)
      g_i = jnp.moveaxis(g_i, 0, out_axis)
      _, vjp = jax.vjp(lambda w: self.spec.apply([x_i, w]), w)
      return vjp(g_i)[0]

    return jax.vmap(one)(x, gg)

  # The canonical (S, B, T, d) views.
  def view(self, force: bool = False) -> LayerView | None:
    """The `LayerView` of a dense, convolution or embedding use whose operand keeps
    its parameter's norms (any such use with `force`), else `None`."""
    if self.spec.kind not in (DENSE, CONV, EMBED) or not (
        self.simple or force):
      return None
    n = self.n_calls
    if self.spec.kind == DENSE:
      x, g, groups = self._dense_canonical()  # (*calls, G, B, T, d)
      # Groups as the major factor of the features, as _finish expects.
      def flat(a):
        a = jnp.moveaxis(a, n, n + 2)  # (*calls, B, T, G, d)
        return a.reshape((math.prod(a.shape[:n]),) + a.shape[n:n + 2] + (-1,))
      x, g = flat(x), flat(g)
      kind, vocabulary = DENSE, 0
    elif self.spec.kind == CONV:
      x, g, groups = self._conv_canonical()
      kind, vocabulary = DENSE, 0
    else:
      x, g = self._embed_canonical()
      x, g = x.reshape((-1,) + x.shape[n:]), g.reshape((-1,) + g.shape[n:])
      groups, kind = 1, EMBED
      vocabulary = self.spec.avals[0].shape[0]
    stack = tuple(self.g.shape[:self.n_calls])
    x, g, stack = fold_tied(x, g, stack, self.tied_calls)
    return finish(kind, x, g, stack, groups, vocabulary, False)

  def _dense_parts(self):
    spec = self.spec
    w_arg = self.w_arg
    x_arg = 1 - w_arg
    (lc, rc), (lb, rb) = spec.params["dimension_numbers"]
    cx, cw = (lc, rc) if x_arg == 0 else (rc, lc)
    bx_dims, bw_dims = (lb, rb) if x_arg == 0 else (rb, lb)
    x_rank = len(spec.avals[x_arg].shape)
    w_rank = len(spec.avals[w_arg].shape)
    free_x = [a for a in range(x_rank) if a not in cx and a not in bx_dims]
    free_w = [a for a in range(w_rank) if a not in cw and a not in bw_dims]
    return x_arg, tuple(cx), tuple(cw), tuple(bx_dims), tuple(bw_dims), free_x, free_w

  def _dense_canonical(self):
    """`x` `(*calls, G, B, T, d_in)`, `g` `(*calls, G, B, T, d_out)`, G."""
    n = self.n_calls
    x_arg, cx, _, bx_dims, _, free_x, free_w = self._dense_parts()
    batch_axis = self.spec.batch[x_arg][0]
    rest = [a for a in free_x if a != batch_axis]
    x = self.operands[x_arg]
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
    g = jnp.transpose(self.g, tuple(range(n)) + tuple(n + p for p in order))
    g_shape = self.g.shape[n:]
    g = g.reshape(calls + (groups, x_shape[batch_axis], -1, math.prod(
        g_shape[p] for p in w_pos)))
    return as_float(x), as_float(g), groups

  def _dense_per_example(self):
    """`(*calls, B, *w)`: `x_i^T g_i` per example, in the parameter operand's layout."""
    x, g, _ = self._dense_canonical()
    pe = jnp.einsum("...gbti,...gbto->...bgio", x, g, precision=HIGHEST)
    return self.dense_layout(pe, self.n_calls + 1)

  def dense_layout(self, q: jax.Array, lead: int) -> jax.Array:
    """A dense use's canonical `(*lead, G, d_in, d_out)` in the operand's layout."""
    _, _, cw, _, bw_dims, _, free_w = self._dense_parts()
    w_shape = self.spec.avals[self.w_arg].shape
    order = (*bw_dims, *cw, *free_w)
    q = q.reshape(q.shape[:lead] + tuple(w_shape[a] for a in order))
    inverse = [order.index(a) for a in range(len(w_shape))]
    return jnp.transpose(q, tuple(range(lead)) + tuple(lead + a for a in inverse))

  def dense_sum_of_squares(self) -> jax.Array | None:
    """`(*calls, *w)`: `sum_i (x_i^T g_i)^2` of a dense use with one position per
    example and no shared calls, as `(x^2)^T (g^2)`; else `None`."""
    if self.spec.kind != DENSE or any(self.tied_calls):
      return None
    x, g, _ = self._dense_canonical()
    if x.shape[-2] != 1:
      return None
    sq = jnp.einsum("...gbi,...gbo->...gio", x[..., 0, :] ** 2, g[..., 0, :] ** 2,
                    precision=HIGHEST)
    return self.dense_layout(sq, self.n_calls)

  def _conv_canonical(self):
    spec = self.spec
    n = self.n_calls
    params = spec.params
    axis, factor = spec.batch[0]
    dims = params["dimension_numbers"]
    options = {
        "window_strides": params["window_strides"], "padding": params["padding"],
        "lhs_dilation": params["lhs_dilation"], "rhs_dilation": params["rhs_dilation"],
        "merged": factor,
    }
    x, g = self.operands[0], self.g
    # Put the examples in a lead axis of their own: N = B * factor, examples outer.
    del axis
    x, g = conv_patches(x, spec.avals[1].shape, g, dims, options, n, 1)
    return x, g, params["feature_group_count"]

  def _embed_canonical(self):
    """`ids` `(*calls, B, T)` and `g` `(*calls, B, T, d)`, with dropped ids' g zero."""
    spec = self.spec
    n = self.n_calls
    axis, _ = spec.batch[1]
    table_shape = spec.avals[0].shape
    ids = self.operands[1][..., 0]
    ids = jnp.moveaxis(ids, n + axis, n)
    calls, batch = ids.shape[:n], ids.shape[n]
    ids = ids.reshape(calls + (batch, -1))
    d = math.prod(table_shape[1:])
    g = jnp.moveaxis(self.g, n + axis, n).reshape(calls + (batch, -1, d))
    valid = (ids >= 0) & (ids < table_shape[0])
    g = jnp.where(valid[..., None], g, 0)
    return jnp.clip(ids, 0, table_shape[0] - 1), as_float(g)

  def _embed_per_example(self):
    n = self.n_calls
    ids, g = self._embed_canonical()
    table_shape = self.spec.avals[0].shape

    def scatter(ids, g):
      return jnp.zeros((table_shape[0], g.shape[-1]), g.dtype).at[ids].add(g)

    fn = jax.vmap(scatter)
    for _ in range(n):
      fn = jax.vmap(fn)
    pe = fn(ids, g)
    return pe.reshape(pe.shape[:n + 1] + tuple(table_shape))

  # From the operand's space to the parameters'.
  def to_params(self, quantities: Sequence[jax.Array], lead: int) -> dict[str, jax.Array]:
    """Maps per-operand quantities `(*lead axes, *calls, *w)` to the parameters.

    Through the chain (its vjp at the recorded inputs) and each input's lineage
    (views transposed, stacked calls merged into the stacked axis, tied calls summed);
    returns `{path: (*lead axes, *param)}`, summed over inputs of one path.
    """
    if self.spec.chain is not None:
      chain = self.spec.chain
      (q,) = quantities

      def pull(inputs, q):
        _, vjp = jax.vjp(chain, *inputs)
        return vjp(q)

      fn = pull
      for _ in range(lead):
        fn = jax.vmap(fn, in_axes=(None, 0))
      for _ in range(self.n_calls):
        fn = jax.vmap(fn, in_axes=(0, lead))
        # vmapped over calls, outputs have the calls axis first: move it after lead.
      pulled = fn(self.chain_inputs, q)
      pulled = [jnp.moveaxis(p, list(range(self.n_calls)),
                             list(range(lead, lead + self.n_calls))) if self.n_calls
                else p for p in pulled]
      lineages = chain.inputs
    else:
      pulled, lineages = list(quantities), self.spec.lineages
    out: dict[str, jax.Array] = {}
    for q, lineage in zip(pulled, lineages):
      if lineage is None:  # A constant input of the chain.
        continue
      value = pull_lineage(lineage, q, lead)
      out[lineage.path] = out[lineage.path] + value if lineage.path in out else value
    return out

  def from_params(self, directions: dict[str, jax.Array]) -> tuple:
    """Per parameter operand, `directions` (`{path: param-shaped}`) pushed to the
    operand's space `(*calls, *w)`: the jvp of the views and chain."""
    if self.spec.chain is not None:
      chain = self.spec.chain
      tangents = [jnp.zeros_like(x) if l is None else
                  push_lineage(l, directions[l.path]).astype(x.dtype)
                  for l, x in zip(chain.inputs, self.chain_inputs)]
      fn = lambda inputs, tangents: jax.jvp(chain, inputs, tangents)[1]
      for _ in range(self.n_calls):
        fn = jax.vmap(fn)
      return (fn(self.chain_inputs, tangents),)
    return tuple(push_lineage(l, directions[l.path]) for l in self.spec.lineages)


def _leading(fn, n):
  """`fn` on the trailing axes of an array with `n` leading axes."""
  def apply(a):
    lead = a.shape[:n]
    out = jax.vmap(fn)(a.reshape((-1,) + a.shape[n:]))
    return out.reshape(lead + out.shape[1:])
  return apply if n else fn


def pull_lineage(lineage: Lineage, q: jax.Array, lead: int) -> jax.Array:
  """`q` `(*lead, *calls, *operand)` back to the leaf `(*lead, *leaf)`."""
  calls = len(lineage.calls)
  for step in reversed(lineage.steps):
    if step.kind == "view":
      if step.primitive.name == "convert_element_type":
        continue  # Kept in the quantity's own dtype.
      transpose = jax.linear_transpose(
          step.apply, jax.ShapeDtypeStruct(step.in_shape, q.dtype))
      q = _leading(lambda v, transpose=transpose: transpose(v)[0], lead + calls)(q)
    elif step.kind == "tied":
      q = jnp.sum(q, axis=lead + calls - 1)
      calls -= 1
    else:  # "stacked": the last call axis is the leading axis of the stacked value.
      calls -= 1
  return q


def push_lineage(lineage: Lineage, v: jax.Array) -> jax.Array:
  """A leaf-shaped `v` to the operand's space `(*calls, *operand)`."""
  calls = 0
  for step in lineage.steps:
    if step.kind == "view" and step.primitive.name != "convert_element_type":
      v = _leading(step.apply, calls)(v)
    elif step.kind == "tied":
      v = jnp.broadcast_to(jnp.expand_dims(v, calls),
                           v.shape[:calls] + (step.length,) + v.shape[calls:])
      calls += 1
    else:
      calls += 1
  return v
