"""What `record_layers` finds in a model, checked before training: `layer_coverage`.

Opacus's `ModuleValidator` tells a user, before any step, which modules its
per-example machinery cannot handle. `layer_coverage(loss, params, *batch)` does the
same for any JAX function: it traces the function as `gl.record_layers` does
(abstractly, with `jax.eval_shape`: nothing is computed), and for every parameter
leaf says how its per-example gradient will be formed:

* the kind of each use (dense, convolution, embedding, element-wise, generic);
* the method: `"gram"` (the ghost norm, from Gram matrices of inputs and output
  cotangents) or `"materialized"` (the per-example gradients are formed), chosen by
  the same cost model as `per_example_norms(method="auto")`;
* the estimated multiply-adds and floats held for its per-example norms;
* the curvature block `gl.fit_influence` gives it (Kronecker, a bias with its
  layer, or diagonal);
* or why it is not covered: a use that couples examples (batch norm, a loss term
  over the batch), or no use at all (the parameter never meets the batch).

Sharp edges:
  * Estimates are of the per-example norms only (the clipped gradient's vjps cost
    what the backward pass's weight gradients cost).
  * A parameter with no use gets a zero clipped gradient from `gl.clipped_grad`;
    that is right only if it does not reach the loss (check `unused`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.attribution._blocks import block_layout
from oryx_gradlog.record import record_layers as _record_layers
from oryx_gradlog.record._found import FoundUse
from oryx_gradlog.record._kinds import UNSUPPORTED
from oryx_gradlog.record._reap import reap
from oryx_gradlog.record._selection import Selection

_TAG = "gradlog_layer_coverage"


@dataclasses.dataclass(frozen=True)
class UseCoverage:
  """One use of a parameter.

  Attributes:
    record: the record name of the use.
    kind: the use's kind (`"dense"`, `"conv"`, `"embed"`, `"elementwise"`,
      `"generic"` or `"unsupported"`).
    where: the operation (and, where JAX kept it, the source line).
    reason: why an unsupported use is not supported (else `""`).
  """

  record: str
  kind: str
  where: str
  reason: str = ""


@dataclasses.dataclass(frozen=True)
class ParamCoverage:
  """How one parameter leaf's per-example gradient is formed.

  Attributes:
    path: the parameter's name.
    shape: its shape.
    uses: its uses.
    method: `"gram"`, `"materialized"`, or `""` if not covered.
    macs: estimated multiply-adds of its per-example norms.
    floats: estimated floats held for them.
    covered: whether the per-example analyses can read it.
    note: why not, or what to know.
    influence: the block `gl.fit_influence` gives it: `"kronecker"` (a dense,
      convolution or embedding layer's), `"kronecker (bias of PATH)"`,
      `"diagonal"`, or `""` if not covered.
  """

  path: str
  shape: tuple
  uses: tuple[UseCoverage, ...]
  method: str
  macs: int
  floats: int
  covered: bool
  note: str = ""
  influence: str = ""


@dataclasses.dataclass(frozen=True)
class LayerCoverage:
  """Every parameter leaf of a function and how `record_layers` covers it.

  Attributes:
    params: per parameter path, a `ParamCoverage`, in the parameters' order.
    batch_size: the batch size the estimates are for.
  """

  params: dict[str, ParamCoverage]
  batch_size: int

  @property
  def uncovered(self) -> list[str]:
    """The parameters the per-example analyses cannot read."""
    return [p for p, c in self.params.items() if not c.covered]

  @property
  def unused(self) -> list[str]:
    """The parameters no use reads (they never meet the batch)."""
    return [p for p, c in self.params.items() if not c.uses]

  def __str__(self) -> str:
    rows = [("parameter", "shape", "uses", "method", "MACs", "MiB", "influence", "note")]
    for c in self.params.values():
      kinds = ", ".join(dict.fromkeys(u.kind for u in c.uses)) or "-"
      rows.append((c.path, str(c.shape), kinds, c.method or "-", _si(c.macs),
                   f"{4 * c.floats / 2**20:.2f}", c.influence or "-", c.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1]
             for r in rows]
    total = sum(c.macs for c in self.params.values())
    lines.append(f"{len(self.params)} parameters, {len(self.uncovered)} not covered; "
                 f"per-example norms: {_si(total)} multiply-adds at batch "
                 f"{self.batch_size}.")
    return "\n".join(line.rstrip() for line in lines)


def _si(n: int) -> str:
  for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= size:
      return f"{n / size:.1f}{unit}"
  return str(int(n))


def layer_coverage(
    fun: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    method: str = "auto",
    **kwargs: Any,
) -> LayerCoverage:
  """Returns how every parameter of `fun` is covered by the per-example analyses.

  Call it with the arguments of one step, before training; nothing is computed
  (the function is traced abstractly). `print(...)` shows a table.

  Args:
    fun: the batch loss, as for `gl.record_layers` and `gl.clipped_grad`.
    *args: its positional arguments (parameters and a batch).
    argnums: the parameter argument(s).
    batch_argnums: the batch arguments (default: all others).
    has_aux: whether `fun` returns `(loss, aux)`.
    method: as for `per_example_norms`.
    **kwargs: its keyword arguments.

  Returns:
    A `LayerCoverage`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(params, x):
    ...   return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2), "unused": jnp.zeros(1)}
    >>> coverage = gl.layer_coverage(loss, params, jnp.ones((8, 3)))
    >>> coverage.params["w"].method, coverage.params["b"].uses[0].kind, coverage.unused
    ('gram', 'elementwise', ['unused'])
  """
  api = "layer_coverage"
  if method not in _common.METHODS:
    raise ValueError(f"{api}(method={method!r}): method must be 'auto', 'gram' or "
                     "'materialized'.")
  recorded = _record_layers.recorder(fun, argnums=argnums, batch_argnums=batch_argnums,
                                     tag=_TAG, api=api)
  signature = _record_layers.Signature(api, args, kwargs, argnums, batch_argnums)
  grad = reap(jax.grad(recorded, argnums=argnums, has_aux=has_aux), tag=_TAG)
  rows: dict[str, dict[str, Any]] = {}

  def measure(*args, **kwargs):
    with _common.scalar_loss(api, has_aux):
      records = grad(*args, **kwargs)
    uses: dict[str, list[FoundUse]] = {}
    for name, record in records.items():
      use = FoundUse.of(name, record)
      for path in use.spec.paths:
        uses.setdefault(path, []).append(use)
    for path, group in uses.items():
      row = rows.setdefault(path, {"uses": [], "method": "", "macs": 0, "floats": 0,
                                   "note": "", "influence": ""})
      row["uses"] = [UseCoverage(u.name, u.spec.kind, u.spec.where, u.spec.reason)
                     for u in group]
      bad = [u for u in group if u.spec.kind == UNSUPPORTED]
      if bad:
        row["note"] = f"not covered: {bad[0].spec.where} is not supported because " \
                      f"{bad[0].spec.reason}"
        continue
      costs = [u.rules.cost(u, method) for u in group]
      if len(group) == 1 and group[0].simple:
        row["method"], row["macs"], row["floats"] = costs[0]
      else:
        row["method"] = _common.MATERIALIZED
        row["macs"] = sum(c[1] for c in costs)
        row["floats"] = sum(c[2] for c in costs)
        row["note"] = ("several uses (tied): per-example gradients formed and summed"
                       if len(group) > 1 else
                       "a function of parameters: per-example gradients formed")
    covered = {path: tuple(group) for path, group in uses.items()
               if not any(u.spec.kind == UNSUPPORTED for u in group)}
    kronecker, diagonal = block_layout(Selection(covered))
    for path, (_, bias) in kronecker.items():
      rows[path]["influence"] = "kronecker"
      if bias is not None:
        rows[bias]["influence"] = f"kronecker (bias of {path})"
    for path in diagonal:
      rows[path]["influence"] = "diagonal"
    return 0

  jax.eval_shape(measure, *args, **kwargs)
  tree = signature.tree
  params = {}
  for path, shape in zip(tree.paths, tree.shapes):
    if path is None:
      continue
    row = rows.get(path)
    if row is None:
      params[path] = ParamCoverage(
          path, tuple(shape), (), "", 0, 0, True,
          "no use: it never meets the batch (zero per-example gradient)")
      continue
    covered = not any(u.kind == UNSUPPORTED for u in row["uses"])
    params[path] = ParamCoverage(path, tuple(shape), tuple(row["uses"]), row["method"],
                                 int(row["macs"]), int(row["floats"]), covered,
                                 row["note"], row["influence"])
  return LayerCoverage(params, signature.batch_size)

