"""The emitter: the traced jaxpr evaluated again, each use wrapped in a record site.

Evaluates the jaxpr as `jax.core.eval_jaxpr` does, under whatever transformations
are active, with the output of every use the walk found marked by one record site
that also holds its `LayerUse` (`_sites.mark_use`), so that a reap collects a
`VJPRecord` per use whose `primals[0]` is the `LayerUse`. A dense or convolution use
whose output only its bias reads (`_Analysis.paired`) is marked by its bias's site,
which holds both `LayerUse`s: an add passes its cotangent on unchanged, so the one
cotangent is both records'. With input cotangents asked for, each use is bound
inside `record_vjp(..., full=True)` instead (two sites a use).

Sharp edges:
  * Inner `jit`s that hold uses are inlined (their shardings are not kept).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

from oryx_gradlog.record import _internals, _sites
from oryx_gradlog.record._record import record_vjp
from oryx_gradlog.record.record_layers._spec import LayerUse, UseSpec, _apply_use
from oryx_gradlog.record.record_layers._walk import _Analysis


# ----------------------------------------------------------------------------------
# Re-emitting the jaxpr with the uses recorded.


class _Emitter:
  """Evaluates a jaxpr as `jax.core.eval_jaxpr` does, recording the uses."""

  def __init__(self, analysis: _Analysis, specs: dict[tuple, UseSpec], tag: str,
               in_cotangents: bool = False):
    self.analysis, self.specs, self.tag = analysis, specs, tag
    self.in_cotangents = in_cotangents
    self.values: dict[tuple, Any] = {}
    self.layers: dict[tuple, LayerUse] = {}  # Layers waiting for their bias's site.

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
        outs = self.use(path, invals)
      elif path in self.analysis.marked and eqn.params["tag"] == self.tag:
        outs = invals  # A hand-marked layer's site: its uses are recorded instead.
      elif path in self.analysis.inline:
        outs = _EMIT[eqn.primitive](self, eqn, invals, path)
      else:
        outs = _internals.bind_eqn(eqn.primitive, eqn.params, invals, eqn.ctx)
      for var, value in zip(eqn.outvars, outs):
        values[(invocation, var)] = value
    return [read(v) for v in jaxpr.outvars]

  def use(self, path: tuple, invals):
    spec = self.specs[path]
    chain_inputs = () if spec.chain is None else tuple(
        self.values[key] for key in spec.chain.keys)
    layer = LayerUse(tuple(invals), chain_inputs, spec)
    if self.in_cotangents:
      out = record_vjp(_apply_use, name=spec.name, tag=self.tag, full=True)(layer)
    elif path in self.analysis.paired:  # Marked at its bias's site.
      self.layers[self.analysis.paired[path]] = layer
      out = _apply_use(layer)
    else:
      layers = (self.layers.pop(path), layer) if path in self.layers else (layer,)
      out = _sites.mark_use(_apply_use(layer), layers, tag=self.tag,
                            name=_sites.joined_name([l.spec.name for l in layers]))
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
    _internals.jit_p: _emit_jit,
    _internals.closed_call_p: _emit_jit,
    _internals.call_p: _emit_jit,
    _internals.remat_p: _emit_remat,
    _internals.cond_p: _emit_cond,
    _internals.scan_p: _emit_scan,
}
