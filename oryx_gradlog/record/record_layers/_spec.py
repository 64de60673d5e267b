"""The use spec: what a record of `record_layers` says about its use.

A record's `primals[0]` is a `LayerUse`: the operands of the use, the inputs of the
function of parameters that made its parameter operand, and a static `UseSpec` (its
kind, primitive and parameters, batch axes, the enclosing scans, and each parameter
operand's `Lineage` back to its leaf or the `Chain` of equations that made it).

Sharp edges:
  * Everything static here is part of the record's tree structure: two traces with
    different uses have records of different structures.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.record import _internals


# One-operand linear maps a parameter may pass through and stay a view of its leaf;
# the first set keeps its entries (a per-example gradient's norm is the same).
_ISOMETRIC = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "convert_element_type", "copy",
    "copy_p", "rev", "neg", "sharding_constraint"})
_LINEAR = _ISOMETRIC | {"broadcast_in_dim", "slice", "reduce_sum"}
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
    shifts: for a bias (an element-wise add of a parameter with as many entries as
      the output features of a dense or convolution use, to that use's output), the
      position of that use; `None` otherwise.
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
  shifts: tuple | None = None

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
