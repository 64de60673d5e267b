"""Cockpit's instruments as small transformations, one per family, that
`training_instruments` chains.

A family (`Family`) reads a few instruments of one step, with its state beside it:

* `init(params, key)`: its state (`None` for a family without one);
* `pairs(step, state, start)`: the leaf inner products `<a, b>` it needs, by name;
  the chain computes every family's in one pass (`Step.sums`), since each separate
  parameter-sized reduction costs a pass over the parameters;
* `update(step, state, start)`: its readings and its state after a read step
  (`start`: this step also starts the next read, see `alpha`); without `start`
  the state must come back as it was;
* `start(step, state)`: its state after a step that only starts the next read.

`Step` is one call of `update`: its arguments and what several families read,
computed once when first asked for (the layer selection, the parameters placed by
key, the layer moments). The chain makes a new `Step` inside each `lax.cond`
branch, so that nothing traced in one branch is read in another. The per-step
families read under one condition (the schedule); the curvature family
(`every_step=True`) reads on every call and measures every `curvature_every`
steps under its own `lax.cond`, with a `Step.fresh()` of its own.

Adding an instrument: a function `(wants, config) -> Family` here, and its names
and function in `FAMILIES`.

Sharp edges:
  * A family's readings are float32 (histogram counts int32).
  * `Step`'s cached inputs are computed at trace time in the branch that first
    asks for them; a family must not keep them in its state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.curvature import _hessian
from oryx_gradlog.analyses.instruments import _histograms, _instruments, _step_quality
from oryx_gradlog.record._selection import collect

PER_PARAMETER = "per_parameter"
TESTS = ("norm_test", "inner_product_test", "orthogonality_test")
MOMENTS = ("mean_gsnr", "early_stopping", "cabs")
HISTOGRAMS = ("grad_hist_1d", "grad_hist_2d")
NORMS = ("grad_norm", "update_size", "distance")
CURVATURE = ("hessian_trace", "hessian_max_eigenvalue", "tic_diag", "tic_trace")
_DIAGONAL = ("hessian_trace", "tic_diag", "tic_trace")
# Cockpit's stabilising constants.
_GSNR_EPS, _EARLY_STOPPING_EPS, _TIC_EPS = 1e-5, 1e-5, 1e-7


@dataclasses.dataclass(frozen=True)
class Config:
  """The options of `training_instruments` that the families read."""

  api: str
  reduction: str
  names: Any
  tied: Collection[str]
  where: Any
  alpha_fit: str
  curvature_every: int
  num_products: int
  exact_diagonal: bool


class Step:
  """One call of `update` (internal): its arguments, and the inputs several
  families read, computed once (at trace time) when first asked for."""

  def __init__(self, config: Config, count, records, *, loss, grads, params, updates,
               losses, learning_rate, hessian_loss):
    self.config, self.count, self.records = config, count, records
    self.loss, self.grads, self.params, self.updates = loss, grads, params, updates
    self.losses, self.learning_rate, self.hessian_loss = losses, learning_rate, hessian_loss
    self.sums: dict[str, list[jax.Array]] = {}

  def fresh(self) -> Step:
    """The same call with nothing computed yet: for a `lax.cond` branch."""
    return Step(self.config, self.count, self.records, loss=self.loss, grads=self.grads,
                params=self.params, updates=self.updates, losses=self.losses,
                learning_rate=self.learning_rate, hessian_loss=self.hessian_loss)

  @functools.cached_property
  def selection(self):
    c = self.config
    return collect(f"{c.api}.update", self.records, c.names, tied=c.tied)

  @functools.cached_property
  def split(self) -> Callable[[Any], dict]:
    """Places a tree shaped like the parameters by layer key."""
    c = self.config
    return self.selection.splitter(f"{c.api}.update", self.params, c.where)

  @functools.cached_property
  def moments(self):
    """`(moments by key, batch size)`: `gl.gradient_snr`'s first and second moments."""
    c = self.config
    return _instruments.layer_moments(f"{c.api}.update", self.records,
                                      reduction=c.reduction, names=c.names, tied=c.tied)

  def slopes(self, direction) -> jax.Array:
    """`(B,)`: per example, `<grad l_i, direction>` over the recorded layers."""
    total = self.selection.products(self.split(direction))
    return _common.loss_scale(self.config.reduction, total.shape[0]) * total


class Family(NamedTuple):
  """One family of instruments, a small transformation in `gl.Transform`'s order,
  `update(inputs, state, ...) -> (readings, state)` (see the module docstring)."""

  init: Callable[[Any, Any], Any]
  update: Callable[[Step, Any, bool], tuple[dict, Any]]
  pairs: Callable[[Step, Any, bool], dict] | None = None
  start: Callable[[Step, Any], Any] | None = None
  every_step: bool = False


def _none(params, key):
  del params, key


