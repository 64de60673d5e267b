"""A use that `gl.record_layers` found, as the analyses read it: `FoundUse`.

A found use's record holds a `LayerUse`: the operands of the operation where
parameters meet the batch, the inputs of the function of parameters that made its
parameter operand (if not a view of one leaf), and a static `UseSpec`. `FoundUse`
gives it the interface every layer use has (`MarkedUse` in `_marked.py` too):

* `keys` (the parameter paths it reads), `kind`, `batch_size`;
* `view()`, its canonical `LayerView` where its kind has one (`kinds/`);
* `weighted_grads(c)`, `per_example_grads()`, `inner_products(v)`,
  `sum_of_squares()`: `sum_i c_i grad_i` (one vjp of the operation), each example's
  gradient (its kind's rule), `<grad_i, v>` (one jvp) and a cheap `sum_i grad_i^2`
  where its kind has one, by parameter path as `LayerParams`;
* `examples(start, size)`, the use of a slice of the examples alone (for analyses
  that form per-example gradients a chunk at a time), or `None`.

Everything is computed in the operand's space and mapped to the parameters' through
the views and chain that made the operand (`to_params`, `from_params`).

Sharp edges:
  * A found use's per-example gradients are formed (materialised) where its kind
    has no Gram form or a parameter has several uses; `gl.layer_coverage` says where.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.record import kinds
from oryx_gradlog.record._canonical import LayerParams, LayerView, as_float
from oryx_gradlog.record._record import VJPRecord
from oryx_gradlog.record.record_layers import Lineage


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
    calls = lineages[0].calls if lineages else ()
    return tuple(k == "tied" for k in calls) if len(calls) == self.n_calls else (
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
  def rules(self) -> kinds.Kind:
    """The use's kind, from the table of kinds (`kinds/`)."""
    return kinds.of(self.spec.kind)

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

  def examples(self, start: Any, size: int) -> FoundUse | None:
    """The use of examples `start, ..., start + size - 1` alone (`start` may be
    traced), for kinds whose operation reads any number of examples
    (`Kind.sliceable`); else `None`."""
    if not self.rules.sliceable:
      return None
    n = self.n_calls

    def cut(a, batch):
      if batch is None:
        return a
      axis, factor = batch
      return jax.lax.dynamic_slice_in_dim(a, start * factor, size * factor, n + axis)

    return dataclasses.replace(
        self, operands=tuple(map(cut, self.operands, self.spec.batch)),
        g=cut(self.g, self.spec.out_batch))

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
    square = self.rules.sum_of_squares(self) if self.simple else None
    if square is None:
      return None
    # Views of one leaf carry squares as they carry values.
    return {path: LayerParams(value, None)
            for path, value in self.to_params([square], lead=0).items()}

  # Per call, the use as a function of its parameter operand(s).
  def per_call(self, fn):
    """`fn(operands, g, chain_inputs)` vmapped over the call axes."""
    for _ in range(self.n_calls):
      fn = jax.vmap(fn)
    return fn(self.operands, self.g, self.chain_inputs)

  def of_w(self, operands):
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
    fast = self.rules.weighted(self, c)
    if fast is not None:
      return fast
    x_arg = self.rules.data_arg(self)

    def fn(operands, g, _):
      ws = [operands[i] for i in self.spec.param_args]
      if x_arg is not None and jnp.size(operands[x_arg]) <= jnp.size(g):
        operands = list(operands)
        x = operands[x_arg]
        operands[x_arg] = self._example_weights(c, x, self.spec.batch[x_arg]) * x
        _, vjp = jax.vjp(self.of_w(operands), *ws)
        return vjp(g)
      _, vjp = jax.vjp(self.of_w(operands), *ws)
      return vjp(self._example_weights(c, g, self.spec.out_batch) * g)
    return self.per_call(fn)

  def products(self, directions: Sequence[jax.Array]) -> jax.Array:
    """`(B,)`: `<dl/dy_i, J_i v>` summed over calls, `v` per parameter operand
    `(*calls, *w)` (the recorded loss's scale)."""
    axis, factor = self.spec.out_batch

    def fn(operands, g, _, v):
      ws = [operands[i] for i in self.spec.param_args]
      _, tangent = jax.jvp(self.of_w(operands), ws, [t.astype(w.dtype) for t, w in zip(v, ws)])
      p = as_float(g) * as_float(tangent)
      p = jnp.moveaxis(p, axis, 0)
      return jnp.sum(p.reshape(p.shape[0] // factor, -1), axis=1)

    for _ in range(self.n_calls):
      fn = jax.vmap(fn)
    out = fn(self.operands, self.g, self.chain_inputs, tuple(directions))
    return jnp.sum(out.reshape(-1, out.shape[-1]), axis=0)

  def per_example(self) -> tuple:
    """Per parameter operand, the per-example gradients `(B, *calls, *w)` (of the
    recorded loss), formed by the use's kind."""
    n = self.n_calls
    return tuple(jnp.moveaxis(g, n, 0) for g in self.rules.per_example(self))

  def view(self, force: bool = False) -> LayerView | None:
    """The `LayerView` of a use whose kind has one and whose operand keeps its
    parameter's norms (any such use with `force`), else `None`."""
    if not (self.simple or force):
      return None
    return self.rules.view(self)

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
