"""Record sites: JAX primitives that mark a value and sow its cotangent.

A record site is an identity on the forward pass. Differentiating it (its JVP
rule) does two things under a fresh uid: it sows a `SITE` entry on the forward pass
(zero-size arrays that carry the shapes of the cotangents to come), and it puts a
linear identity, `gradlog_cotangent`, on the tangent. Transposing that identity,
which happens when a backward pass reaches the site, sows the cotangents as a
`RECORD` entry under the same uid, with Oryx's `sow`. The reaper (`_reap.py`) pairs
each `SITE` with its `RECORD`, in forward order, fills in zeros where no backward
pass arrived (`stop_gradient`), and stacks repeated calls of one name.

Why primitives rather than a `jax.custom_vjp` with a `sow` in its backward rule (the
recipe in the Oryx answer this package grew from): a `custom_vjp` has no forward
mode, so `jax.jvp`, `jax.jacfwd` and `jax.hessian` of a recorded function would
fail. These primitives have JVP, transpose, batching, lowering and DCE rules, so a
recorded function stays an ordinary JAX function under every transformation, and
all three lower to nothing: the compiled program is the plain one plus the records.
`gl.record_layers`, which finds the layers of any model in its jaxpr, marks each use
of a parameter with these same sites (one on its output that also sows its operands,
`mark_use`; a layer and its bias share one), so found layers keep forward mode too.

Sharp edges:
  * Only the first reverse-mode pass that reaches a site records it. Derivatives of
    that pass (`grad(grad(f))`, `jax.hessian`, the outer gradient of MAML through
    an inner step) differentiate the recorded values but add no records of their own.
  * A site records only when a backward pass reaches it: a site that does not
    depend on the differentiated inputs has no cotangent and makes no record. A site
    whose output is cut by `lax.stop_gradient` does make a record, of zeros.
  * A backward pass through a site that no reap collects leaves Oryx's `Sow` effect
    on the function: the compiled program is the plain one, but `jax.jit` dispatches
    a function with effects on its Python path (about 1 ms per call on CPU).
    Reaping and dropping the records removes the effect (see the README).
  * Leaves that are not floating point (integers, booleans) have no cotangent; their
    place in a record is `None`.
  * Under `vmap`, the batch axis of a record is moved to the front, so per-example
    records read `(batch, ...)`, also for a cotangent that does not vary across the
    batch (it is broadcast, as the site's other leaves are).
  * Inside `shard_map`, reap inside the per-shard function and return the records
    through `out_specs`. A reap outside the `shard_map` cannot see into it: a site
    there is an error that says so, while that reap is traced (on JAX < 0.7 only
    with the default `check_rep=True`). With no reap of its tag active, a site in
    a `shard_map` body records nothing, as anywhere else. A record of a replicated
    input of the body (a weight with `P()`) is the cotangent JAX's backward pass
    forms there: this shard's part before JAX 0.7, the sum over shards with
    varying-manual-axes types (JAX 0.7 and newer).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record import _internals
from oryx_gradlog.record._internals import NOT_MAPPED, Primitive, ad, batching, mlir, sow

DEFAULT_TAG = "vjp"

# What a record holds, encoded in its sow names next to the user's name.
COTANGENT = "ct"  # `tap`, `record_vjp`: the cotangent tree.
INPUTS = "in"  # `record_vjp(full=True)`: (primals, input cotangents).
OUTPUT = "out"  # `record_vjp(full=True)`: the output cotangent.
USE = "use"  # `record_layers`' uses (one, or a layer and its bias): (uses, cotangent).
# Each differentiated call of a site sows twice, under one uid: a `SITE` sow on the
# forward pass (zero-size arrays of the cotangents' shapes, plus the primals for
# `INPUTS`), and a `RECORD` sow of the cotangents when the backward pass reaches it.
SITE = "site"
RECORD = "record"

_uids = itertools.count()
_SOW_NAME = re.compile(
    r"^(?P<name>.*)#gradlog:(?P<kind>site|record):(?P<component>ct|in|out|use):(?P<uid>\d+)$"
)


def _sow_name(name: str, kind: str, component: str, uid: int) -> str:
  # Zero-padded so that Oryx's sorted dicts keep the order of tracing.
  return f"{name}#gradlog:{kind}:{component}:{uid:012d}"


def parse_sow_name(sow_name: Any) -> tuple[str, str, str, int] | None:
  """Returns `(name, kind, component, uid)` of a record site's sow, else `None`."""
  match = _SOW_NAME.match(sow_name) if isinstance(sow_name, str) else None
  if match is None:
    return None
  return match["name"], match["kind"], match["component"], int(match["uid"])


# One site of `record_layers` records a layer and its bias: their names, joined.
_JOIN = "#gradlog&"


def joined_name(names) -> str:
  """The name of a `USE` site that records the uses `names` (`split_name` inverts it)."""
  return _JOIN.join(names)


def split_name(name: str) -> list[str]:
  """The names of the records of a `USE` site (one, or a layer's and its bias's)."""
  return name.split(_JOIN)