def float32(tree):
  """The readings in float32 (integer counts as they are)."""
  return jax.tree.map(
      lambda v: v if jnp.issubdtype(jnp.result_type(v), jnp.integer)
      else jnp.asarray(v, jnp.float32), tree)


def _zero():
  return jnp.zeros((), jnp.float32)  # One buffer each: states get donated.


def loss_family(wants, config) -> Family:
  del wants, config
  return Family(_none, lambda step, state, start: ({"loss": float32(step.loss)}, state))


def tests_family(wants, config) -> Family:
  def read(step, state, start):
    tests = _instruments.batch_size_tests(step.records, reduction=config.reduction,
                                          names=config.names, tied=config.tied)
    return float32({n: getattr(tests, n) for n in TESTS if n in wants}), state
  return Family(_none, read)


def moments_family(wants, config) -> Family:
  def read(step, state, start):
    moments, batch = step.moments
    mean_sq = [(m * m, s / batch) for moment in moments.values()
               for m, s in zip(jax.tree.leaves(moment.mean),
                               jax.tree.leaves(moment.sum_squares))]
    count = sum(m.size for m, _ in mean_sq)
    out = {}
    if "mean_gsnr" in wants:
      out["mean_gsnr"] = sum(jnp.sum(g2 / (s - g2 + _GSNR_EPS)) for g2, s in mean_sq) / count
    if "early_stopping" in wants:
      snr = sum(jnp.sum(g2 / ((s - g2) * batch / (batch - 1) + _EARLY_STOPPING_EPS))
                for g2, s in mean_sq)
      out["early_stopping"] = 1 - batch * snr / count
    if "cabs" in wants:
      mean_loss = step.loss / batch if config.reduction == "sum" else step.loss
      out["cabs"] = step.learning_rate * sum(jnp.sum(s - g2) for g2, s in mean_sq) / mean_loss
    return float32(out), state
  return Family(_none, read)


