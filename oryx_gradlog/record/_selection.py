"""Choosing the layer records an analysis reads: one `Selection` of layer uses.

`collect` checks an analysis's arguments and reads every layer record, hand-marked
(`MarkedUse`) or found by `gl.record_layers` (`FoundUse`), as a layer use with one
interface (`_found.py`, `_marked.py`). The `Selection` groups the uses by result key: a found
parameter's path (every use of it), or a hand-marked record's name (weight and bias
together). Every analysis then has one loop over `groups` (per-key results) or
`uses` (per-use work such as one vjp per use).

Sharp edges:
  * A use that reads several parameters is in each of their groups; `uses` has it
    once, so per-use work (`weighted`, `products`) is done once.
  * `splitter` places a parameter-shaped tree by key: found keys through the
    recorded parameter tree, hand-marked ones through `where=` or, without it, as
    the leaf that is the record's weight itself (the same tracer, in a `jit`-ted
    step). Values are never compared: outside `jit`, hand-marked records need
    `where=`, or the loss recorded with `gl.record_layers`, which records them by
    parameter path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.record._canonical import LayerParams, as_float
from oryx_gradlog.record._found import FoundUse
from oryx_gradlog.record._kinds import LOSS_MIXES_EXAMPLES, NORM_KINDS, UNSUPPORTED
from oryx_gradlog.record._layers import LayerInputs, WEIGHT_RANK
from oryx_gradlog.record._marked import MarkedUse
from oryx_gradlog.record._record import VJPRecord
from oryx_gradlog.record.record_layers import LayerUse


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



@dataclasses.dataclass(frozen=True)
class Selection:
  """The layer uses an analysis reads, grouped by result key (internal).

  Attributes:
    groups: per result key (a parameter path, or a hand-marked record's name), the
      uses that contribute to it.
  """

  groups: dict[str, tuple]

  @property
  def uses(self) -> list:
    """Every use once (a use of several parameters is in several groups)."""
    return list({u.name: u for group in self.groups.values() for u in group}.values())

  @property
  def batch_sizes(self) -> dict[str, int]:
    return {key: group[0].batch_size for key, group in self.groups.items()}

  @property
  def tree(self):
    """The recorded parameters' `ParamTree` of found uses (`None` without them)."""
    for use in self.uses:
      if isinstance(use, FoundUse):
        return use.spec.tree
    return None

  def weighted(self, factors: jax.Array,
               formed: dict[str, LayerParams] | None = None) -> dict[str, LayerParams]:
    """Per key, `sum_i c_i grad_i` (of the recorded loss): each use's vjp at the
    cotangent `c g`, summed over the uses of the key; or, for a key in `formed` (its
    per-example gradients `(B, ...)`, as `per_example` gives them), their sum
    weighted by `c`."""
    formed = formed or {}
    weigh = lambda g: jnp.tensordot(factors, as_float(g), 1).astype(g.dtype)
    totals: dict[str, LayerParams] = {
        key: jax.tree.map(weigh, grads) for key, grads in formed.items()}
    for use in self.uses:
      if all(key in formed for key in use.keys):
        continue
      for key, grad in use.weighted_grads(factors).items():
        if key not in formed:
          totals[key] = totals[key] + grad if key in totals else grad
    return {key: totals[key] for key in self.groups if key in totals}

  def per_example(self, key: str) -> LayerParams:
    """`(B, ...)`: key `key`'s per-example gradients (of the recorded loss), formed:
    each use's, summed over the uses of the key."""
    total = None
    for use in self.groups[key]:
      grad = use.per_example_grads()[key]
      total = grad if total is None else total + grad
    return total

  def products(self, directions: dict[str, LayerParams]) -> jax.Array:
    """`(B,)`: `<grad_i, v>` (of the recorded loss) summed over the uses, `v` by key."""
    return sum(use.inner_products(directions) for use in self.uses)

  def values(self) -> dict[str, LayerParams]:
    """The parameter values the hand-marked records hold, by key."""
    out = {}
    for use in self.uses:
      out.update(use.values() or {})
    return out

  def by_path(self, api: str, tree: Any) -> dict[str, LayerParams]:
    """`tree` (shaped like the parameters `gl.record_layers` recorded) by parameter
    path; `{}` without found uses."""
    return {} if self.tree is None else _found_leaves(api, self.tree, tree)

  def splitter(self, api: str, params: Any, where: Any = None,
               other_fix: str = "leave those layers out with names=",
               ) -> Callable[[Any], dict[str, LayerParams]]:
    """A function placing a tree shaped like `params` (the parameters the gradient
    was taken at) by key; the hand-marked layers' leaves are found once, here.
    `other_fix`: the error's last way out where a weight is not found."""
    marked = [u for u in self.uses if isinstance(u, MarkedUse)]
    sources = _marked_sources(api, marked, params, where, other_fix) if marked else {}

    def split(tree: Any) -> dict[str, LayerParams]:
      out = self.by_path(api, tree)
      leaves = jax.tree.leaves(tree)
      for name, (w, b) in sources.items():
        out[name] = LayerParams(leaves[w], None if b is None else leaves[b])
      return out

    return split


def _found_leaves(api, param_tree, tree) -> dict[str, LayerParams]:
  """`tree` (shaped like the parameters `gl.record_layers` recorded) by parameter path."""
  if jax.tree.structure(tree) != param_tree.treedef:
    raise ValueError(
        f"{api}: the parameters have the structure {jax.tree.structure(tree)} but the "
        f"records were made by gl.record_layers with parameters of structure "
        f"{param_tree.treedef}; pass the parameters the recorded function took.")
  leaves = param_tree.treedef.flatten_up_to(tree)
  return {path: LayerParams(leaf, None) for path, leaf in zip(param_tree.paths, leaves)
          if path is not None}


def _marked_sources(api, uses: list[MarkedUse], params, where, other_fix: str):
  """Per hand-marked record name, the indices of its weight and bias among `params`'
  leaves: from `where` (a tree like `params` of 'NAME.w' / 'NAME.b' / None) if given,
  else by finding the recorded weight among the leaves."""
  leaves = jax.tree.leaves(params)
  sources = {use.name: [None, None] for use in uses}
  if where is not None:
    paths, treedef = jax.tree.flatten(where, is_leaf=lambda v: v is None)
    if treedef != jax.tree.structure(params):
      raise ValueError(f"{api}: `where` has the structure {treedef} but `params` has "
                       f"{jax.tree.structure(params)}; give it the structure of the "
                       "parameters with 'NAME.w', 'NAME.b' or None at each leaf.")
    for i, path in enumerate(paths):
      name, _, field = (path or "").rpartition(".")
      if name in sources and field in ("w", "b"):
        sources[name]["wb".index(field)] = i
  else:
    index = {id(v): i for i, v in enumerate(leaves)}
    for use in uses:
      sources[use.name] = [_find(use.layer.w, leaves, index),
                           _find(use.layer.b, leaves, index)]
  missing, bad = [], []
  for use in uses:
    w, b = sources[use.name]
    layer = use.layer
    has_bias = layer.b is not None or layer.options.get("bias", False)
    if w is None or (has_bias and b is None):
      missing.append(use.name)
    for field, i, value in (("w", w, layer.w), ("b", b, layer.b)):
      if i is not None and value is not None and (
          jnp.ndim(leaves[i]) > value.ndim
          or value.shape[value.ndim - jnp.ndim(leaves[i]):] != jnp.shape(leaves[i])):
        bad.append(f"'{use.name}.{field}' is recorded with shape {value.shape} but its "
                   f"parameter has {jnp.shape(leaves[i])}")
  if bad:
    raise ValueError(f"{api}: " + "; ".join(bad) + ". `where` places parameters that "
                     "the layers use as they are (not transposed or reshaped).")
  if missing:
    raise ValueError(
        f"{api}: the layer records {missing} have a weight or bias that is not a leaf of "
        "the `params` given (a parameter-shaped tree is read by each layer's slice, and "
        "a hand-marked record knows no parameter path: its weight is found among the "
        "leaves of the parameters the step hands through). Record the loss with "
        "gl.record_layers (hand-marked layers are then recorded by parameter path), or "
        "pass where=, a tree like the parameters with 'NAME.w' / 'NAME.b' (or None) at "
        f"each leaf, or {other_fix}.")
  return sources


def _listed(names, most: int = 6) -> str:
  names = sorted(names)
  more = f" and {len(names) - most} more" if len(names) > most else ""
  return ", ".join(repr(n) for n in names[:most]) + more


def _unsupported_message(api: str, unsupported: dict[str, dict[str, str]]) -> str:
  """One short message for the uses that have no per-example gradient, with the fix."""
  coupled = [reason for reason in unsupported if reason.startswith(LOSS_MIXES_EXAMPLES)]
  if coupled:  # Then no parameter is per example: the cause is one place in the loss.
    everything = set().union(*unsupported.values())
    return (
        f"{api}: {coupled[0]} ({len(everything)} "
        f"parameter{'s' * (len(everything) > 1)}: {_listed(everything)}). "
        "Fix: run batch norm in evaluation mode (Flax NNX: model.eval() "
        "or BatchNorm(use_running_average=True); linen: use_running_average=True), use "
        "LayerNorm or GroupNorm instead, or compute the batch statistics outside the "
        "loss and pass them in as a non-parameter argument. gl.layer_coverage lists "
        "every parameter and how it is covered.")
  problems = [f"{_listed(params)} ({', '.join(dict.fromkeys(params.values()))}): "
              f"{reason}" for reason, params in unsupported.items()]
  return (
      f"{api}: these parameters have no per-example gradient: " + "; ".join(problems) +
      ". Per-example gradients need each example's loss to depend on that example "
      "alone: use layer or group norm instead of batch norm, and add weight decay in "
      "the optimizer (optax.add_decayed_weights) rather than to the loss"
      + ("" if api == "clipped_grad" else "; or pass names=[...] without these "
         "parameters to analyse the others") +
      ". gl.layer_coverage lists every parameter and how it is covered.")


def _find(value, leaves, index):
  """The index of `value` among `leaves` if it is the same array or tracer (a
  `jit`-ted step hands the recorded weight through); values are never compared."""
  return None if value is None else index.get(id(value))


def collect(api: str, records: dict[str, Any], names: Sequence[str] | None,
            kinds: Sequence[str] = NORM_KINDS, tied: Collection[str] = ()) -> Selection:
  """Checks an analysis's arguments; returns the layer uses it reads.

  `names` name hand-marked records or parameter paths of found records (every use of
  the parameter is read). Without `names`, every layer record whose kind is in
  `kinds` is read (a found parameter when all its uses are); a named one of another
  kind, and any unsupported use read, is an error that says why. `tied` names the
  hand-marked records whose calls share one weight.
  """
  if not isinstance(records, dict):
    raise TypeError(
        f"{api}: expected the dict of records that gl.reap or gl.call_and_reap returns, "
        f"got {type(records).__name__}.")
  tied = {tied} if isinstance(tied, str) else set(tied)
  missing = sorted(tied - set(records))
  if missing:
    raise ValueError(
        f"{api}(tied=...): {missing} are not among the records {sorted(records)}.")
  found_tied = sorted(n for n in tied if is_found_record(records[n]))
  if found_tied:
    raise ValueError(
        f"{api}(tied=...): {found_tied} were found by gl.record_layers, which knows "
        "which calls share a weight; leave them out of tied.")
  groups: dict[str, list] = {}
  for name, record in records.items():
    if is_found_record(record):
      use = FoundUse.of(name, record)
    elif is_layer_record(record):
      use = MarkedUse.of(name, record, tied=name in tied)
    else:
      continue
    for key in use.keys:
      groups.setdefault(key, []).append(use)
  usable = lambda group: all(u.kind in kinds or u.kind == UNSUPPORTED for u in group)
  if names is None:
    chosen = {key: group for key, group in groups.items() if usable(group)}
    if not chosen:
      raise ValueError(
          f"{api}: none of the records {sorted(records)} is a layer record. Record "
          "layers with gl.record_layers(loss) (any model, unchanged), or mark them "
          "with gl.dense, gl.conv2d, gl.embed or gl.layer_norm.")
  else:
    names = [names] if isinstance(names, str) else list(names)
    chosen, bad = {}, []
    for name in names:
      if name not in groups:
        if name not in records:
          bad.append(f"{name!r} is neither a record nor a parameter path among "
                     f"{sorted(set(records) | set(groups))}")
        else:
          bad.append(f"{name!r} is not a layer record (record the model with "
                     "gl.record_layers, or mark the layer with gl.dense, gl.conv2d or "
                     "gl.embed)")
      elif not usable(groups[name]):
        kind = next(u.kind for u in groups[name] if u.kind not in kinds)
        bad.append(f"{name!r} is a layer of kind {kind!r}, which {api} does not support "
                   f"(it supports {', '.join(kinds)}); leave it out of names")
      else:
        chosen[name] = groups[name]
    if bad:
      raise ValueError(f"{api}(names=...): " + "; ".join(bad) + ".")
  for group in chosen.values():
    for use in group:
      if isinstance(use, MarkedUse):
        use.check(api)
  unsupported = {}  # reason: {parameter: where}
  for key, group in chosen.items():
    for use in group:
      if use.kind == UNSUPPORTED:
        unsupported.setdefault(use.spec.reason, {}).setdefault(key, use.spec.where)
  if unsupported:
    raise ValueError(_unsupported_message(api, unsupported))
  return Selection({key: tuple(group) for key, group in chosen.items()})
