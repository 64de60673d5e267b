"""Layer records found in a model's jaxpr: `record_layers`, for any JAX model as it is.

The analyses need, for every parameter, where it meets the batch: the operation that
takes the parameter (or a function of parameters alone) and a value with a batch
axis, its other operands, and the cotangent of its output. `record_layers(fun)`
finds these *uses* in the traced jaxpr of `fun` instead of asking the user to mark
layers:

1. `fun` is traced to a jaxpr (`jax.make_jaxpr`) at the batch size B of the call,
   and once more at 2B. JAX has no notion of a batch axis; the second trace answers
   the question shape polymorphism answers, without its restrictions: an axis that
   doubles is a batch axis, of size `B * k` (k > 1: the batch merged with positions,
   accepted only where a reshape keeps the batch the outer factor).
2. One small interpreter walks both jaxprs in lockstep, with one rule per kind of
   equation kept in a table (`_RULES`), recursing into the bodies of `jit`, `scan`,
   `cond` and `remat` through the same table. Each value is classified: parameter
   (depends on parameters only), data (depends on the batch), or constant. A value
   of parameters alone has a *lineage* back to its parameter leaf: reshapes,
   transposes, casts, slices of a stacked parameter in a `scan` over layers, or, for
   any other function of parameters alone (weight normalisation, LoRA's `A @ B`), a
   *chain* of equations that the analyses differentiate.
3. An equation with a parameter operand and a batched output is a use. Its kind says
   what the analyses can do with it: `dot_general` (dense layers, attention's 3-D
   kernels, `einsum`, a tied output projection), `conv_general_dilated`, a row
   `gather` (embeddings), an element-wise operation with a broadcast parameter
   (biases, norm scales and offsets, learned position embeddings), and any other
   operation (generic: its per-example gradient is the vector-Jacobian product of
   that one operation, per example).
4. The jaxpr is evaluated again, equation by equation under whatever
   transformations are active (`grad`, `jit`, `vmap`, the reap), with each use
   wrapped in a record site (`record_vjp(..., full=True)`), so that a reap collects
   a `VJPRecord` per use whose `primals[0]` is a `LayerUse`: the operands, the
   inputs of its chain, and a static `UseSpec` describing the use. Everything else
   is bound as traced, so the function computes what `fun` computes.

Record names are parameter paths (`blocks.0.attn.query.kernel`), with `@2`, `@3`,
... for further uses of one parameter (a tied embedding's output projection) and
`+` joining the paths of a use that combines several parameters (LoRA).

Sharp edges:
  * `fun` is traced twice per input signature (B and 2B): code whose structure
    depends on the batch size is an error. Traces are cached per shapes and dtypes.
  * The batch is the leading axis of every leaf of the batch arguments (default:
    every positional argument not in `argnums`); all must have the same size.
  * A parameter that meets data with no batch axis (a weight-decay term added to
    the batch loss, batch-norm statistics), or whose use couples examples (a value
    reduced over the batch, or an axis that mixes examples), gets an
    `unsupported` record: the per-example analyses raise for it, naming the
    parameter and the operation; `gl.layer_coverage` lists it before training.
  * A function of parameters computed outside the `scan`, `cond` or `remat` that
    uses it must be a view (reshape, transpose, cast, ...) to cross into the body;
    other functions are `unsupported` there (compute them inside the body).
  * `custom_jvp`/`custom_vjp` functions, `while_loop`s and other primitives with
    bodies are not looked into: a parameter entering one with a batched output is a
    generic use of the whole call.
  * The jaxpr is re-emitted with inner `jit`s inlined where they hold uses (as any
    outer transformation does; their shardings are not kept).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from oryx_gradlog.record import _internals
from oryx_gradlog.record._kinds import (
    CONV, DENSE, ELEMENTWISE, EMBED, FOUND_KINDS, GENERIC, UNSUPPORTED)
from oryx_gradlog.record._record import record_vjp
from oryx_gradlog.record._sites import DEFAULT_TAG

KINDS = FOUND_KINDS

# One-operand linear maps a parameter may pass through and stay a view of its leaf;
# the first set keeps its entries (a per-example gradient's norm is the same).
_ISOMETRIC = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "convert_element_type", "copy",
    "copy_p", "rev", "neg", "sharding_constraint"})
_LINEAR = _ISOMETRIC | {"broadcast_in_dim", "slice", "reduce_sum"}
# Element-wise primitives whose operands broadcast by size-1 axes (or rank 0), and
# broadcasts of a parameter to the batch's shape.
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter",
    "select_n", "clamp", "add_any", "broadcast_in_dim"})


# ----------------------------------------------------------------------------------
# What a record says about its use (static, in the record's tree structure).


@dataclasses.dataclass(frozen=True)
class Step:
  """One link between a parameter leaf and the operand of its use, outermost first.

  Attributes:
    kind: `"view"` (a linear one-operand equation), `"stacked"` (a slice per
      iteration of a `scan` over its leading axis) or `"tied"` (the same value in
      every iteration of a `scan`).
    primitive: the view's primitive (`None` for scan steps).
    params: the view's parameters as sorted `(key, value)` pairs.
    in_shape: the shape before the step (per iteration for scan steps).
    in_dtype: the dtype before the step.
    length: the scan's length (scan steps).
  """

  kind: str
  primitive: Any = None
  params: tuple = ()
  in_shape: tuple = ()
  in_dtype: Any = None
  length: int = 0

  def apply(self, x):
    return _internals.bind_eqn(self.primitive, dict(self.params), [x])[0]


@dataclasses.dataclass(frozen=True)
class Lineage:
  """How a use's parameter operand is made from one parameter leaf: views only.

  Attributes:
    param: the leaf's index among the flattened parameters.
    path: the leaf's name (its tree path joined by dots).
    steps: the links from the leaf to the operand, outermost first.
  """

  param: int
  path: str
  steps: tuple[Step, ...] = ()

  def then(self, step: Step) -> Lineage:
    return dataclasses.replace(self, steps=self.steps + (step,))

  @property
  def isometric(self) -> bool:
    """Whether the per-example gradient of the operand has the leaf's norm."""
    return all(s.kind in ("stacked", "tied") or s.primitive.name in _ISOMETRIC
               or (s.primitive.name == "broadcast_in_dim"
                   and math.prod(s.in_shape) == math.prod(dict(s.params)["shape"]))
               for s in self.steps)

  @property
  def calls(self) -> tuple[str, ...]:
    """`"stacked"` or `"tied"` per enclosing scan, outermost first."""
    return tuple(s.kind for s in self.steps if s.kind != "view")


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
  """A function of parameters alone that is not a view: equations from inputs to one value.

  Attributes:
    keys: per input, where the interpreter finds its value (`(invocation, var)`).
    inputs: per input, its `Lineage` (a view of a parameter leaf) or `None` (a
      constant).
    eqns: `(invocation, equation)` pairs, in an order that computes `target` from
      the inputs (one jitted function called twice has its equations twice).
    target: the value the chain computes, `(invocation, var)`.
    crossed: whether the chain was computed outside the scan, cond or remat body
      that uses it (its inputs are then out of reach there).
    aliases: `(value, value it stands for)` pairs where the chain crosses a `jit`
      boundary (a body's input and its argument, an equation's output and the
      body's result).
  """

  keys: tuple
  inputs: tuple
  eqns: tuple
  target: Any
  crossed: bool = False
  aliases: tuple = ()

  def __call__(self, *values):
    env = dict(zip(self.keys, values))
    alias = dict(self.aliases)

    def read(invocation, v):
      if isinstance(v, jax.extend.core.Literal):
        return v.val
      key = (invocation, v)
      while key not in env and key in alias:
        key = alias[key]
      return env[key]

    for invocation, eqn in self.eqns:
      outs = _internals.bind_eqn(eqn.primitive, eqn.params,
                                 [read(invocation, v) for v in eqn.invars])
      env.update(((invocation, v), out) for v, out in zip(eqn.outvars, outs))
    return read(*self.target)

  def renamed(self, key) -> Chain:
    """The chain with its value known as `key`, `(invocation, var)` (across a `jit`
    boundary)."""
    if key == self.target:
      return self
    return dataclasses.replace(self, target=key, aliases=self.aliases + ((key, self.target),))


