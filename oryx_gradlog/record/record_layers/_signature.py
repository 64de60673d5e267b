"""The argument signature of a call of `record_layers`: parameters, batch, static.

Splits the call's arguments into parameter leaves (named by their tree paths),
batch leaves (the leading axis of each is the batch) and the rest, and gives the
shapes to trace at B and 2B and the cache key of one input signature.

Sharp edges:
  * Every array leaf of the batch arguments must have the same leading size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.record.record_layers._spec import ParamTree
from oryx_gradlog.record.record_layers._walk import _Analysis


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
