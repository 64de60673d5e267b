"""Recording: `record_vjp` and `tap` mark where cotangents are recorded.

Both are thin: they mark values with record sites (`_sites.py`) and otherwise run
the user's function as it is. `record_vjp(f, name=...)` marks the positional inputs
of `f`, so its record is the tuple of their cotangents, exactly what the Oryx recipe
(`sow(vjp(dy), ...)` in a `custom_vjp` backward rule) returns. With `full=True` it
also marks the output and records a `VJPRecord` of (primals, output cotangent, input
cotangents): the `(x, w, g)` of the original question and the (activation,
output-gradient) pairs that curvature and per-example analyses need.

Sharp edges:
  * Keyword arguments of a recorded function are differentiated as usual but not
    recorded; pass what you want recorded positionally.
  * Integer and boolean inputs have no cotangent: their entry in a record is `None`.
  * With no reap active a site is an identity that lowers to nothing, so `jax.jvp`,
    `jax.jacfwd` and `jax.hessian` of recorded functions work as for plain ones.
    See `_sites.py` for what is recorded under nested differentiation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oryx_gradlog.record import _sites
from oryx_gradlog.record._sites import DEFAULT_TAG


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["primals", "out_cotangent", "in_cotangents"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class VJPRecord:
  """What `record_vjp(..., full=True)` records for one call.

  Attributes:
    primals: the tuple of positional inputs of the call.
    out_cotangent: the cotangent `g` that arrived at the output.
    in_cotangents: the tuple of cotangents of the positional inputs (`None` for
      inputs that are not floating point).
  """

  primals: Any
  out_cotangent: Any
  in_cotangents: Any


def record_vjp(
    f: Callable[..., Any] | None = None,
    *,
    name: str,
    tag: str = DEFAULT_TAG,
    full: bool = False,
    argnums: int | Sequence[int] | None = None,
) -> Callable[..., Any]:
  """Wraps `f` so that the backward pass records the cotangents of its inputs.

  Use as a decorator, `@record_vjp(name="mvm")`, or directly,
  `record_vjp(f, name="mvm")`. The wrapped function returns what `f` returns.

  Args:
    f: the function to record. Omit it to get a decorator.
    name: the key of the record in the dict that `reap` returns.
    tag: the Oryx tag the record is sown under; `reap` with the same tag collects it.
    full: record a `VJPRecord` (primals, output cotangent, input cotangents) instead
      of the tuple of input cotangents.
    argnums: positional inputs to record (default: all). The others are `None` in
      the record and cost nothing: skip e.g. weights whose cotangents `jax.grad`
      returns anyway, or the network input, whose cotangent plain `grad` never forms.

  Returns:
    `f` wrapped with record sites (or a decorator that does this).

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> square = gl.record_vjp(lambda y: y ** 2, name="square_vjp")
    >>> f = lambda x: square(jnp.sin(x))
    >>> gl.reap(jax.grad(f))(3.0)
    {'square_vjp': (Array(0.28224, dtype=float32, weak_type=True),)}
  """
  _sites.check_name("record_vjp", name)
  if f is None:
    return functools.partial(record_vjp, name=name, tag=tag, full=full, argnums=argnums)
  wanted = None if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)

  @functools.wraps(f)
  def recorded(*args, **kwargs):
    chosen = range(len(args)) if wanted is None else _positions(name, wanted, len(args))
    inputs = tuple(arg if i in chosen else None for i, arg in enumerate(args))
    component = _sites.INPUTS if full else _sites.COTANGENT
    inputs = _sites.mark(inputs, name=name, tag=tag, component=component, full=full)
    out = f(*(x if i in chosen else arg for i, (x, arg) in enumerate(zip(inputs, args))),
            **kwargs)
    if full:
      out = _sites.mark(out, name=name, tag=tag, component=_sites.OUTPUT)
    return out

  return recorded


def _positions(name, argnums, count):
  bad = [i for i in argnums if not -count <= i < count]
  if bad:
    raise ValueError(
        f"record_vjp(name={name!r}, argnums={argnums}): the function was called with "
        f"{count} positional arguments, so argnums {bad} do not exist. Pass argnums within "
        f"range({count}).")
  return {i % count for i in argnums}


def tap(x: Any, *, name: str, tag: str = DEFAULT_TAG) -> Any:
  """Returns `x` unchanged; on the backward pass records its cotangent as `name`.

  `x` may be any pytree; the record has its structure.

  Args:
    x: the value whose cotangent (the gradient of the loss with respect to it) to
      record.
    name: the key of the record in the dict that `reap` returns.
    tag: the Oryx tag the record is sown under.

  Returns:
    `x`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> f = lambda x: jnp.sum(gl.tap(2 * x, name="h") ** 2)
    >>> gl.reap(jax.grad(f))(jnp.ones(2))["h"]
    Array([4., 4.], dtype=float32)
  """
  _sites.check_name("tap", name)
  return _sites.mark(x, name=name, tag=tag, component=_sites.COTANGENT)