@dataclasses.dataclass(frozen=True, eq=False)
class ParamTree:
  """The structure of the parameters a function was recorded with (static).

  Attributes:
    treedef: the tree structure of the parameter argument(s) (a tuple of them for
      several `argnums`).
    paths: per leaf, its name, or `None` for a leaf that is not an array.
    shapes: per leaf, its shape (`None` for non-arrays).
    dtypes: per leaf, its dtype (`None` for non-arrays).
  """

  treedef: Any
  paths: tuple
  shapes: tuple
  dtypes: tuple

  def unflatten(self, values: dict[str, Any]) -> Any:
    """A tree like the parameters with `values[path]` at each leaf, in the leaf's
    dtype as `jax.grad` gives it (zeros where a path has no value, `None` at leaves
    that are not arrays)."""
    leaves = [None if path is None else values[path].astype(dtype) if path in values
              else jnp.zeros(shape, dtype)
              for path, shape, dtype in zip(self.paths, self.shapes, self.dtypes)]
    return self.treedef.unflatten(leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class UseSpec:
  """What one use of parameters computes, for the analyses (static; internal).

  Attributes:
    name: the record name.
    kind: one of `KINDS`.
    primitive: the use's primitive, bound again with `params` by the analyses.
    params: its parameters.
    param_args: the operand positions of the parameter operands.
    lineages: per parameter operand, its `Lineage`, or `None` if it is made by
      `chain`.
    chain: the `Chain` making the (single) parameter operand, or `None`.
    batch: per operand, its batch axis as `(axis, factor)` or `None`.
    out_batch: the output's batch axis `(axis, factor)`.
    calls: the lengths of the enclosing scans, outermost first.
    scopes: the paths of the enclosing scans' equations, outermost first.
    position: the path of the use's equation (its place in forward order).
    avals: the operands' and the output's shapes and dtypes (per iteration).
    reason: why an `unsupported` use is not supported.
    where: the equation, as the user may recognise it (primitive and source line).
    tree: the `ParamTree` of the recorded function's parameters.
  """

  name: str
  kind: str
  primitive: Any
  params: Any
  param_args: tuple[int, ...]
  lineages: tuple
  chain: Chain | None
  batch: tuple
  out_batch: Any
  calls: tuple[int, ...]
  avals: tuple
  scopes: tuple = ()
  position: tuple = ()
  reason: str = ""
  where: str = ""
  tree: ParamTree | None = None

  @property
  def paths(self) -> tuple[str, ...]:
    """The parameter leaves this use reads, by name."""
    return _paths((*self.lineages, self.chain))

  def apply(self, operands: Sequence[Any]) -> Any:
    """The use's output for `operands` (a tuple where the primitive has several)."""
    outs = _internals.bind_eqn(self.primitive, self.params, list(operands))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _paths(lineages) -> tuple[str, ...]:
  """The parameter paths of lineages and chains, in order, once each."""
  paths = []
  for lineage in lineages:
    if isinstance(lineage, Lineage):
      paths.append(lineage.path)
    elif isinstance(lineage, Chain):
      paths.extend(_paths(lineage.inputs))
  return tuple(dict.fromkeys(paths))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["operands", "chain_inputs"],
    meta_fields=["spec"],
)
@dataclasses.dataclass(frozen=True)
class LayerUse:
  """The inputs of one use of parameters that `record_layers` found (`primals[0]`).

  Attributes:
    operands: the operation's operands (parameter operands and data), per call.
    chain_inputs: the inputs of the function of parameters that made the parameter
      operand, when it is not a view of one leaf (else `()`).
    spec: the static `UseSpec` (kind, parameter paths, batch axes, ...).
  """

  operands: tuple
  chain_inputs: tuple
  spec: UseSpec

  @property
  def kind(self) -> str:
    return self.spec.kind