def check_name(api: str, name: Any) -> None:
  if not isinstance(name, str) or not name or "#gradlog" in name:
    raise ValueError(
        f"{api}(name={name!r}): a record name must be a non-empty string without "
        "'#gradlog'. Pass e.g. name='layer1'."
    )


def _identity_rules(primitive: Primitive, n_residuals: int) -> None:
  """Registers impl, abstract eval and lowering of an identity on the operands
  after the first `n_residuals`."""
  primitive.multiple_results = True
  primitive.def_impl(lambda *args, **_: tuple(args[n_residuals:]))
  primitive.def_abstract_eval(lambda *avals, **_: tuple(avals[n_residuals:]))
  mlir.register_lowering(primitive, lambda ctx, *args, **_: list(args[n_residuals:]))


def _batch_first_rule(primitive: Primitive, n_residuals: int) -> None:
  """Batching rule that moves every batch axis to the front, then binds again.

  With a residual (a zero-size witness of the site's batch axes), an unbatched
  value is broadcast to the witness's batch size, so that a record under `vmap`
  always has its batch axis even when its cotangent does not vary across the batch.
  """

  def rule(args, dims, **params):
    size = None
    if n_residuals and dims[0] is not NOT_MAPPED:
      size = args[0].shape[dims[0]]
    moved = []
    for x, d in zip(args, dims):
      if d is not NOT_MAPPED:
        x = jnp.moveaxis(x, d, 0)
      elif size is not None:
        x = jnp.broadcast_to(x, (size, *jnp.shape(x)))
      moved.append(x)
    out_dims = [
        NOT_MAPPED if size is None and d is NOT_MAPPED else 0
        for d in dims[n_residuals:]
    ]
    return primitive.bind(*moved, **params), out_dims

  batching.primitive_batchers[primitive] = rule


# `gradlog_site`: the forward-pass marker. Operands are the leaves of the marked
# tree; `mask[i]` says whether leaf i is floating point and so has a cotangent, and
# the first `n_sown` leaves are sown on the forward pass beside the shapes.
site_p = Primitive("gradlog_site")
_identity_rules(site_p, 0)
_batch_first_rule(site_p, 0)

# `gradlog_cotangent`: linear identity on the tangents of the masked leaves, after
# one residual operand, the zero-size witness of the site's shapes and batch axes.
cotangent_p = Primitive("gradlog_cotangent")
_identity_rules(cotangent_p, 1)
_batch_first_rule(cotangent_p, 1)

# `gradlog_batch_first`: identity whose only job is its batching rule, applied to a
# record just before it is sown so that `vmap` axes end up in front.
batch_first_p = Primitive("gradlog_batch_first")
_identity_rules(batch_first_p, 1)
_batch_first_rule(batch_first_p, 1)
ad.primitive_jvps[batch_first_p] = lambda primals, tangents: (
    batch_first_p.bind(*primals),
    list(tangents[1:]),
)
ad.primitive_transposes[batch_first_p] = lambda cts, *args: [None, *cts]


# `gradlog_after`: identity on the operands after the first, which it makes depend
# on the first. Ties the forward `SITE` sow to the site's output, so that partial
# evaluation (of a `scan` body, say) keeps the sow wherever it keeps the output.
after_p = Primitive("gradlog_after")
_identity_rules(after_p, 1)
batching.primitive_batchers[after_p] = lambda args, dims: (after_p.bind(*args), dims[1:])
ad.primitive_jvps[after_p] = lambda primals, tangents: (
    after_p.bind(*primals),
    list(tangents[1:]),
)
ad.primitive_transposes[after_p] = lambda cts, *args: [None, *cts]


for _primitive, _n_residuals in ((site_p, 0), (cotangent_p, 1), (batch_first_p, 1), (after_p, 1)):
  _internals.register_shard_map_identity(_primitive, _n_residuals)

# The reaps being traced, innermost last, as (tag, mesh axes manual at the reap):
# a site traced inside a `shard_map` body over axes that its reap is not manual
# over cannot be reaped (see "Sharp edges").
_reaps = threading.local()


@contextlib.contextmanager
def reaping(tag: str):
  """Marks a reap of `tag` as being traced, for the `shard_map` check."""
  stack = _reaps.__dict__.setdefault("stack", [])
  stack.append((tag, _internals.current_manual_axes()))
  try:
    yield
  finally:
    stack.pop()


def _check_reap_not_outside_shard_map(name: str, tag: Any, manual_axes: frozenset) -> None:
  """Raises if the innermost reap of `tag` is outside the `shard_map` body that
  makes record `name`: Oryx cannot reap through a `shard_map`."""
  outer = [axes for t, axes in getattr(_reaps, "stack", ()) if t == tag]
  if outer and not manual_axes <= outer[-1]:
    raise ValueError(
        f"record {split_name(name)[0]!r} is made inside a shard_map body by a reap outside it, "
        "which Oryx cannot reap through. Reap inside the per-shard function instead, "
        "e.g. `grads, records = gl.call_and_reap(jax.grad(local_loss))(...)`, and "
        "return the records through out_specs (P('data') for per-example records)."
    )


