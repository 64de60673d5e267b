"""Reaping: `reap` and `call_and_reap` collect records as a dict on the device.

A reaped call runs the user's function under an Oryx harvest trace whose context
(`_Collector`) keeps every record site's sow in the order it arrives. Each
differentiated call of a site sows under names unique to it (`_sites.py`), so Oryx
never sees a name twice inside a `jit`, `scan`, `cond` or `checkpoint` body. Its
`SITE` sow arrives on the forward pass, in forward order; its `RECORD` sow when the
backward pass reaches it, in reverse. The collector pairs them by uid, so records
come out in forward call order (index 0 is the first call) even when backward
passes interleave with forward ones, fills zeros for a call no backward pass
reached (`stop_gradient`), and stacks repeated calls along a new leading axis.

Records are the backward pass's own arrays: they are outputs of the traced
program, never copied to the host, and under `jit` they are outputs of the one
compiled program.

Sharp edges:
  * A name used once gives its record as it is; a name used k > 1 times gives the k
    records stacked along a new leading axis (forward call order). Under `vmap`
    inside the reaped function the batch axis comes next: `(k, batch, ...)`. Inside
    `lax.scan` the iterations stack: `(iterations, ...)`, or `(k, iterations, ...)`
    for k calls of one name per iteration.
  * When several backward passes run inside one reaped function (a `jax.grad`
    inside the loss, as in MAML), each call's record joins the same name, in forward
    call order (MAML: the inner step's call, then the outer loss's). Reap the inner
    gradient with its own `call_and_reap` to keep its records in a separate dict.
  * A reap collects the sites of one tag; a nested reap of the same tag takes the
    records made inside it, and the outer reap does not see them.
  * A reap that traced record sites of other tags but none of its own raises an
    error naming the tags it saw (noted while tracing: nothing runs per call). A
    function with no record sites at all reaps `{}`.
  * A function traced once and called several times inside a `jit` or `checkpoint`
    body (JAX reuses its trace) cannot be reaped twice by Oryx; this is an error
    that says what to do.
  * Sites inside `lax.while_loop` (or a `fori_loop` with traced bounds) cannot be
    stacked and give an error; a `fori_loop` with Python int bounds is a scan.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.record import _flax_nnx, _oryx_rules, _sites  # noqa: F401
from oryx_gradlog.record._internals import harvest, take_current_trace
from oryx_gradlog.record._record import VJPRecord
from oryx_gradlog.record._sites import DEFAULT_TAG


@dataclasses.dataclass
class _Collector(harvest.ReapContext):
  """Oryx reap context that keeps record-site sows in arrival order.

  It also notes the tags of record sites it sees sown under other tags (Oryx hands
  every sow to the context, and the reap rules of `jit`, `scan` and `cond` bodies
  report theirs through `note_tags`), all while tracing, so that a reap that finds
  none of its own can say which tags were there.
  """

  arrivals: list = dataclasses.field(default_factory=list)
  other_tags: set = dataclasses.field(default_factory=set)

  def process_sow(self, *values, name, tag, mode, tree):
    if tag != self.settings.tag and _sites.parse_sow_name(name) is not None:
      self.other_tags.add(tag)
    return super().process_sow(*values, name=name, tag=tag, mode=mode, tree=tree)

  def note_tags(self, tags) -> None:
    """Notes the tags of record sites sown inside a body that a reap rule reaps."""
    self.other_tags.update(t for t in tags if t != self.settings.tag)

  def handle_sow(self, *values, name, tag, tree, mode):
    if _sites.parse_sow_name(name) is None:  # A plain Oryx sow: Oryx's semantics.
      return super().handle_sow(*values, name=name, tag=tag, tree=tree, mode=mode)
    self.arrivals.append((name, jax.tree.unflatten(tree, values)))
    return values


def call_and_reap(
    f: Callable[..., Any], *, tag: str = DEFAULT_TAG
) -> Callable[..., tuple[Any, dict[str, Any]]]:
  """Returns a function that calls `f` and also returns the records it made.

  Args:
    f: typically `jax.grad(loss)`, `jax.value_and_grad(loss)` or any function that
      runs a backward pass through record sites.
    tag: collect the sites of this tag.

  Returns:
    A function with the signature of `f` that returns `(f(...), records)`, where
    `records` maps each record name to its arrays (see the module docstring).

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w: jnp.sum(gl.tap(w * 3.0, name="h") ** 2)
    >>> grads, records = gl.call_and_reap(jax.grad(loss))(jnp.ones(2))
    >>> grads, records["h"]
    (Array([18., 18.], dtype=float32), Array([6., 6.], dtype=float32))
  """
  return _reaper(f, tag=tag, api="call_and_reap")


def reap(f: Callable[..., Any], *, tag: str = DEFAULT_TAG) -> Callable[..., dict[str, Any]]:
  """Returns a function that calls `f` and returns only the records it made.

  Args:
    f: typically `jax.grad(loss)`.
    tag: collect the sites of this tag.

  Returns:
    A function with the signature of `f` that returns a dict of records.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> mvm = gl.record_vjp(lambda x, w: x @ w, name="mvm")
    >>> loss = lambda x, w: jnp.sum(mvm(mvm(x, w), w))
    >>> jax.tree.map(jnp.shape, gl.reap(jax.grad(loss))(jnp.ones(3), jnp.eye(3)))
    {'mvm': ((2, 3), (2, 3, 3))}
  """
  call = _reaper(f, tag=tag, api="reap")
  return functools.wraps(f)(lambda *args, **kwargs: call(*args, **kwargs)[1])


def _reaper(f, *, tag, api):
  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    collector = _Collector(harvest.HarvestSettings(tag, frozenset(), None, False), {})
    arguments = _flax_nnx.Arguments(args, kwargs)
    try:
      with _sites.reaping(tag), harvest.harvest_trace(collector):
        args, kwargs = arguments.inside()
        out = f(*args, **kwargs)
      out = arguments.outside(out)
    except Exception as error:
      _close_suspended_transformations(error)
      if isinstance(error, ValueError):
        _reraise_oryx_error(error, api)
      raise
    records = {name: reap.value for name, reap in collector.reaps.items()}
    records.update(_assemble(collector.arrivals, api))
    if not records and collector.other_tags:
      tags = sorted(map(repr, collector.other_tags))
      raise ValueError(
          f"{api}(tag={tag!r}): the function traced record sites of tag {' and '.join(tags)} "
          f"but none of tag {tag!r}, so there is nothing to reap. Pass tag={tags[0]} to "
          f"{api}, or mark the sites with tag={tag!r}.")
    return out, records

  return wrapped


# What makes each component.
_MAKERS = {_sites.COTANGENT: "tap or record_vjp without full=True",
           _sites.INPUTS: "record_vjp(..., full=True)", _sites.OUTPUT: "record_vjp(..., full=True)",
           _sites.USE: "record_layers"}


def _assemble(arrivals, api):
  """Pairs site and record sows, then stacks the calls of each name."""
  sites, records = [], collections.defaultdict(list)
  for sow_name, value in arrivals:
    name, kind, component, uid = _sites.parse_sow_name(sow_name)
    if kind == _sites.SITE:
      sites.append((name, component, uid, value))
    else:
      records[uid].append((name, component, value))
  for values in records.values():
    # One uid arrives several times when JAX reuses a trace; its backward pass
    # reaches the calls in reverse.
    values.reverse()
  calls = collections.defaultdict(lambda: collections.defaultdict(list))
  for name, component, uid, (primals, shapes) in sites:
    if records[uid]:
      cotangents = records[uid].pop(0)[2]
    else:  # No backward pass reached this call: its cotangents are zero.
      cotangents = jax.tree.map(lambda s: jnp.zeros(s.shape[:-1], s.dtype), shapes)
    _add_call(calls, name, component, primals, cotangents)
  for name, component, cotangents in itertools.chain(*reversed(records.values())):
    # Records whose site sow came before the reap (reaping the pullback of jax.vjp)
    # or went to an inner reap: in forward order, after the paired ones.
    _add_call(calls, name, component, None, cotangents)
  result = {}
  for name, by_component in calls.items():
    stacked = {c: _stack(api, name, values) for c, values in by_component.items()}
    if set(stacked) == {_sites.COTANGENT}:
      result[name] = stacked[_sites.COTANGENT]
    elif set(stacked) == {_sites.USE}:
      use, cotangent = stacked[_sites.USE]
      result[name] = VJPRecord(None if use is None else (use,), cotangent, None)
    elif not {_sites.COTANGENT, _sites.USE} & set(stacked):
      primals, in_cotangents = stacked.get(_sites.INPUTS, (None, None))
      result[name] = VJPRecord(primals, stacked.get(_sites.OUTPUT), in_cotangents)
    else:
      makers = sorted(_MAKERS[c] for c in set(stacked))
      raise ValueError(
          f"{api}: record {name!r} is made both by {' and by '.join(dict.fromkeys(makers))}, "
          "so its records have different kinds. Give the sites distinct names."
      )
  return dict(sorted(result.items()))


def _add_call(calls, name, component, primals, cotangents) -> None:
  """Adds one call's record to `calls[name][component]`. A site of found uses holds
  one use, or a layer and its bias (names joined; an add passes its cotangent on
  unchanged, so the output cotangent is both uses'), and adds `(use, output
  cotangent)` under each use's name."""
  if component == _sites.USE:  # primals: ((use, ...), None); cotangents: (_, g).
    for i, use_name in enumerate(_sites.split_name(name)):
      calls[use_name][component].append(
          (None if primals is None else primals[0][i], cotangents[1]))
  elif component == _sites.INPUTS:
    calls[name][component].append((primals, cotangents))
  else:
    calls[name][component].append(cotangents)


def _describe(record):
  return jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", record)


def _stack(api, name, values):
  if len(values) == 1:
    return values[0]
  first = values[0]
  for index, value in enumerate(values[1:], start=1):
    same_tree = jax.tree.structure(value) == jax.tree.structure(first)
    if not same_tree or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(value))
    ):
      raise ValueError(
          f"{api}: record {name!r} was made by {len(values)} calls, and calls 0 and "
          f"{index} recorded {_describe(first)} and {_describe(value)}, which cannot "
          f"be stacked. Give each call its own name, e.g. "
          f"record_vjp(f, name='{name}_{index}')."
      )
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *values)


def _close_suspended_transformations(error):
  """Closes the `lu.transformation` generators an error left suspended, innermost first.

  Oryx reaps `jit`, `scan` and `cond` bodies inside old-style JAX transformations
  (`jax._src.linear_util.transformation`) that hold a harvest trace open across a
  `yield`. An error inside leaves them suspended, referenced by the traceback; when
  the traceback is collected later (pytest and notebooks keep it a while), closing
  them resets JAX's current trace to a stale one, and every later JAX call fails with
  an UnexpectedTracerError. So close them now, and keep the current trace.
  """
  frames, seen = {}, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    tb = error.__traceback__
    while tb is not None:
      frame = tb.tb_frame  # JAX filters tracebacks, so also walk up from each frame.
      while frame is not None and id(frame) not in frames:
        frames[id(frame)] = frame
        frame = frame.f_back
      tb = tb.tb_next
    error = error.__cause__ or error.__context__
  suspended = []  # (depth of the frame that holds the generator, generator)
  for frame in frames.values():
    gen = frame.f_locals.get("gen_inst")
    if inspect.isgenerator(gen) and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
      suspended.append((_depth(frame), gen))
  # Each generator restores the trace that was current when it started, which is
  # stale by now: close them innermost first, then put back the current trace.
  with take_current_trace():
    for _, gen in sorted(suspended, key=lambda item: -item[0]):
      gen.close()


def _depth(frame):
  depth = 0
  while frame is not None:
    depth, frame = depth + 1, frame.f_back
  return depth


def _reraise_oryx_error(error, api):
  """Re-raises an Oryx harvest error about a record site in words about the site."""
  message = str(error)
  if message.startswith("record "):  # Raised by a record site's own rule.
    raise ValueError(f"{api}: {message}") from error
  sow_names = [word.strip("'`.:") for word in message.split()]
  sites = [_sites.parse_sow_name(word) for word in sow_names]
  name = next((_sites.split_name(site[0])[0] for site in sites if site), None)
  if name is None:
    return
  if "already been reaped" in message:
    raise ValueError(
        f"{api}: record {name!r} comes from a function that JAX traced once and "
        "called several times inside a jax.jit or jax.checkpoint body, and Oryx "
        "cannot reap one trace twice there. Apply jax.jit to the whole step "
        "instead of to the repeated function, or give each call its own record "
        "name."
    ) from error
  if "while_loop" in message:
    raise ValueError(
        f"{api}: record {name!r} is made inside lax.while_loop (or lax.fori_loop "
        "with traced bounds), whose iterations cannot be stacked. Use lax.scan or "
        "lax.fori_loop with Python int bounds (a scan), or reap inside the loop "
        "body with call_and_reap and carry what you need."
    ) from error
  raise ValueError(f"{api}: record {name!r}: {message}") from error
