"""Where did the NaN come from: the first non-finite cotangent in backward order.

When a step's gradients are non-finite, the records of that step say where the
backward pass first made a NaN or inf: a non-finite cotangent flows back from where
it is made to everything the backward pass visits afterwards, so the site nearest
the loss with a non-finite cotangent is where it started, and the site the backward
pass visited just before it is finite. `find_nonfinite` finds that site on the
device (a small `NonFiniteReport`: found, site, call, examples), inside the jitted
step; `raise_if_nonfinite` turns a report into an error that names the site and the
code to look at, for checking every step.

Backward order. The backward pass reaches record sites in the reverse of the order
the forward pass ran them. Within one name that order is in the record: calls are
stacked in forward order (call 0 first, `scan` iterations in order), so backward
order runs from the last call down. Across names the dict from `reap` does not keep
the order (it is sorted by name), so the caller passes `order`, the record names in
forward order, with one convention for names whose calls interleave:

* a name, e.g. `"embed"`: all its calls run before the next entry's;
* a tuple of names, e.g. `("attn", "mlp")`: their calls interleave, call by call,
  as in k blocks or a `scan` over blocks: attn[0], mlp[0], attn[1], mlp[1], ...
  (every name of the tuple must have the same number of calls).

Within a `record_vjp(..., full=True)` record (all `gl.dense`-style layers), the
inputs come before the output in forward order, so the backward pass reaches the
output cotangent first and the input cotangents after the function's own backward
pass: a non-finite input cotangent with a finite output cotangent was made inside
the recorded function. "First in backward order" is the non-finite cotangent at the
latest position of this forward sequence.

Sharp edges:
  * Records that `gl.record_layers` found know their forward order (`order` may be
    omitted); their names are parameter paths, so the site is the use of a
    parameter nearest the loss whose output cotangent is non-finite.
  * Only cotangents are checked, not primals: a forward-pass NaN (a non-finite loss)
    shows up at the site nearest the loss. Check the loss too.
  * A record's call axes are inferred for layer records (`gl.dense`, ...); for other
    records pass `call_axes` (default 0: the record is one call). The example axis is
    the one after the call axes, in the leaves whose size there is the batch size;
    leaves without it (weight cotangents) count for the site but mark no example.
  * With several call axes (`(k, iterations, ...)`) calls are ordered as the flat
    C-order index, the first axis outermost; `call` is that flat index.
  * `raise_if_nonfinite` reads the small report back to the host: one transfer of
    a few scalars and the batch's flags per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.record import _selection
from oryx_gradlog.record._record import VJPRecord

COTANGENT, INPUTS, OUTPUT = "cotangent", "inputs", "output"
_DESCRIBE_PART = {
    COTANGENT: "the cotangent of {name!r}",
    INPUTS: "the input cotangents of {name!r}",
    OUTPUT: "the output cotangent of {name!r}",
}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["found", "position", "site", "call", "examples"],
    meta_fields=["sites", "call_shapes", "layout"],
)
@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
  """Where the first non-finite cotangent (in backward order) is.

  Attributes:
    found: whether any checked cotangent is non-finite.
    position: its position in the forward sequence of (site, call); -1 if none.
    site: its index into `sites`; -1 if none.
    call: its call index (flat, forward order) within the site's name; -1 if none.
    examples: `(batch,)` flags of the examples whose cotangent is non-finite there.
    sites: static `(name, part)` pairs; part is `"cotangent"` (a tap or
      `record_vjp`), `"output"` or `"inputs"` (a `full=True` record).
    call_shapes: static call-axes shape of each site.
    layout: static `(site indices, calls)` per `order` entry, in forward order.
  """

  found: jax.Array
  position: jax.Array
  site: jax.Array
  call: jax.Array
  examples: jax.Array
  sites: tuple = ()
  call_shapes: tuple = ()
  layout: tuple = ()

  def locate(self, position: int) -> tuple[int, int]:
    """The `(site, call)` at a forward-sequence position (host, static)."""
    start = 0
    for site_ids, calls in self.layout:
      size = len(site_ids) * calls
      if position < start + size:
        call, index = divmod(position - start, len(site_ids))
        return site_ids[index], call
      start += size
    raise IndexError(position)

  def describe(self) -> str:
    """A sentence that names the site, its call and examples (reads the device)."""
    found, position, site, call, examples = jax.device_get(
        (self.found, self.position, self.site, self.call, self.examples))
    if not found:
      return "no record holds a non-finite cotangent."
    name, part = self.sites[site]
    text = (f"the first non-finite cotangent in backward order is "
            f"{_DESCRIBE_PART[part].format(name=name)}{_call_text(self, site, call)}")
    bad = np.flatnonzero(examples)
    if bad.size:
      shown = ", ".join(map(str, bad[:10])) + (", ..." if bad.size > 10 else "")
      text += f", examples [{shown}] ({bad.size} of {examples.size})"
    elif examples.size:
      text += ", in no example's rows (a leaf without an example axis)"
    total = sum(len(ids) * calls for ids, calls in self.layout)
    if position == total - 1:
      return (text + ". It is the site nearest the loss: the non-finite value came "
              "from the derivative of the code after it (up to the loss), or the loss "
              "itself is not finite.")
    next_site, next_call = self.locate(int(position) + 1)
    next_name, next_part = self.sites[next_site]
    if part == INPUTS and next_name == name and next_part == OUTPUT:
      return (text + f". Its output cotangent is finite: the non-finite value was made "
              f"by the backward pass of the function recorded as {name!r} itself.")
    return (text + ". The backward pass reached it right after "
            f"{_DESCRIBE_PART[next_part].format(name=next_name)}"
            f"{_call_text(self, next_site, next_call)}, which "
            f"{'are' if next_part == INPUTS else 'is'} finite: the non-finite value was "
            "made by the derivative of the code between them in the forward pass. Look "
            "there for sqrt, log, pow or a division at 0 or below.")


def _call_text(report, site, call):
  shape = report.call_shapes[site]
  if not shape:
    return ""
  index = np.unravel_index(int(call), shape)
  index = int(index[0]) if len(shape) == 1 else tuple(int(i) for i in index)
  total = shape[0] if len(shape) == 1 else shape
  return f", call {index} of {total}"


def _parts(record):
  if isinstance(record, VJPRecord):
    return ((INPUTS, record.in_cotangents), (OUTPUT, record.out_cotangent))
  return ((COTANGENT, record),)


def _float_leaves(tree):
  return [leaf for leaf in jax.tree.leaves(tree)
          if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def found_order(records) -> list[str | tuple[str, ...]] | None:
  """The forward order of records that `gl.record_layers` found (all of them), with
  the uses in one scan body interleaved; `None` if some record was not found."""
  if not records or not all(_selection.is_found_record(r) for r in records.values()):
    return None
  specs = sorted(((r.primals[0].spec, n) for n, r in records.items()),
                 key=lambda item: item[0].position)
  order = []
  for spec, name in specs:
    last = order[-1] if order else None
    if (spec.scopes and isinstance(last, tuple) and last[0] == spec.scopes
        and last[1] == spec.calls):
      last[2].append(name)
    else:
      order.append((spec.scopes, spec.calls, [name]) if spec.scopes else name)
  return [entry if isinstance(entry, str) else tuple(entry[2]) for entry in order]


def _entries(records, order):
  if order is None:
    order = found_order(records)
  if order is None:
    if len(records) != 1:
      raise ValueError(
          f"find_nonfinite: records {sorted(records)} need an order: pass "
          "order=[names in forward order], with a tuple for names whose calls "
          "interleave, e.g. order=['embed', ('attn', 'mlp'), 'head'].")
    order = list(records)
  entries, seen = [], set()
  for entry in order:
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    if not names or not all(isinstance(n, str) for n in names):
      raise ValueError(f"find_nonfinite(order=...): entry {entry!r} is not a name or a "
                       "tuple of names.")
    entries.append(names)
    seen.update(names)
  missing = sorted(n for e in entries for n in e if n not in records)
  unlisted = sorted(set(records) - seen)
  repeated = sorted(n for n in seen if sum(e.count(n) for e in entries) > 1)
  if missing or unlisted or repeated:
    raise ValueError(
        "find_nonfinite(order=...): " + "; ".join(filter(None, [
            missing and f"{missing} are not among the records",
            unlisted and f"records {unlisted} are not in order",
            repeated and f"{repeated} appear more than once"])) +
        f". List every record name once, in forward order (records: {sorted(records)}).")
  return entries


def _call_axes(name, record, call_axes):
  if isinstance(call_axes, Mapping) and name in call_axes:
    return int(call_axes[name])
  if _selection.is_layer_record(record) or _selection.is_found_record(record):
    return _selection.call_axes(record)
  return 0 if isinstance(call_axes, Mapping) or call_axes is None else int(call_axes)


def find_nonfinite(
    records: dict[str, Any],
    order: Sequence[str | Sequence[str]] | None = None,
    *,
    call_axes: int | Mapping[str, int] | None = None,
    batch_size: int | None = None,
) -> NonFiniteReport:
  """Returns where the first non-finite cotangent in backward order is, on the device.

  Args:
    records: the dict that `gl.reap` / `gl.call_and_reap` returns.
    order: every record name once, in forward order; a tuple of names for calls
      that interleave (see the module docstring). May be omitted for one record,
      and for records that `gl.record_layers` found (they know their order).
    call_axes: leading call axes of records that are not layer records (an int for
      all, or `{name: int}`); layer records know theirs.
    batch_size: the size of the example axis (default: from the first layer
      record in `order`, else the axis after the call axes of the first record).

  Returns:
    A `NonFiniteReport` (jit-compatible); `raise_if_nonfinite(report)` or
    `report.describe()` say it in words.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(w, x):
    ...   h = gl.dense(x, w, name="fc1")
    ...   return jnp.sum(gl.dense(jnp.sqrt(h), w, name="fc2"))  # d sqrt(0) = inf
    >>> records = gl.reap(jax.grad(loss))(jnp.eye(2), jnp.array([[1.0, 0.0], [1.0, 1.0]]))
    >>> report = gl.find_nonfinite(records, ["fc1", "fc2"])
    >>> report.sites[int(report.site)], int(report.call), report.examples
    (('fc1', 'output'), 0, Array([ True, False], dtype=bool))
  """
  entries = _entries(records, order)
  sites, call_shapes, layout, flags, example_flags = [], [], [], [], []
  axes = {n: _call_axes(n, records[n], call_axes) for e in entries for n in e}
  if batch_size is None:
    batch_size = _infer_batch_size(entries, records, axes)
  for names in entries:
    shapes = {n: _calls_shape(n, records[n], axes[n]) for n in names}
    counts = {math.prod(s) for s in shapes.values()}
    if len(counts) != 1:
      raise ValueError(
          f"find_nonfinite(order=...): the names {names} interleave but have call "
          f"shapes {shapes}; names in one tuple must have the same number of calls.")
    (calls,) = counts
    site_ids, entry_flags, entry_examples = [], [], []
    for name in names:
      for part, tree in _parts(records[name]):
        site_ids.append(len(sites))
        sites.append((name, part))
        call_shapes.append(shapes[name])
        flag, example = _nonfinite(tree, calls, axes[name], batch_size)
        entry_flags.append(flag)
        entry_examples.append(example)
    layout.append((tuple(site_ids), calls))
    flags.append(jnp.stack(entry_flags, axis=1).reshape(-1))
    example_flags.append(jnp.stack(entry_examples, axis=1).reshape(-1, batch_size))
  flags = jnp.concatenate(flags)
  example_flags = jnp.concatenate(example_flags)
  site_of = np.concatenate([np.tile(ids, calls) for ids, calls in layout])
  call_of = np.concatenate([np.repeat(np.arange(calls), len(ids)) for ids, calls in layout])
  found = jnp.any(flags)
  position = flags.shape[0] - 1 - jnp.argmax(flags[::-1])
  return NonFiniteReport(
      found=found,
      position=jnp.where(found, position, -1).astype(jnp.int32),
      site=jnp.where(found, jnp.asarray(site_of, jnp.int32)[position], -1),
      call=jnp.where(found, jnp.asarray(call_of, jnp.int32)[position], -1),
      examples=example_flags[position] & found,
      sites=tuple(sites),
      call_shapes=tuple(call_shapes),
      layout=tuple(layout),
  )


def _calls_shape(name, record, n):
  leaves = _float_leaves(record)
  shapes = {jnp.shape(leaf)[:n] for leaf in leaves}
  if len(shapes) > 1 or any(jnp.ndim(leaf) < n for leaf in leaves):
    raise ValueError(
        f"find_nonfinite(call_axes=...): record {name!r} has leaves of shapes "
        f"{[jnp.shape(leaf) for leaf in leaves]}, which do not share {n} leading call "
        "axes. Pass the number of leading axes that are calls, e.g. "
        f"call_axes={{{name!r}: 1}}.")
  return shapes.pop() if shapes else ()


def _infer_batch_size(entries, records, axes):
  names = [n for e in entries for n in e]
  layers = [n for n in names if _selection.is_layer_record(records[n])]
  for name in layers + names:
    for leaf in _float_leaves(_parts(records[name])[-1][1]) + _float_leaves(records[name]):
      if jnp.ndim(leaf) > axes[name]:
        return jnp.shape(leaf)[axes[name]]
  return 0


def _nonfinite(tree, calls, n, batch_size):
  """`(calls,)` flags and `(calls, batch)` example flags of non-finite entries."""
  flag = jnp.zeros((calls,), bool)
  example = jnp.zeros((calls, batch_size), bool)
  for leaf in _float_leaves(tree):
    bad = ~jnp.isfinite(leaf)
    flag = flag | jnp.any(bad.reshape(calls, -1), axis=1)
    if batch_size and jnp.ndim(leaf) > n and jnp.shape(leaf)[n] == batch_size:
      example = example | jnp.any(bad.reshape(calls, batch_size, -1), axis=2)
  return flag, example


def raise_if_nonfinite(report: NonFiniteReport) -> None:
  """Raises `FloatingPointError` naming the site in `report` if it found one.

  Call it after each step on the report the jitted step returned, to stop at the
  first step whose backward pass made a NaN or inf, with the layer that made it.

  Args:
    report: from `find_nonfinite`.

  Raises:
    FloatingPointError: if `report.found`, with `report.describe()` in the message.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda x: jnp.sum(jnp.log(gl.tap(x, name="x")))
    >>> report = gl.find_nonfinite(gl.reap(jax.grad(loss))(jnp.array([1.0, 0.0])))
    >>> gl.raise_if_nonfinite(report)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FloatingPointError: raise_if_nonfinite: the first non-finite cotangent in backward order is the cotangent of 'x', examples [1] (1 of 2). It is the site nearest the loss: ...
  """
  if not isinstance(report, NonFiniteReport):
    raise TypeError(
        f"raise_if_nonfinite: expected the NonFiniteReport of gl.find_nonfinite, got "
        f"{type(report).__name__}.")
  if bool(jax.device_get(report.found)):
    raise FloatingPointError(
        f"raise_if_nonfinite: {report.describe()} Records in backward order: "
        f"{_backward_order(report)}.")


def _backward_order(report):
  names = []
  for site_ids, _ in report.layout:
    for site in site_ids:
      name = report.sites[site][0]
      if name not in names:
        names.append(name)
  return " <- ".join(repr(n) for n in names[::-1]) if names else "none"