def _is_site_sow_in_shard_map(mesh, name, tag) -> bool:
  site = parse_sow_name(name)
  if site is not None:
    _check_reap_not_outside_shard_map(site[0], tag, frozenset(mesh.axis_names))
  return site is not None


# JAX < 0.7 checks a `shard_map` body's replication with per-primitive rules, and
# has no manual axes to look at in `_site_jvp`: check the sows there instead.
_internals.route_shard_map_sows(_is_site_sow_in_shard_map)


def _shape_witness(x):
  """A zero-size array with the shape, dtype and batch axes of `x`, plus one axis.

  One `lax` primitive each (sites are many in a found model: no `jnp` indexing)."""
  return lax.broadcast_in_dim(x, (*jnp.shape(x), 0), tuple(range(jnp.ndim(x))))


def _site_jvp(primals, tangents, *, name, tag, component, treedef, mask, n_sown):
  _check_reap_not_outside_shard_map(name, tag, _internals.current_manual_axes())
  uid = next(_uids)
  witnesses = [_shape_witness(p) for p, m in zip(primals, mask) if m]
  # Zero-size, and batched under a vmap exactly when some leaf of the site is.
  batch = lax.reshape(witnesses[0], (0,))
  for w in witnesses[1:]:
    (batch,) = batch_first_p.bind(lax.reshape(w, (0,)), batch)
  fill = iter(batch_first_p.bind(batch, *witnesses))
  _, sown_shapes = sow(
      (treedef.unflatten([*primals[:n_sown], *[None] * (len(primals) - n_sown)])
       if n_sown else None,
       treedef.unflatten([next(fill) if m else None for m in mask])),
      tag=tag,
      name=_sow_name(name, SITE, component, uid),
      mode="append",
  )
  wanted = [ad.instantiate_zeros(t) for t, m in zip(tangents, mask) if m]
  marked = iter(
      cotangent_p.bind(
          batch, *wanted, name=name, tag=tag, component=component,
          treedef=treedef, mask=mask, uid=uid,
      )
  )
  # The primal passes through unmarked, so that an enclosing derivative does not
  # record the site a second time (see "Sharp edges").
  primals_out = after_p.bind(jax.tree.leaves(sown_shapes)[0], *primals)
  return primals_out, [next(marked) if m else t for t, m in zip(tangents, mask)]


ad.primitive_jvps[site_p] = _site_jvp


def _cotangent_jvp(primals, tangents, **params):
  # Linear, and records nothing for the derivative of a derivative.
  return cotangent_p.bind(*primals, **params), tangents[1:]


ad.primitive_jvps[cotangent_p] = _cotangent_jvp


def _cotangent_transpose(cts, witness, *_, name, tag, component, treedef, mask, uid):
  cts = batch_first_p.bind(witness, *[ad.instantiate_zeros(ct) for ct in cts])
  fill = iter(cts)
  record = treedef.unflatten([next(fill) if m else None for m in mask])
  record = sow(record, tag=tag, name=_sow_name(name, RECORD, component, uid), mode="append")
  return [None, *jax.tree.leaves(record)]


ad.primitive_transposes[cotangent_p] = _cotangent_transpose


def _has_cotangent(leaf) -> bool:
  return bool(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact))


def mark(tree: Any, *, name: str, tag: str, component: str, full: bool = False) -> Any:
  """Returns `tree` unchanged, marked so that its cotangent is recorded as `name`."""
  leaves, treedef = jax.tree.flatten(tree)
  mask = tuple(_has_cotangent(leaf) for leaf in leaves)
  if not any(mask):
    return tree
  marked = site_p.bind(
      *leaves, name=name, tag=tag, component=component, treedef=treedef,
      mask=mask, n_sown=len(leaves) if full else 0,
  )
  return treedef.unflatten(marked)


def mark_use(out: Any, primals: tuple, *, name: str, tag: str) -> Any:
  """Returns `out` unchanged, marked so that its cotangent is recorded with `primals`
  beside it: one site for the uses that `record_layers` found (one, or a layer and
  its bias, named `joined_name` of theirs), whose records are `VJPRecord((primals[i],),
  output cotangent, None)` (`record_vjp(..., full=True)` takes two sites, and also
  records the input cotangents). Only `primals` are sown beside the shapes, not
  `out`."""
  primal_leaves = jax.tree.leaves(primals)
  out_leaves, out_treedef = jax.tree.flatten(out)
  mask = (False,) * len(primal_leaves) + tuple(_has_cotangent(leaf) for leaf in out_leaves)
  if not any(mask):
    return out
  marked = site_p.bind(
      *primal_leaves, *out_leaves, name=name, tag=tag, component=USE,
      treedef=jax.tree.structure((primals, out)), mask=mask, n_sown=len(primal_leaves),
  )
  return out_treedef.unflatten(marked[len(primal_leaves):])
