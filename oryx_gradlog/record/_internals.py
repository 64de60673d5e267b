"""Every JAX and Oryx internal that oryx_gradlog uses, in one place.

Record sites are JAX primitives (`_sites.py`) reaped by Oryx's harvest (`_reap.py`,
`_oryx_rules.py`), so the package needs some of JAX's and Oryx's non-public API. It
is all imported here, and where releases differ the right form is chosen by
feature detection (`hasattr`, signatures), never by version strings: every commit
of Oryx's main branch calls itself 0.2.9. Every other module uses public JAX API or
this module.

| internal | why we need it | in newer JAX / Oryx |
|---|---|---|
| `jax.extend.core.Primitive`, `jaxpr_as_fun` | record sites are primitives; reap rules rebuild bodies | unchanged |
| `jax.interpreters.ad.primitive_jvps`, `primitive_transposes`, `instantiate_zeros` | the sites' JVP and transpose rules | unchanged |
| `jax.interpreters.batching.primitive_batchers`, `not_mapped` | the sites' batching rule | `not_mapped` is `None` from JAX 0.8 (`NOT_MAPPED`); `batching.moveaxis` and `broadcast` are not used (public `jnp` instead) |
| `jax.interpreters.mlir.register_lowering` | sites lower to nothing | unchanged |
| `scan_p`, `cond_p`, `while_p`, `remat_p`, `jit_p`, `call_p`, `closed_call_p` | keys of Oryx's reap-rule registry and of `record_layers`' walk, batch-axis rules and emitter | `jax._src.pjit.pjit_p` became `jax.extend.core.primitives.jit_p` (JAX 0.7) |
| `jax._src.core.set_current_trace`, `take_current_trace`, `subjaxprs`, `jaxprs_in_params` | reap rules bind in the parent trace; skip sow-free bodies; reset the trace after an Oryx error | unchanged; binding with `bind` under `set_current_trace` avoids `bind_with_trace`, which takes avals from JAX 0.9 |
| `jax._src.interpreters.partial_eval.dce_jaxpr` | `record_layers`' completeness check: which parameter leaves the loss depends on | unchanged |
| `jax._src.ad_util.add_jaxvals_p` | the element-wise kind registers autodiff's `add_any` (`kinds/elementwise.py`) | unchanged |
| `jax._src.sharding_impls.UnspecifiedValue` | tells a sharded `jit` from a plain one | unchanged |
| `jax._src.source_info_util.user_frame` | `record_layers` names the source line of an unsupported use | unchanged |
| `Primitive.get_bind_params`, `JaxprEqn.ctx` | `record_layers` re-binds a traced model's equations (as `jax.core.eval_jaxpr` does) | returns `(subfuns, params)` before JAX 0.7, `params` only after (`bind_eqn` detects which) |
| `jax.experimental.shard_map.register_check`, `register_norewrite`, `_check_rules`, `_rewrite_rules` | replication rules for sites, and for their sows, inside `shard_map(check_rep=True)` (Oryx's own rules reject every sow there) | gone from JAX 0.7 (varying-manual-axes types replace them; an identity's abstract eval keeps them) |
| abstract mesh's `manual_axes` | tells a site inside a `shard_map` body from one outside (error for a reap outside the body) | `jax.sharding.get_abstract_mesh` (public from JAX 0.6); older JAX has no manual axes there and uses the replication check above |
| `oryx...harvest`: `ReapContext`, `HarvestSettings`, `harvest_trace`, `call_and_reap`, `_sow`, `_get_harvest_metadata`, `reap_custom_rules`, `sow_p` | the collector, and our reap rules for scan, cond and jit | unchanged on Oryx main (which fixed the scan rule's `linear` flags; ours stays for 0.2.9) |

Sharp edges:
  * Nothing here patches JAX or Oryx: we register rules for our own primitives in
    JAX's registries, and reap rules in Oryx's `reap_custom_rules`, which is Oryx's
    extension point.
  * Importing this module imports Oryx: `_compat.check_supported` runs first (below)
    and turns a JAX and Oryx pair that cannot work together into an `ImportError`.
"""

from __future__ import annotations

from typing import Any

from oryx_gradlog.record import _compat

_compat.check_supported()

# pylint: disable=wrong-import-position
import jax
import jax.extend as jex
from jax._src import core as _core
from jax._src.sharding_impls import UnspecifiedValue
from jax.interpreters import ad, batching, mlir
from oryx.core import sow
from oryx.core.interpreters import harvest

__all__ = (
    "NOT_MAPPED", "Primitive", "UnspecifiedValue", "add_any_p", "used_inputs",
    "ad", "batching", "cond_p", "current_manual_axes", "harvest", "jaxpr_as_fun",
    "jaxprs_in_params", "jit_p", "mlir", "register_shard_map_identity", "remat_p",
    "scan_p", "set_current_trace", "sow", "subjaxprs", "take_current_trace", "while_p",
    "route_shard_map_sows", "bind_eqn", "source_line", "call_p", "closed_call_p",
    "sow_p",
)

# --- JAX -------------------------------------------------------------------------

Primitive = jex.core.Primitive
jaxpr_as_fun = jex.core.jaxpr_as_fun
NOT_MAPPED = getattr(batching, "not_mapped", None)  # `None` itself from JAX 0.8.