def _apply_use(use: LayerUse):
  return use.spec.apply(use.operands)


# ----------------------------------------------------------------------------------
# Classification of the values of a jaxpr.

IRREGULAR = "irregular"


@dataclasses.dataclass(frozen=True)
class Info:
  """What the analysis knows of one value.

  Attributes:
    params: the parameter leaves it depends on.
    data: whether it depends on the batch arguments.
    batch: its batch axis `(axis, factor)`, `None`, or `IRREGULAR`.
    lineage: for a value of parameters alone, its `Lineage` or `Chain` (`None`
      where it has neither: a parameter carried through a loop).
    coupled: whether examples are mixed in it (reduced over the batch and used per
      example again, or an axis that is not the batch's).
  """

  params: frozenset = frozenset()
  data: bool = False
  batch: Any = None
  lineage: Any = None
  coupled: bool = False

  @property
  def is_param(self) -> bool:
    return bool(self.params) and not self.data and self.batch is None


_CONST = Info()


def _batch_axis(aval1, aval2, batch_size: int):
  """`(axis, factor)` of the one axis that doubles from `aval1` to `aval2`."""
  shape1, shape2 = getattr(aval1, "shape", None), getattr(aval2, "shape", None)
  if shape1 == shape2:
    return None
  if shape1 is None or shape2 is None or len(shape1) != len(shape2):
    return IRREGULAR
  axes = []
  for axis, (n1, n2) in enumerate(zip(shape1, shape2)):
    if n1 == n2:
      continue
    if n2 != 2 * n1 or n1 % batch_size:
      return IRREGULAR
    axes.append((axis, n1 // batch_size))
  return axes[0] if len(axes) == 1 else IRREGULAR


def _where(eqn) -> str:
  """The primitive and, where JAX kept it, the user's source line."""
  line = _internals.source_line(eqn)
  return f"{eqn.primitive.name}" + (f" ({line})" if line else "")


def _static_params(params: dict) -> tuple:
  return tuple(sorted(params.items()))


@dataclasses.dataclass
class _Use:
  """A use found by the analysis, before it is named (internal)."""

  eqn: Any
  kind: str
  param_args: tuple
  lineages: tuple
  chain: Chain | None
  batch: tuple
  out_batch: Any
  calls: tuple
  reason: str = ""

  def paths(self) -> tuple[str, ...]:
    return _paths((*self.lineages, self.chain))


class _TraceMismatch(Exception):
  """The traces at batch B and 2B differ in structure."""

  def __init__(self, path, what):
    super().__init__(what)
    self.path, self.what = path, what


class _Analysis:
  """Walks the jaxprs at batch B and 2B in lockstep, classifies values, finds uses.

  Equations are identified by their path: indices of the equation and of the
  enclosing equations (and cond branches), outermost first, which is also how the
  interpreter finds them. The path of a body's invocation is that of its equation.
  """

  def __init__(self, batch_size: int):
    self.batch_size = batch_size
    self.uses: dict[tuple, _Use] = {}
    self.inline: set[tuple] = set()  # Equations with uses or chains inside.
    self.coupling = ""  # Where examples are first mixed, if anywhere.

  def run(self, jaxpr1, jaxpr2, in_infos, invocation=(), calls=()):
    """Returns the infos of `jaxpr1`'s outputs, given those of its inputs."""
    env = dict(zip(jaxpr1.invars, in_infos))
    read = lambda v: _CONST if isinstance(v, jax.extend.core.Literal) else env.get(v, _CONST)
    if len(jaxpr1.eqns) != len(jaxpr2.eqns):
      raise _TraceMismatch(invocation, f"{len(jaxpr1.eqns)} vs {len(jaxpr2.eqns)} equations")
    for k, (e1, e2) in enumerate(zip(jaxpr1.eqns, jaxpr2.eqns)):
      if e1.primitive is not e2.primitive or len(e1.outvars) != len(e2.outvars):
        raise _TraceMismatch(invocation + (k,), f"{e1.primitive} vs {e2.primitive}")
      ins = [read(v) for v in e1.invars]
      batches = [_batch_axis(v1.aval, v2.aval, self.batch_size)
                 for v1, v2 in zip(e1.outvars, e2.outvars)]
      rule = _RULES.get(e1.primitive.name, _first_order)
      outs = rule(self, e1, e2, ins, batches, invocation, invocation + (k,), calls)
      env.update(zip(e1.outvars, outs))
    return [read(v) for v in jaxpr1.outvars]

  def mark(self, path):
    for i in range(1, len(path)):
      self.inline.add(path[:i])

  def add_use(self, path, use: _Use):
    self.uses[path] = use
    self.mark(path)


def _join(infos, batch=None) -> Info:
  return Info(params=frozenset().union(*(i.params for i in infos)),
              data=any(i.data for i in infos), batch=batch,
              coupled=any(i.coupled for i in infos))


def _chain_of(invocation, eqn, ins, target) -> Chain:
  """The chain computing `target` (an output of `eqn`) from its inputs' lineages."""
  keys, eqns, aliases = {}, {}, {}
  for var, info in zip(eqn.invars, ins):
    if isinstance(var, jax.extend.core.Literal):
      continue
    if isinstance(info.lineage, Chain):
      for key, lineage in zip(info.lineage.keys, info.lineage.inputs):
        keys.setdefault(key, lineage)
      eqns.update(((i, id(e)), (i, e)) for i, e in info.lineage.eqns)
      aliases.update(info.lineage.aliases)
    else:
      keys.setdefault((invocation, var), info.lineage if info.is_param else None)
  eqns[(invocation, id(eqn))] = (invocation, eqn)
  return Chain(tuple(keys), tuple(keys.values()), tuple(eqns.values()), target,
               aliases=tuple(aliases.items()))


def _first_order(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """Any equation whose bodies (if it has any) are not looked into."""
  param_args = tuple(i for i, info in enumerate(ins) if info.is_param)
  data = any(i.data for i in ins)
  batched = any(b is not None for b in batches)
  # Examples mix where a batched output takes data reduced over the batch.
  coupling = any(b == IRREGULAR for b in batches) or (
      batched and any(i.data and i.batch is None for i in ins))
  coupled = coupling or any(i.coupled for i in ins)
  if coupling and not analysis.coupling:
    analysis.coupling = _where(eqn)
  if param_args and batched:  # Parameters meet the batch: a use.
    analysis.add_use(path, _classify(eqn, ins, batches, param_args, calls, coupled))
  elif param_args and not data:  # A function of parameters alone.
    if (len(ins) == 1 and len(eqn.outvars) == 1 and eqn.primitive.name in _LINEAR
        and isinstance(ins[0].lineage, Lineage)):
      aval = eqn.invars[0].aval
      step = Step("view", eqn.primitive, _static_params(eqn.params), tuple(aval.shape),
                  aval.dtype)
      return [dataclasses.replace(ins[0], lineage=ins[0].lineage.then(step))]
    analysis.mark(path)
    base = _join(ins)
    return [dataclasses.replace(base, lineage=_chain_of(invocation, eqn, ins, (invocation, v)))
            for v in eqn.outvars]
  elif param_args:  # Parameters meet data with no batch axis.
    analysis.add_use(path, _Use(
        eqn, UNSUPPORTED, param_args, tuple(ins[i].lineage for i in param_args), None,
        tuple(i.batch for i in ins), None, calls,
        reason="it meets data that has no batch axis (a term added to the batch loss, "
               "or statistics over the batch), so it has no per-example gradient"))
  return [_join(ins, b) if b is None else dataclasses.replace(_join(ins, b), coupled=coupled)
          for b in batches]


def _classify(eqn, ins, batches, param_args, calls, coupled) -> _Use:
  """The kind of a use, or why it is unsupported."""
  lineages = tuple(ins[i].lineage for i in param_args)
  chains = [l for l in lineages if isinstance(l, Chain)]
  out_batch = batches[0] if len(batches) == 1 else IRREGULAR
  use = _Use(eqn, GENERIC, param_args,
             tuple(l if isinstance(l, Lineage) else None for l in lineages),
             chains[0] if chains else None, tuple(i.batch for i in ins), out_batch, calls)
  reason = ""
  if len(batches) > 1:
    reason = ("the operation has several outputs (a custom_jvp/custom_vjp function or "
              "a loop holding the parameter); apply it to the parameter outside, or "
              "give it one output")
  elif coupled or out_batch == IRREGULAR or any(i.batch == IRREGULAR for i in ins):
    reason = ("its output mixes examples (a value reduced over the batch, or an axis "
              "that is not the batch's), so it has no per-example gradient")
  elif any(l is None for l in lineages):
    reason = ("it takes a function of parameters carried through a loop or returned by "
              "a cond; compute it where it is used")
  elif any(c.crossed for c in chains):
    reason = ("it takes a function of parameters computed outside the scan, cond or "
              "remat it is in; compute it inside (views such as reshapes and casts "
              "may cross)")
  elif chains and len(param_args) > 1:
    reason = "it takes several parameter operands made by functions of parameters"
  if reason:
    use.kind, use.reason = UNSUPPORTED, reason
    return use
  name = eqn.primitive.name
  if len(param_args) == 1 and len(batches) == 1:
    w = param_args[0]
    if name == "dot_general" and _dense_ok(eqn, ins, w):
      use.kind = DENSE
    elif name == "conv_general_dilated" and w == 1 and _conv_ok(eqn, ins):
      use.kind = CONV
    elif name == "gather" and w == 0 and _embed_ok(eqn, ins):
      use.kind = EMBED
    elif name in _ELEMENTWISE:
      use.kind = ELEMENTWISE
  return use


def _dense_ok(eqn, ins, w) -> bool:
  """A dot_general whose data operand has its batch axis among its free axes."""
  x = 1 - w
  contract, batch_dims = eqn.params["dimension_numbers"]
  axis = ins[x].batch
  return (axis is not None and axis[1] == 1 and axis[0] not in contract[x]
          and axis[0] not in batch_dims[x])


def _conv_ok(eqn, ins) -> bool:
  """A convolution of a batched input (batch on its N axis) with a parameter kernel."""
  spec = eqn.params["dimension_numbers"]
  axis = ins[0].batch
  return (eqn.params["batch_group_count"] == 1 and axis is not None
          and axis[0] == spec.lhs_spec[0])


def _embed_ok(eqn, ins) -> bool:
  """A gather of whole rows of a table at batched ids (`table[ids]`, `jnp.take`, and
  Equinox's `weight[id]` under vmap, which also indexes the other axes at starts
  that a whole-width slice clamps to 0, and keeps the row axis as size 1)."""
  dims = eqn.params["dimension_numbers"]
  operand, indices = eqn.invars[0].aval, eqn.invars[1].aval
  out = eqn.outvars[0].aval
  start = tuple(dims.start_index_map)
  axis = ins[1].batch
  return (tuple(dims.collapsed_slice_dims) in ((0,), ()) and start[:1] == (0,)
          and (len(start) == 1 or eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP)
          and not tuple(getattr(dims, "operand_batching_dims", ()))
          and tuple(eqn.params["slice_sizes"]) == (1, *operand.shape[1:])
          and indices.shape[-1] == len(start) and axis is not None and axis[1] == 1
          and axis[0] < indices.ndim - 1
          and tuple(dims.offset_dims) == tuple(range(indices.ndim - 1, out.ndim)))


def _reshape(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """A reshape keeps a batch axis only as the outer factor of the axis it lands in."""
  outs = _first_order(analysis, eqn, eqn2, ins, batches, invocation, path, calls)
  (info,), (out,) = ins, outs
  if info.batch in (None, IRREGULAR) or out.batch in (None, IRREGULAR):
    return outs
  in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  if math.prod(in_shape[:info.batch[0]]) != math.prod(out_shape[:out.batch[0]]):
    return [dataclasses.replace(out, batch=IRREGULAR, coupled=True)]
  return outs


def _cross(info: Info, step: Step | None) -> Info:
  """The info of a value passed into a body: lineages cross, chains are marked."""
  if not info.is_param:
    return info
  if isinstance(info.lineage, Lineage):
    return dataclasses.replace(
        info, lineage=info.lineage if step is None else info.lineage.then(step))
  if isinstance(info.lineage, Chain):
    return dataclasses.replace(info, lineage=dataclasses.replace(info.lineage, crossed=True))
  return info


def _with_batches(outs, batches):
  return [dataclasses.replace(o, batch=b) for o, b in zip(outs, batches)]


def _renamed(info: Info, invocation, var) -> Info:
  """`info` of a value that a `jit` boundary renames to `var` in `invocation` (chains
  follow)."""
  if isinstance(info.lineage, Chain) and isinstance(var, jax.extend.core.Var):
    return dataclasses.replace(info, lineage=info.lineage.renamed((invocation, var)))
  return info


def _jit(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """A `jit` body is looked into as if inlined (and inlined where it holds uses)."""
  body = eqn.params["jaxpr"].jaxpr
  outs = analysis.run(body, eqn2.params["jaxpr"].jaxpr,
                      [_renamed(i, path, v) for i, v in zip(ins, body.invars)], path, calls)
  outs = [_renamed(o, invocation, v) for o, v in zip(outs, eqn.outvars)]
  return _with_batches(outs, batches)


def _remat(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  outs = analysis.run(eqn.params["jaxpr"], eqn2.params["jaxpr"],
                      [_cross(i, None) for i in ins], path, calls)
  # A function of parameters made in the body is, outside it, the whole remat call
  # (the body's own values live in the checkpoint's trace).
  outs = [dataclasses.replace(o, lineage=_chain_of(invocation, eqn, ins, (invocation, v)))
          if isinstance(o.lineage, Chain) else o for o, v in zip(outs, eqn.outvars)]
  return _with_batches(outs, batches)


def _cond(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  operands = [_cross(i, None) for i in ins[1:]]
  outs = [analysis.run(b1.jaxpr, b2.jaxpr, operands, path + (b,), calls)
          for b, (b1, b2) in enumerate(zip(eqn.params["branches"], eqn2.params["branches"]))]
  return [dataclasses.replace(_join([ins[0], *infos], b), lineage=None)
          for infos, b in zip(zip(*outs), batches)]


def _scan(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  params = eqn.params
  body1, body2 = params["jaxpr"].jaxpr, eqn2.params["jaxpr"].jaxpr
  n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
  consts = [_cross(i, Step("tied", length=length)) for i in ins[:n_consts]]
  carry = [dataclasses.replace(i, lineage=None) for i in ins[n_consts:n_consts + n_carry]]
  xs = [_cross(i, Step("stacked", in_shape=tuple(v.aval.shape), length=length))
        for i, v in zip(ins[n_consts + n_carry:], eqn.invars[n_consts + n_carry:])]

  def body_infos(infos):  # Batch axes inside the body, from its own shapes.
    return [dataclasses.replace(
        i, batch=_batch_axis(v1.aval, v2.aval, analysis.batch_size))
        for i, v1, v2 in zip(infos, body1.invars, body2.invars)]

  for _ in range(len(carry) + 2):  # The carry's classes are a fixed point of the body.
    for stale in [p for p in analysis.uses if p[:len(path)] == path]:
      del analysis.uses[stale]  # Found with an earlier guess of the carry's classes.
    outs = analysis.run(body1, body2, body_infos(consts + carry + xs), path,
                        calls + ((path, length),))
    new = [dataclasses.replace(_join([c, o]), lineage=None)
           for c, o in zip(carry, outs[:n_carry])]
    if [(n.params, n.data, n.coupled) for n in new] == [
        (c.params, c.data, c.coupled) for c in carry]:
      break
    carry = new
  ys = [dataclasses.replace(o, lineage=None) for o in outs[n_carry:]]
  return _with_batches(carry + ys, batches)


def _identity(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """Record sites and Oryx sows: identities on their operands (after any residuals)."""
  n = len(ins) - len(eqn.outvars)
  return _with_batches(ins[n:], batches)


_RULES: dict[str, Callable] = {
    "gradlog_site": _identity,
    "gradlog_after": _identity,
    "gradlog_batch_first": _identity,
    "gradlog_cotangent": _identity,
    "sow": _identity,
    "reshape": _reshape,
    "pjit": _jit,
    "jit": _jit,
    "closed_call": _jit,
    "core_call": _jit,
    "remat2": _remat,
    "checkpoint": _remat,
    "cond": _cond,
    "scan": _scan,
}


# ----------------------------------------------------------------------------------
# Re-emitting the jaxpr with the uses recorded.


class _Emitter:
  """Evaluates a jaxpr as `jax.core.eval_jaxpr` does, recording the uses."""

  def __init__(self, analysis: _Analysis, specs: dict[tuple, UseSpec], tag: str):
    self.analysis, self.specs, self.tag = analysis, specs, tag
    self.values: dict[tuple, Any] = {}

  def run(self, jaxpr, consts, args, invocation=()):
    values = self.values
    read = lambda v: (v.val if isinstance(v, jax.extend.core.Literal)
                      else values[(invocation, v)])
    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
      values[(invocation, var)] = value
    for k, eqn in enumerate(jaxpr.eqns):
      path = invocation + (k,)
      invals = [read(v) for v in eqn.invars]
      if path in self.specs:
        outs = self.use(self.specs[path], invals)
      elif path in self.analysis.inline:
        outs = _EMIT[eqn.primitive.name](self, eqn, invals, path)
      else:
        outs = _internals.bind_eqn(eqn.primitive, eqn.params, invals, eqn.ctx)
      for var, value in zip(eqn.outvars, outs):
        values[(invocation, var)] = value
    return [read(v) for v in jaxpr.outvars]

  def use(self, spec: UseSpec, invals):
    chain_inputs = () if spec.chain is None else tuple(
        self.values[key] for key in spec.chain.keys)
    layer = LayerUse(tuple(invals), chain_inputs, spec)
    out = record_vjp(_apply_use, name=spec.name, tag=self.tag, full=True)(layer)
    return list(out) if isinstance(out, tuple) else [out]


def _emit_jit(emitter, eqn, invals, path):
  closed = eqn.params["jaxpr"]
  return emitter.run(closed.jaxpr, closed.consts, invals, path)


def _emit_remat(emitter, eqn, invals, path):
  body = lambda *args: emitter.run(eqn.params["jaxpr"], (), args, path)
  return jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"],
                        policy=eqn.params["policy"])(*invals)


def _emit_cond(emitter, eqn, invals, path):
  branches = [functools.partial(
      lambda closed, b, *args: emitter.run(closed.jaxpr, closed.consts, args, path + (b,)),
      closed, b) for b, closed in enumerate(eqn.params["branches"])]
  return lax.switch(invals[0], branches, *invals[1:])


def _emit_scan(emitter, eqn, invals, path):
  params = eqn.params
  closed = params["jaxpr"]
  n_consts, n_carry = params["num_consts"], params["num_carry"]
  consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                      invals[n_consts + n_carry:])

  def body(carry, x):
    outs = emitter.run(closed.jaxpr, closed.consts, [*consts, *carry, *x], path)
    return outs[:n_carry], outs[n_carry:]

  carry, ys = lax.scan(body, init, xs, length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


_EMIT = {
    "pjit": _emit_jit, "jit": _emit_jit, "closed_call": _emit_jit, "core_call": _emit_jit,
    "remat2": _emit_remat, "checkpoint": _emit_remat,
    "cond": _emit_cond,
    "scan": _emit_scan,
}


# ----------------------------------------------------------------------------------
# The transformation.


def path_name(path: Sequence[Any]) -> str:
  """A tree path as a dotted name: `blocks.0.attn.query.kernel`.

  Dict keys, attribute names and sequence indices are joined by dots; a trailing
  `.value` (a Flax NNX variable's) is dropped.
  """
  parts = []
  for entry in path:
    for field in ("key", "name", "idx"):
      if hasattr(entry, field):
        parts.append(str(getattr(entry, field)))
        break
    else:
      parts.append(str(entry).strip(".[]'\""))
  if len(parts) > 1 and parts[-1] in ("value", "raw_value"):
    parts.pop()
  return ".".join(parts)


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or (
      hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


@dataclasses.dataclass(frozen=True)
class Traced:
  """A traced function and its analysis (internal; cached per input signature).

  Attributes:
    jaxpr: the closed jaxpr at the call's batch size.
    analysis: the `_Analysis` of it.
    specs: the named uses, by equation path.
    out_tree: the tree structure of `fun`'s output.
    params: per parameter leaf, `(path, shape, dtype)`.
    batch_size: B.
  """

  jaxpr: Any
  analysis: _Analysis
  specs: dict
  out_tree: Any
  params: tuple
  batch_size: int


class Signature:
  """Splits the arguments into parameter, batch, other and static leaves."""

  def __init__(self, api, args, kwargs, argnums, batch_argnums):
    n = len(args)
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in argnums if not -n <= a < n]
    if bad or not argnums:
      raise ValueError(
          f"{api}(argnums={argnums}): the function was called with {n} positional "
          f"arguments; argnums must name at least one of them (the parameters).")
    argnums = tuple(sorted({a % n for a in argnums}))
    if batch_argnums is None:
      batch_argnums = tuple(i for i in range(n) if i not in argnums)
    else:
      batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
      bad = [a for a in batch_argnums if not -n <= a < n or a % n in argnums]
      if bad:
        raise ValueError(
            f"{api}(batch_argnums={batch_argnums}): {bad} are not positional arguments "
            f"other than the parameters (argnums={argnums}) of this call with {n} "
            "positional arguments.")
      batch_argnums = tuple(sorted({a % n for a in batch_argnums}))
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    self.kinds, self.leaves, self.names = [], [], []
    tree_leaves = []
    for path, leaf in leaves:
      top = path[0].idx if path and hasattr(path[0], "idx") else None
      arg = path[1].idx if top == 0 and len(path) > 1 else None
      if not _is_array(leaf):
        kind = "static"
      elif arg in argnums:
        kind = "param"
      elif arg in batch_argnums:
        kind = "batch"
      else:
        kind = "other"
      self.kinds.append(kind)
      self.leaves.append(leaf)
      inner = path[2:] if arg is not None else path[1:]
      name = path_name(inner)
      if kind == "param" and len(argnums) > 1:
        name = f"{arg}.{name}" if name else str(arg)
      self.names.append(name or f"arg{arg}")
      if arg in argnums:
        tree_leaves.append((name or f"arg{arg}", jnp.shape(leaf), jnp.result_type(leaf))
                           if kind == "param" else (None, None, None))
    source = args[argnums[0]] if len(argnums) == 1 else tuple(args[a] for a in argnums)
    self.tree = ParamTree(jax.tree.structure(source), *map(tuple, zip(*tree_leaves))) \
        if tree_leaves else None
    batch = [leaf for leaf, kind in zip(self.leaves, self.kinds) if kind == "batch"]
    if not any(k == "param" for k in self.kinds):
      raise ValueError(f"{api}: argument(s) {argnums} hold no arrays: nothing to record.")
    if not batch:
      raise ValueError(
          f"{api}: no batch arguments (batch_argnums={batch_argnums}) hold arrays, so "
          "there is no batch axis to find. Pass the batch positionally, or name it "
          "with batch_argnums.")
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in batch}
    if len(sizes) != 1 or None in sizes:
      shapes = [jnp.shape(leaf) for leaf in batch]
      raise ValueError(
          f"{api}: the batch arguments' leaves must all have the batch as their "
          f"leading axis, of one size; got shapes {shapes}. Name the arguments that "
          "hold the batch with batch_argnums (others are passed through).")
    (self.batch_size,) = sizes
    self.argnums = argnums

  def key(self):
    statics = tuple(leaf if _hashable(leaf) else id(leaf)
                    for leaf, kind in zip(self.leaves, self.kinds) if kind == "static")
    avals = tuple((jnp.shape(leaf), jnp.result_type(leaf),
                   getattr(leaf, "weak_type", False))
                  for leaf, kind in zip(self.leaves, self.kinds) if kind != "static")
    return self.treedef, tuple(self.kinds), statics, avals

  def dynamic(self):
    return [leaf for leaf, kind in zip(self.leaves, self.kinds) if kind != "static"]

  def specs(self, scale: int):
    out = []
    for leaf, kind in zip(self.leaves, self.kinds):
      if kind == "static":
        continue
      shape = tuple(jnp.shape(leaf))
      if kind == "batch":
        shape = (shape[0] * scale,) + shape[1:]
      out.append(jax.ShapeDtypeStruct(shape, jnp.result_type(leaf),
                                      weak_type=getattr(leaf, "weak_type", False)))
    return out

  def flat_fun(self, fun):
    def call(*dynamic):
      it = iter(dynamic)
      leaves = [leaf if kind == "static" else next(it)
                for leaf, kind in zip(self.leaves, self.kinds)]
      args, kwargs = jax.tree.unflatten(self.treedef, leaves)
      return fun(*args, **kwargs)
    return call


def _hashable(x) -> bool:
  try:
    hash(x)
  except TypeError:
    return False
  return True


def trace(api: str, fun: Callable, args, kwargs, argnums, batch_argnums,
          cache: dict | None = None) -> tuple[Traced, Signature]:
  """Traces `fun` at B and 2B, analyses it and names its uses."""
  signature = Signature(api, args, kwargs, argnums, batch_argnums)
  key = signature.key()
  if cache is not None and key in cache:
    return cache[key], signature
  flat = signature.flat_fun(fun)
  closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*signature.specs(1))
  closed2 = jax.make_jaxpr(flat)(*signature.specs(2))
  dynamic_kinds = [k for k in signature.kinds if k != "static"]
  dynamic_names = [n for n, k in zip(signature.names, signature.kinds) if k != "static"]
  analysis = _Analysis(signature.batch_size)
  ins = []
  for i, (kind, name, var, var2) in enumerate(zip(
      dynamic_kinds, dynamic_names, closed.jaxpr.invars, closed2.jaxpr.invars)):
    if kind == "param":
      ins.append(Info(params=frozenset({i}), lineage=Lineage(i, name)))
    elif kind == "batch":
      ins.append(Info(data=True, batch=_batch_axis(var.aval, var2.aval,
                                                   signature.batch_size)))
    else:
      ins.append(_CONST)
  try:
    outs = analysis.run(closed.jaxpr, closed2.jaxpr, ins)
  except _TraceMismatch as error:
    raise ValueError(
        f"{api}: the function traced differently at batch sizes "
        f"{signature.batch_size} and {2 * signature.batch_size} ({error.what}, at "
        f"equation {error.path}). record_layers finds the batch axis by tracing at both "
        "sizes; make the function's structure independent of the batch size.") from None
  if outs and outs[0].coupled:  # The loss mixes examples: nothing is per example.
    for use in analysis.uses.values():
      if use.kind != UNSUPPORTED:
        use.kind = UNSUPPORTED
        use.reason = (f"the function's output mixes examples at {analysis.coupling} (a "
                      "value reduced over the batch is used per example again, as batch "
                      "norm does in training), so no parameter has a per-example "
                      "gradient")
  params = tuple((n, tuple(v.aval.shape), v.aval.dtype)
                 for n, k, v in zip(dynamic_names, dynamic_kinds, closed.jaxpr.invars)
                 if k == "param")
  traced = Traced(closed, analysis, _name_uses(analysis, signature.tree),
                  jax.tree.structure(out_shape), params, signature.batch_size)
  if cache is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    cache[key] = traced
  return traced, signature


def _name_uses(analysis: _Analysis, tree: ParamTree) -> dict[tuple, UseSpec]:
  counts: dict[str, int] = {}
  specs = {}
  for path, use in sorted(analysis.uses.items()):
    paths = use.paths()
    base = "+".join(paths) if len(paths) <= 2 else f"{paths[0]}+{len(paths) - 1}_more"
    base = base or "constant"
    counts[base] = counts.get(base, 0) + 1
    name = base if counts[base] == 1 else f"{base}@{counts[base]}"
    eqn = use.eqn
    avals = tuple(jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)
                  if hasattr(v.aval, "shape") else None
                  for v in (*eqn.invars, *eqn.outvars))
    specs[path] = UseSpec(
        name=name, kind=use.kind, primitive=eqn.primitive, params=dict(eqn.params),
        param_args=use.param_args, lineages=use.lineages, chain=use.chain,
        batch=use.batch, out_batch=use.out_batch,
        calls=tuple(length for _, length in use.calls), avals=avals,
        scopes=tuple(scope for scope, _ in use.calls), position=path,
        reason=use.reason, where=_where(eqn), tree=tree)
  return specs


def record_layers(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    tag: str = DEFAULT_TAG,
) -> Callable[..., Any]:
  """Returns `fun` with every use of its parameters recorded as a layer record.

  `fun` is any JAX function of parameters and a batch: a stock Flax NNX, Flax
  linen, Equinox or Haiku model's loss, unchanged. Its jaxpr is searched for the
  operations where parameters (leaves of the arguments `argnums`, or functions of
  them alone) meet the batch: dense layers and any other `dot_general`,
  convolutions, embedding lookups, element-wise scales and shifts, and anything
  else (generic). Reaping the returned function's backward pass gives one
  `VJPRecord` per use, named by the parameter's path, which `per_example_norms`,
  `per_example_clip` and the other analyses take as they take hand-marked layers.

  Args:
    fun: the function, e.g. `loss(params, x, y)`.
    argnums: the positional argument(s) holding the parameters.
    batch_argnums: the positional arguments holding the batch, as the leading axis
      of each of their array leaves (default: all but `argnums`). Other arguments
      and keyword arguments are passed through (a PRNG key, a learning rate).
    tag: the Oryx tag of the records.

  Returns:
    A function with `fun`'s signature that returns what `fun` returns.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(params, x):  # plain JAX: no layer is marked
    ...   return jnp.mean((x @ params["w"] + params["b"]) ** 2)
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(params, jnp.ones((4, 3)))
    >>> sorted(records), records["w"].primals[0].kind, records["b"].primals[0].kind
    (['b', 'w'], 'dense', 'elementwise')
  """
  return recorder(fun, argnums=argnums, batch_argnums=batch_argnums, tag=tag,
                  api="record_layers")


def recorder(fun, *, argnums, batch_argnums, tag, api) -> Callable[..., Any]:
  """`record_layers` for the public function `api` (whose name its errors give)."""
  cache: dict = {}

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    traced, signature = trace(api, fun, args, kwargs, argnums, batch_argnums, cache)
    emitter = _Emitter(traced.analysis, traced.specs, tag)
    closed = traced.jaxpr
    outs = emitter.run(closed.jaxpr, closed.consts, signature.dynamic())
    return jax.tree.unflatten(traced.out_tree, outs)

  return wrapped