def histograms_family(wants, config) -> Family:
  api = f"{config.api}.update"

  def read(step, state, start):
    two_d = "grad_hist_2d" in wants
    hist = _histograms.histograms(api, step.selection, config.reduction,
                                  step.params if two_d else None, two_d=two_d,
                                  one_d="grad_hist_1d" in wants)
    out = {}
    if "grad_hist_1d" in wants:
      out["grad_hist_1d"] = {"counts": hist.counts_1d, "edges": hist.edges_1d}
    if two_d:
      out["grad_hist_2d"] = {"counts": hist.counts_2d, "x_edges": hist.edges_2d[0],
                             "y_edges": hist.edges_2d[1]}
    return float32(out), state
  return Family(_none, read)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["initial"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NormsState:
  """The norms' state: the parameters at `init` (for `distance`), or `None`."""

  initial: Any


def norms_family(wants, config) -> Family:
  del config
  names = [n for n in NORMS if n in wants]

  def init(params, key):
    del key  # A copy: the step may donate `params`, which must not delete `initial`.
    return NormsState(jax.tree.map(jnp.copy, params) if "distance" in wants else None)

  def pairs(step, state, start):
    out = {}
    if "grad_norm" in wants:
      out["grad_norm"] = (step.grads, step.grads)
    if "update_size" in wants:
      out["update_size"] = (step.updates, step.updates)
    if "distance" in wants:
      moved = jax.tree.map(jnp.subtract, step.params, state.initial)
      out["distance"] = (moved, moved)
    return out

  def read(step, state, start):
    treedef = jax.tree.structure(step.params)
    out, per_parameter = {}, {}
    for n in names:
      out[n] = jnp.sqrt(sum(step.sums[n]))
      per_parameter[n] = jax.tree.unflatten(treedef, [jnp.sqrt(v) for v in step.sums[n]])
    return float32({**out, PER_PARAMETER: per_parameter}), state

  return Family(init, read, pairs)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["update", "loss", "slope"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AlphaState:
  """Alpha's state: the last started step's update, and the `(mean, variance)` over
  its examples of the losses and of the slopes `<grad l_i, update>`."""

  update: Any
  loss: tuple[jax.Array, jax.Array]
  slope: tuple[jax.Array, jax.Array]


def alpha_family(wants, config) -> Family:
  del wants
  weighted = config.alpha_fit == "weighted"

  def init(params, key):
    del key
    return AlphaState(jax.tree.map(jnp.zeros_like, params), (_zero(), _zero()),
                      (_zero(), _zero()))

  def pairs(step, state, start):
    out = {"slope_1": (step.grads, state.update),
           "previous_size": (state.update, state.update)}
    if start:
      out["slope_0"] = (step.grads, step.updates)
    return out

  def begun(step, slope):
    """The state that starts the next read: this step's loss and slope moments."""
    loss = jnp.asarray(step.loss, jnp.float32)
    if not weighted:
      return AlphaState(step.updates, (loss, _zero()), (slope, _zero()))
    return AlphaState(step.updates, (loss, jnp.var(step.losses, ddof=1)),
                      (slope, jnp.var(step.slopes(step.updates), ddof=1)))

  def read(step, state, start):
    sums = step.sums
    slope_1 = sum(sums["slope_1"])
    if weighted:
      size = jnp.sqrt(sum(sums["previous_size"]))
      safe = jnp.where(size == 0, 1.0, size)
      slope_var = jnp.var(step.slopes(state.update), ddof=1)
      alpha = _step_quality.alpha_from_moments(
          size, (state.loss[0], jnp.asarray(step.loss, jnp.float32), state.slope[0] / safe,
                 slope_1 / safe),
          (state.loss[1], jnp.var(step.losses, ddof=1), state.slope[1] / safe**2,
           slope_var / safe**2))
    else:
      alpha = _step_quality.step_alpha(state.loss[0], state.slope[0], step.loss, slope_1,
                                       fit="unweighted")
    out = {"alpha": jnp.where(step.count > 0, alpha, jnp.nan)}
    return float32(out), begun(step, sum(sums["slope_0"])) if start else state

  def start(step, state):
    del state
    return begun(step, _step_quality.inner_products({"s": (step.grads, step.updates)})["s"])

  return Family(init, read, pairs, start)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["readings", "key"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CurvatureState:
  """The curvature's state: its last readings (by name, and per parameter) and the
  PRNG key of its next products."""

  readings: dict[str, Any]
  key: jax.Array


def curvature_family(wants, config) -> Family:
  names = [n for n in CURVATURE if n in wants]

  def init(params, key):
    readings = {n: jnp.full((), jnp.nan, jnp.float32) for n in names}
    if "hessian_trace" in wants:
      readings[PER_PARAMETER] = jax.tree.map(lambda _: jnp.full((), jnp.nan, jnp.float32),
                                             params)
    return CurvatureState(readings, jax.random.PRNGKey(0) if key is None else key)

  def measure(step, key):
    out = {}
    keys = dict(zip(("diagonal", "eigenvalue"), jax.random.split(key)))
    if wants & set(_DIAGONAL):
      diagonal = _hessian.hessian_diagonal(
          step.hessian_loss, step.params, key=keys["diagonal"],
          num_products=config.num_products, exact=config.exact_diagonal)
      leaves = [jnp.sum(v) for v in jax.tree.leaves(diagonal)]
      trace = sum(leaves)
      if "hessian_trace" in wants:
        out["hessian_trace"] = trace
        out[PER_PARAMETER] = jax.tree.unflatten(jax.tree.structure(step.params), leaves)
      if wants & {"tic_diag", "tic_trace"}:
        moments, batch = step.moments
        if "tic_trace" in wants:
          second = sum(jnp.sum(v) for m in moments.values()
                       for v in jax.tree.leaves(m.sum_squares))
          out["tic_trace"] = second / batch / (trace + _TIC_EPS)
        if "tic_diag" in wants:
          curvatures = step.split(diagonal)
          out["tic_diag"] = sum(
              jnp.sum(s / batch / (h.reshape(s.shape) + _TIC_EPS))
              for name, m in moments.items()
              for s, h in zip(jax.tree.leaves(m.sum_squares),
                              jax.tree.leaves(curvatures[name])))
    if "hessian_max_eigenvalue" in wants:
      out["hessian_max_eigenvalue"] = _hessian.hessian_max_eigenvalue(
          step.hessian_loss, step.params, key=keys["eigenvalue"],
          num_products=config.num_products)
    return float32(out)

  def read(step, state, start):
    """Measures every `curvature_every` steps (a `lax.cond`), else repeats."""
    del start
    key, use = jax.random.split(state.key)
    readings = lax.cond(step.count % config.curvature_every == 0,
                        lambda: measure(step.fresh(), use), lambda: state.readings)
    out = {n: readings[n] for n in names}
    if PER_PARAMETER in readings:
      out[PER_PARAMETER] = {"hessian_trace": readings[PER_PARAMETER]}
    return out, CurvatureState(readings, key)

  return Family(init, read, every_step=True)


# Each family's instruments and its function, in the order their readings merge.
FAMILIES: dict[str, tuple[tuple[str, ...], Callable[..., Family]]] = {
    "loss": (("loss",), loss_family),
    "tests": (TESTS, tests_family),
    "moments": (MOMENTS, moments_family),
    "histograms": (HISTOGRAMS, histograms_family),
    "norms": (NORMS, norms_family),
    "alpha": (("alpha",), alpha_family),
    "curvature": (CURVATURE, curvature_family),
}


def families(wants: set, config: Config) -> dict[str, Family]:
  """The families of the instruments asked for."""
  return {name: make(wants, config) for name, (names, make) in FAMILIES.items()
          if wants & set(names)}