# The element-wise sum that JAX's autodiff inserts (`add_any`): no public name.
from jax._src import ad_util as _ad_util  # noqa: E402  pylint: disable=g-import-not-at-top
add_any_p = _ad_util.add_jaxvals_p

from jax._src.interpreters import partial_eval as _pe  # noqa: E402  pylint: disable=g-import-not-at-top


def used_inputs(jaxpr, output: int) -> list[bool]:
  """Which inputs of `jaxpr` its output `output` depends on (JAX's dead-code
  elimination, which knows every primitive's bodies)."""
  used = [i == output for i in range(len(jaxpr.outvars))]
  return list(_pe.dce_jaxpr(jaxpr, used)[1])


set_current_trace = _core.set_current_trace
take_current_trace = _core.take_current_trace
subjaxprs = _core.subjaxprs
jaxprs_in_params = _core.jaxprs_in_params

sow_p = harvest.sow_p
_prims = jex.core.primitives
scan_p, cond_p, while_p = _prims.scan_p, _prims.cond_p, _prims.while_p
call_p, closed_call_p = _prims.call_p, _prims.closed_call_p
if hasattr(_prims, "jit_p"):
  jit_p = _prims.jit_p
else:  # JAX < 0.7
  from jax._src.pjit import pjit_p as jit_p  # pylint: disable=g-import-not-at-top
if hasattr(_prims, "remat_p"):
  remat_p = _prims.remat_p
else:
  from jax._src.ad_checkpoint import remat_p  # pylint: disable=g-import-not-at-top

try:  # JAX < 0.7: `shard_map(check_rep=True)` checks replication with per-primitive rules.
  from jax.experimental.shard_map import _check_rules as _shard_map_check_rules
  from jax.experimental.shard_map import _rewrite_rules as _shard_map_rewrite_rules
  from jax.experimental.shard_map import register_check, register_norewrite
except ImportError:
  _shard_map_check_rules = _shard_map_rewrite_rules = None


def bind_eqn(primitive: Primitive, params: dict[str, Any], invals: Any, ctx: Any = None) -> list:
  """Binds `primitive` as an equation with `params` does; returns its outputs as a list.

  As `jax.core.eval_jaxpr` does for each equation: higher-order primitives keep
  their bodies in the params, which `get_bind_params` turns into what `bind` takes.
  """
  bind_params = primitive.get_bind_params(params)
  subfuns = []
  if isinstance(bind_params, tuple):  # JAX < 0.7: (subfuns, params).
    subfuns, bind_params = bind_params
  manager = getattr(ctx, "manager", None)
  if manager is None:
    out = primitive.bind(*subfuns, *invals, **bind_params)
  else:
    with manager:
      out = primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if primitive.multiple_results else [out]


def source_line(eqn: Any) -> str:
  """`file:line` of the user's code that made `eqn`, or `""` where JAX kept none."""
  try:
    from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
    try:
      frame = source_info_util.user_frame(eqn.source_info)
    except AttributeError:  # Newer JAX (0.10) takes the SourceInfo's traceback.
      frame = source_info_util.user_frame(eqn.source_info.traceback)
  except Exception:  # pylint: disable=broad-except
    return ""
  return f"{frame.file_name}:{frame.start_line}" if frame is not None else ""


def register_shard_map_identity(primitive: Primitive, n_residuals: int) -> None:
  """Tells `shard_map` that `primitive`'s outputs are replicated as its operands
  after the first `n_residuals`. Needed only where replication is checked by rules;
  with varying-manual-axes types, the abstract eval of an identity says as much."""
  if _shard_map_check_rules is None:
    return
  register_check(primitive)(lambda mesh, *in_rep, **_: list(in_rep[n_residuals:]))
  register_norewrite(primitive)


def route_shard_map_sows(is_ours) -> None:
  """Where JAX checks `shard_map` replication with rules, gives the sows for which
  `is_ours(mesh, name, tag)` is true identity rules (replicated as their operands),
  and leaves the others to Oryx's rules (which reject any sow in a `shard_map`).
  `is_ours` may raise to reject a sow with a better error."""
  if _shard_map_check_rules is None:
    return
  oryx_check = _shard_map_check_rules[harvest.sow_p]
  oryx_rewrite = _shard_map_rewrite_rules[harvest.sow_p]

  def check(mesh, *in_rep, name, tag, **params):
    if is_ours(mesh, name, tag):
      return list(in_rep)
    return oryx_check(mesh, *in_rep, name=name, tag=tag, **params)

  def rewrite(mesh, in_rep, *args, name, tag, **params):
    if is_ours(mesh, name, tag):
      return harvest.sow_p.bind(*args, name=name, tag=tag, **params), list(in_rep)
    return oryx_rewrite(mesh, in_rep, *args, name=name, tag=tag, **params)

  _shard_map_check_rules[harvest.sow_p] = check
  _shard_map_rewrite_rules[harvest.sow_p] = rewrite


def current_manual_axes() -> frozenset[str]:
  """The mesh axes that the current trace is manual over (inside `shard_map`)."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return frozenset()
  return frozenset(getattr(get(), "manual_axes", ()) or ())

