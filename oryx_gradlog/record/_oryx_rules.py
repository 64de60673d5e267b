"""Oryx reap rules for `lax.scan`, `lax.cond` and sharded `jit` that record sites need.

Oryx reaps a `scan` or `cond` body by rebuilding the loop or the branches so that
they also return the body's sows. Two cases that record sites hit every day fail in
Oryx 0.2.9, and importing `oryx_gradlog` installs rules for them in Oryx's
`reap_custom_rules` registry:

* `scan` with `append` sows. Oryx's rule builds the new scan's `linear` flags from
  the old constant count although the rebuilt body has a different number of
  constants, so the flags no longer line up with the operands. Whenever JAX later
  reads them (dead-code elimination of an eager scan, `grad` with `argnums` that
  leave some scan inputs undifferentiated, `vmap`, `grad` of `grad`), it fails with
  "safe_zip() argument 2 is shorter than argument 1". Reaping the function that
  `jax.vjp` returns usually got lucky with the counts, which is why it seemed to
  work. Our rule rebuilds the loop with `lax.scan` itself, which keeps its own
  flags right. Oryx's main branch (@aa33090, @9b9ef13) no longer fails here; the
  rule stays for Oryx 0.2.9, and is one code path on every supported JAX.
* `cond`/`switch` whose branches sow different names: Oryx raises "Mismatching
  number of sows" / "Missing sow in branch". A record site in one branch only is
  exactly that. Our rule has each branch return the records of all branches, with
  zeros for the ones it does not make.
* Bodies with no sow at all (the small jits inside `jax.numpy`, say): Oryx traces
  each body twice to reap it; ours bind them unchanged (`_unless_sow_free`).
* `jit` with `in_shardings`/`out_shardings` (data parallelism inside the reaped
  function): Oryx refuses it ("oryx only supports pjit which has no
  in_axis_resources"). Our rule compiles the reaped body with the same shardings and
  leaves the records' shardings to XLA, which keeps them like their activations.

Sharp edges:
  * These rules take over only in those cases; other scans, conds and jits (clobber
    sows, matching branches, no shardings) go to Oryx's own rules unchanged. The registry is global, so
    this applies to every Oryx reap in the process.
  * The canary tests in `tests/record/test_oryx_canaries.py` say which of these cases
    each Oryx still fails, so a rule can be deleted once no supported Oryx needs it.
  * The primitives and Oryx internals used here come from `_internals.py`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._internals import (
    UnspecifiedValue,
    cond_p,
    harvest,
    jaxpr_as_fun,
    jaxprs_in_params,
    jit_p,
    remat_p,
    scan_p,
    set_current_trace,
    subjaxprs,
    while_p,
)
from oryx_gradlog.record._sites import parse_sow_name

_oryx_scan_rule = harvest.reap_custom_rules[scan_p]
_oryx_cond_rule = harvest.reap_custom_rules[cond_p]
_oryx_pjit_rule = harvest.reap_custom_rules[jit_p]


def _reap_settings(trace) -> dict[str, Any]:
  settings = trace.context.settings
  return {
      "tag": settings.tag,
      "allowlist": settings.allowlist,
      "blocklist": settings.blocklist,
      "exclusive": settings.exclusive,
  }


def _resow(trace, reaps: dict[str, Any]) -> None:
  for name, value in reaps.items():
    harvest._sow(  # pylint: disable=protected-access
        trace, value, tag=trace.context.settings.tag, name=name, mode="append"
    )


def _sow_modes(trace, jaxpr, *args) -> dict[str, Any]:
  return harvest._get_harvest_metadata(  # pylint: disable=protected-access
      jaxpr, trace.context.settings, *args
  )


def _reap_scan_rule(trace, *vals, jaxpr, num_consts, num_carry, length, reverse, **params):
  consts, carry, xs = vals[:num_consts], vals[num_consts : num_consts + num_carry], vals[num_consts + num_carry :]
  with set_current_trace(trace.parent_trace):
    x_first = [x[0] for x in xs]
  metadata = _sow_modes(trace, jaxpr, *consts, *carry, *x_first)
  if any(meta["mode"] != "append" for meta in metadata.values()):
    return _oryx_scan_rule(
        trace, *vals, jaxpr=jaxpr, num_consts=num_consts, num_carry=num_carry,
        length=length, reverse=reverse, **params)

  body = harvest.call_and_reap(jaxpr_as_fun(jaxpr), **_reap_settings(trace))

  def step(carry, x):
    out, reaps = body(*consts, *carry, *x)
    return out[:num_carry], (out[num_carry:], reaps)

  with set_current_trace(trace.parent_trace):
    carry_out, (ys, reaps) = lax.scan(
        step, list(carry), list(xs), length=length, reverse=reverse,
        unroll=params["unroll"])
  _resow(trace, reaps)
  return [*carry_out, *ys]


def _reap_cond_rule(trace, index, *ops, branches, **params):
  metadata = [_sow_modes(trace, branch, *ops) for branch in branches]
  names = {name: meta for branch in metadata for name, meta in branch.items()}
  if all(set(branch) == set(names) for branch in metadata) or any(
      meta["mode"] != "append" for meta in names.values()
  ):
    return _oryx_cond_rule(trace, index, *ops, branches=branches, **params)

  def all_records(branch):
    run = harvest.call_and_reap(jaxpr_as_fun(branch), **_reap_settings(trace))

    def wrapped(*ops):
      out, reaps = run(*ops)
      zeros = {
          name: jax.tree.map(lambda aval: jnp.zeros(aval.shape, aval.dtype), meta["aval"])
          for name, meta in names.items()
          if name not in reaps
      }
      return out, {**reaps, **zeros}

    return wrapped

  with set_current_trace(trace.parent_trace):
    out, reaps = lax.switch(index, [all_records(b) for b in branches], *ops)
  _resow(trace, reaps)
  return out


def _reap_pjit_rule(trace, *invals, jaxpr, in_shardings, out_shardings, **params):
  if all(isinstance(s, UnspecifiedValue) for s in (*in_shardings, *out_shardings)):
    return _oryx_pjit_rule(trace, *invals, jaxpr=jaxpr, in_shardings=in_shardings,
                           out_shardings=out_shardings, **params)
  body = harvest.call_and_reap(jaxpr_as_fun(jaxpr), **_reap_settings(trace))
  unspecified = lambda shardings: [None if isinstance(s, UnspecifiedValue) else s
                                   for s in shardings]
  with set_current_trace(trace.parent_trace):
    out, reaps = jax.jit(
        body,
        in_shardings=unspecified(in_shardings),
        out_shardings=(unspecified(out_shardings), None),
    )(*invals)
  _resow(trace, reaps)
  return out


# Primitives whose rules are Python callables that may sow when differentiated later.
_OPAQUE = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


def _may_sow(jaxpr) -> bool:
  """Whether reaping `jaxpr` could collect anything (conservatively)."""
  return any(eqn.primitive is harvest.sow_p or eqn.primitive.name in _OPAQUE
             for eqn in jaxpr.eqns) or any(map(_may_sow, subjaxprs(jaxpr)))


def _site_tags(jaxpr) -> set:
  """The tags of the record-site sows in `jaxpr` and its bodies."""
  tags = {eqn.params["tag"] for eqn in jaxpr.eqns
          if eqn.primitive is harvest.sow_p and parse_sow_name(eqn.params["name"])}
  return tags.union(*map(_site_tags, subjaxprs(jaxpr)))


def _unless_sow_free(rule, primitive):
  """Binds `primitive` as it is when its bodies hold no sow; else reaps with `rule`.

  Reaping a body traces it twice (for its sows' metadata, then to rebuild it); the
  many small jits inside `jax.numpy` have nothing to reap, and skipping them makes
  tracing a recorded step much cheaper.
  """

  def wrapped(trace, *vals, **params):
    jaxprs = list(jaxprs_in_params(params))
    if any(map(_may_sow, jaxprs)):
      note = getattr(trace.context, "note_tags", None)  # `gl.reap`'s collector.
      if note is not None:
        note(set().union(*map(_site_tags, jaxprs)))
      return rule(trace, *vals, **params)
    with set_current_trace(trace.parent_trace):
      return primitive.bind(*vals, **params)

  return wrapped


for _primitive, _rule in (
    (scan_p, _reap_scan_rule),
    (cond_p, _reap_cond_rule),
    (jit_p, _reap_pjit_rule),
    (while_p, harvest.reap_custom_rules[while_p]),
    (remat_p, harvest.reap_custom_rules[remat_p]),
):
  harvest.reap_custom_rules[_primitive] = _unless_sow_free(_rule, _primitive)
