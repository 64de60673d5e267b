"""The transformation: `record_layers(fun)`, traced once per input signature.

`trace` traces `fun` at B (and at 2B where one trace does not tell its batch axes,
`_propagate.py`), walks it (`_walk.py`), checks completeness (every
parameter leaf the loss depends on has a use), names the uses by parameter path and
caches all of it per signature; the returned function re-emits the jaxpr with the
uses recorded (`_emit.py`).

Sharp edges:
  * Traces are cached per shapes and dtypes of the call's arguments (and the values
    of its hashable static ones).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog.record import _internals
from oryx_gradlog.record._kinds import LOSS_MIXES_EXAMPLES, UNSUPPORTED
from oryx_gradlog.record._sites import DEFAULT_TAG
from oryx_gradlog.record.record_layers import _propagate
from oryx_gradlog.record.record_layers._emit import _Emitter
from oryx_gradlog.record.record_layers._signature import Signature, Traced
from oryx_gradlog.record.record_layers._spec import Lineage, ParamTree, UseSpec
from oryx_gradlog.record.record_layers._walk import (
    _CONST, Info, _Analysis, _TraceMismatch, _where)


def trace(api: str, fun: Callable, args, kwargs, argnums, batch_argnums,
          cache: dict | None = None) -> tuple[Traced, Signature]:
  """Traces `fun` at B (and 2B where needed), analyses it and names its uses."""
  signature = Signature(api, args, kwargs, argnums, batch_argnums)
  key = signature.key()
  if cache is not None and key in cache:
    return cache[key], signature
  flat = signature.flat_fun(fun)
  closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*signature.specs(1))
  dynamic_kinds = [k for k in signature.kinds if k != "static"]
  dynamic_names = [n for n, k in zip(signature.names, signature.kinds) if k != "static"]
  try:
    analysis, outs = _walk(flat, closed, signature, dynamic_kinds, dynamic_names)
  except _TraceMismatch as error:
    raise ValueError(
        f"{api}: the function traced differently at batch sizes "
        f"{signature.batch_size} and {2 * signature.batch_size}: {error}. "
        "record_layers finds the batch axis by tracing at both sizes; make the "
        "function's structure independent of the batch size (no Python branch on "
        "x.shape[0]).") from None
  # A use whose output reaches the loss only through stop_gradient (a target from the
  # same weights, labels sampled from the model) has a zero cotangent: not a use.
  live_equations, live = _gradient_paths(closed.jaxpr, 0)
  for path in [p for p in analysis.uses if p[0] not in live_equations]:
    del analysis.uses[path]
  if outs and outs[0].coupled:  # The loss mixes examples: nothing is per example.
    for use in analysis.uses.values():
      if use.kind != UNSUPPORTED:
        use.kind = UNSUPPORTED
        use.reason = (f"{LOSS_MIXES_EXAMPLES} at {analysis.coupling} (a "
                      "value reduced over the batch is used per example again, as batch "
                      "norm does in training), so no parameter has a per-example "
                      "gradient")
  _check_complete(api, closed.jaxpr, analysis, dynamic_kinds, dynamic_names, live)
  analysis.paired = {use.shifts: path for path, use in analysis.uses.items()
                     if use.sole and use.shifts in analysis.uses}
  params = tuple((n, tuple(v.aval.shape), v.aval.dtype)
                 for n, k, v in zip(dynamic_names, dynamic_kinds, closed.jaxpr.invars)
                 if k == "param")
  traced = Traced(closed, analysis, _name_uses(analysis, signature.tree, dynamic_names),
                  jax.tree.structure(out_shape), params, signature.batch_size)
  if cache is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    cache[key] = traced
  return traced, signature


def _walk(flat, closed, signature: Signature, kinds, names, one_trace: bool = True):
  """The walk of `closed` (at batch B) and the infos of its outputs, with batch axes
  propagated from the one trace (`_propagate`) where it tells them, else from a
  second trace at 2B (`one_trace=False`: always)."""
  def walk(propagation, twin):
    analysis = _Analysis(signature.batch_size, propagation)
    ins = []
    for i, (kind, name, var, var2) in enumerate(zip(
        kinds, names, closed.jaxpr.invars, twin.jaxpr.invars)):
      if kind == "param":
        ins.append(Info(params=frozenset({i}), lineage=Lineage(i, name)))
      elif kind == "batch":
        ins.append(Info(data=True, batch=analysis.batch((), var, var2)))
      else:
        ins.append(_CONST)
    return analysis, analysis.run(closed.jaxpr, twin.jaxpr, ins)

  if one_trace:
    try:
      return walk(_propagate.batch_axes(closed.jaxpr, [k == "batch" for k in kinds],
                                        signature.batch_size), closed)
    except _propagate.Ambiguous:
      pass
  return walk(None, jax.make_jaxpr(flat)(*signature.specs(2)))


def _gradient_paths(jaxpr, output: int) -> tuple[set[int], set]:
  """The top-level equations and the variables through which output `output` (the
  loss) depends on floating values: not through `stop_gradient`, integer or boolean
  values (a comparison, a `cond`'s index) or other outputs, which carry no
  gradient. Conservative through bodies (an equation's outputs depend on all its
  inputs)."""
  out = jaxpr.outvars[output]
  live = set() if isinstance(out, jax.extend.core.Literal) else {out}
  equations = set()
  for k in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[k]
    if not any(v in live for v in eqn.outvars):
      continue
    equations.add(k)
    if eqn.primitive.name == "stop_gradient":
      continue
    live.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)
                and hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact))
  return equations, live


def _differentiable_inputs(jaxpr, live) -> list[bool]:
  """Which inputs the loss depends on differentiably: JAX's dead-code elimination
  (which knows every primitive's bodies), and a gradient path (`_gradient_paths`'
  variables `live`)."""
  used = _internals.used_inputs(jaxpr, 0)
  return [u and v in live and jnp.issubdtype(v.aval.dtype, jnp.inexact)
          for u, v in zip(used, jaxpr.invars)]


def _check_complete(api, jaxpr, analysis: _Analysis, arg_kinds, names, live) -> None:
  """Completeness, checked on every trace: every float parameter leaf that the loss
  (the first output) depends on differentiably (`_differentiable_inputs`) has a use
  (a record, perhaps `unsupported` with its reason). A leaf that reaches the loss by a
  path the walk did not classify is an error naming the leaf and where it goes."""
  used = _differentiable_inputs(jaxpr, live)
  covered = frozenset().union(*(use.leaves for use in analysis.uses.values()))
  missing = []
  for i, (kind, name, var, needed) in enumerate(zip(arg_kinds, names, jaxpr.invars, used)):
    if (kind != "param" or not needed or i in covered
        or not jnp.issubdtype(var.aval.dtype, jnp.inexact)):
      continue
    first = next((e for e in jaxpr.eqns if var in e.invars), None)
    missing.append(f"{name!r} (first read by {_where(first)})" if first is not None
                   else f"{name!r} (returned as it is)")
  if missing:
    raise ValueError(
        f"{api}: the parameters {', '.join(missing)} reach the loss without meeting the "
        "batch anywhere that record_layers can see, so they have no per-example gradient "
        "and would be left out silently. Make each parameter's effect on the loss go "
        "through the examples (a term of the parameters alone belongs in the optimizer, "
        "e.g. optax.add_decayed_weights), or pass argnums without them.")


def _name_uses(analysis: _Analysis, tree: ParamTree, names) -> dict[tuple, UseSpec]:
  counts: dict[str, int] = {}
  specs = {}
  for path, use in sorted(analysis.uses.items()):
    # A use with no lineage (a parameter carried through a loop) by its leaves' names.
    paths = use.paths() or tuple(sorted(names[i] for i in use.leaves))
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
        reason=use.reason, where=_where(eqn), tree=tree, shifts=use.shifts)
  return specs


def record_layers(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    tag: str = DEFAULT_TAG,
    in_cotangents: bool = False,
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
    in_cotangents: also record each use's input cotangents (`VJPRecord.in_cotangents`:
      a `LayerUse` of the cotangents of its operands and chain inputs), with a second
      record site per use. By default a record holds the primals and the output
      cotangent only, all that the analyses read (`in_cotangents` is `None`), which
      traces faster.

  Returns:
    A function with `fun`'s signature that returns what `fun` returns: a loss that
    returns `(loss, aux)` is differentiated with `jax.grad(..., has_aux=True)`, as
    without `record_layers`.

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
                  api="record_layers", in_cotangents=in_cotangents)


def recorder(fun, *, argnums, batch_argnums, tag, api, in_cotangents=False
             ) -> Callable[..., Any]:
  """`record_layers` for the public function `api` (whose name its errors give)."""
  cache: dict = {}

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    traced, signature = trace(api, fun, args, kwargs, argnums, batch_argnums, cache)
    emitter = _Emitter(traced.analysis, traced.specs, tag, in_cotangents)
    closed = traced.jaxpr
    outs = emitter.run(closed.jaxpr, closed.consts, signature.dynamic())
    return jax.tree.unflatten(traced.out_tree, outs)

  return wrapped
