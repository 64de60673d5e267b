"""Training instruments in the step, as an optax-style `init`/`update` state.

`training_instruments(preset)` gathers Cockpit's instruments (Schneider, Dangel and
Hennig 2021), with Cockpit's definitions, into one pure transform that runs inside
the jitted step and on the device: `update(state, records, ...)` returns the
readings (scalars, per-parameter trees and histogram counts: hand them to
`RunLog.append` under `"instruments"` and `report` draws them as
`dashboard.html`, laid out as Cockpit's) and the new state. The state holds what
needs memory: the initial parameters (for the distance), the last update, loss and
slope moments (for alpha), the last curvature readings and a PRNG key.

The instruments (Cockpit's quantity in brackets), from the records of the one
backward pass of the step where the mathematics allows:

* `loss` (Loss); `grad_norm` (GradNorm), `update_size` (UpdateSize), `distance`
  (Distance): L2 norms, with the norm of each parameter under `per_parameter`;
* `norm_test`, `inner_product_test`, `orthogonality_test` (NormTest, InnerTest,
  OrthoTest): `gl.batch_size_tests` (Gram forms or jvps of the records);
* `alpha` (Alpha): `gl.step_alpha`'s weighted parabola fit; the per-example
  projections `<grad l_i, d>` are jvps of each recorded layer along its slice of
  the update, the per-example losses are `update(..., losses=...)`;
* `mean_gsnr` (MeanGSNR), `early_stopping` (EarlyStopping, Mahsereci et al. 2017:
  `1 - B mean(gbar^2 / (var_i + 1e-5))`, sample variance; above 0, stop), `cabs`
  (CABS, Balles et al. 2017: `lr sum(var_i) / loss`, population variance, the
  batch size CABS suggests for SGD at learning rate `lr`): per-parameter second
  moments `sum_i grad_i^2` of the records (see `gl.gradient_snr`);
* `grad_hist_1d`, `grad_hist_2d` (GradHist1d, GradHist2d): `gl.gradient_histograms`;
* `hessian_trace` (HessTrace, and per parameter), `hessian_max_eigenvalue`
  (HessMaxEV), `tic_diag`, `tic_trace` (TICDiag, TICTrace, Thomas et al. 2019:
  `sum(mean_i grad_i^2 / (diag(H) + 1e-7))` and `sum(mean_i grad_i^2) / (tr(H) +
  1e-7)`): Hessian-vector products of `hessian_loss` (not one backward pass: see
  `gl.hessian_diagonal`), every `curvature_every` steps (a `lax.cond`; between,
  the last values are repeated).

Cockpit's three configurations are the presets:

* `"economy"`: alpha, distance, grad_hist_1d, grad_norm, inner_product_test,
  loss, norm_test, orthogonality_test, update_size;
* `"business"`: economy, tic_diag and hessian_trace;
* `"full"`: business, hessian_max_eigenvalue and grad_hist_2d.

`mean_gsnr`, `cabs`, `early_stopping` and `tic_trace` are in no preset (as in
Cockpit); a tuple of instrument names picks any set. Cockpit's Time is host time:
log `time.time()` beside the readings (`"instruments": {..., "time": ...}`) and the
dashboard draws the time per step.

Scheduling. `every=k` reads the per-step instruments on steps 0, k, 2k, ...
(Cockpit's `linear(k)`); `every=` also takes a schedule, a function of the step
that says whether to read (`gl.linear_schedule`, `gl.logarithmic_schedule`, as
Cockpit's `track_schedule`). The steps between read NaN (histogram counts -1), and
only the step before each read step keeps what alpha needs. From a Python training
loop, give the schedule as a static argument, so that each phase compiles once and
the steps between carry no `lax.cond`, and donate the parameters and the state, so
that XLA updates them in place instead of copying the parameter-sized state through
each step (measured on a 4 x 512 MLP, batch 128, CPU: the economy preset without
grad_hist_1d at `every=10` costs about 1.2x a plain step, both donated; with it,
7.3x, as grad_hist_1d bins every element of every example's gradient; Cockpit
itself, 19.8x; see `benchmarks/RESULTS.md`, workload 10):

    instruments = gl.training_instruments("economy", every=10)
    step = jax.jit(train_step, static_argnames="phase", donate_argnums=(0, 1))
    for i, batch in enumerate(batches):   # train_step passes phase to update
      params, state, readings = step(params, state, batch, phase=instruments.phase(i))

Sharp edges:
  * `alpha` at step t is that of the previous step's update (it needs the loss and
    gradient after it): NaN at the first step. Cockpit logs the same value under
    the step the update started from.
  * The weighted `alpha` needs `losses` (per-example losses, Cockpit's
    `individual_losses`) and each marked layer's slice of the update: records of
    `gl.record_layers` (hand-marked layers in it too) are placed by parameter path;
    a hand-marked record of a plain `reap` must have a weight (and bias) that is a
    leaf of `params` itself, found by identity in a jitted step (values are never
    compared), or be named in `where` (as for `to_param_tree`); the same holds for
    `tic_diag`. Parameters outside the marked
    layers add to the mean slope but not to its variance.
  * `grad_norm`, `update_size`, `distance` and the alpha means use every parameter
    (`grads`, `updates`, `params`); the tests, GSNR, early stopping, CABS, TIC and
    histograms use the marked layers of `records` only, where Cockpit uses every
    parameter.
  * `grad_hist_1d` (in the economy preset, as in Cockpit's) and `grad_hist_2d` bin
    every element of every example's gradient: B times the parameters per reading,
    tens of plain steps on a CPU. Read them seldom (`every=`), or leave them out of
    the tuple of instruments.
  * The curvature instruments need `hessian_loss`, the batch loss as a function of
    the parameters alone, and estimate from `num_products` Hessian-vector products
    what Cockpit computes exactly with BackPACK (the Hessian's diagonal): noisy,
    and `tic_diag` divides by the noisy diagonal. `exact_diagonal=True` computes
    that diagonal exactly, at one product per parameter (small models: to read
    Cockpit's `tic_diag`). Measure them every `curvature_every` steps.
  * `cabs` and `early_stopping` assume plain SGD (as Cockpit, which refuses other
    optimizers); `cabs` needs `learning_rate`.
  * A static `phase` is trusted: pass `instruments.phase(i)` for the i-th call of
    `update` (the state's step count is traced and cannot be checked against it).
  * A schedule function given to `every` is called with a traced step when no
    `phase` is passed: it must then work on JAX integers (the two provided do).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.curvature import _hessian
from oryx_gradlog.analyses.instruments import _histograms, _instruments
from oryx_gradlog.analyses.instruments import _step_quality
from oryx_gradlog.record._selection import collect

ECONOMY = ("alpha", "distance", "grad_hist_1d", "grad_norm", "inner_product_test", "loss",
           "norm_test", "orthogonality_test", "update_size")
BUSINESS = ECONOMY + ("tic_diag", "hessian_trace")
PRESETS = {
    "economy": ECONOMY,
    "business": BUSINESS,
    "full": BUSINESS + ("hessian_max_eigenvalue", "grad_hist_2d"),
}
INSTRUMENTS = PRESETS["full"] + ("mean_gsnr", "early_stopping", "cabs", "tic_trace")
_TESTS = ("norm_test", "inner_product_test", "orthogonality_test")
_MOMENTS = ("mean_gsnr", "early_stopping", "cabs", "grad_hist_1d", "grad_hist_2d")
_CURVATURE = ("hessian_trace", "hessian_max_eigenvalue", "tic_diag", "tic_trace")
_DIAGONAL = ("hessian_trace", "tic_diag", "tic_trace")
_NORMS = ("grad_norm", "update_size", "distance")
PER_PARAMETER = "per_parameter"
# What a step does under `every`: read the instruments, start the next read step's
# alpha (keep this step's loss, slope moments and update), both, or neither.
_PHASES = ("read", "start", "read_start", "skip")
# Cockpit's stabilising constants.
_GSNR_EPS, _EARLY_STOPPING_EPS, _TIC_EPS = 1e-5, 1e-5, 1e-7


class Schedule(NamedTuple):
  """A tracking schedule: `schedule(step)` says whether to read at `step`, for a
  Python int (a bool) or a traced JAX integer (a traced bool)."""

  fn: Callable[[Any], Any]
  description: str

  def __call__(self, step):
    return self.fn(step)


def linear_schedule(interval: int, offset: int = 0) -> Schedule:
  """Returns Cockpit's `linear` schedule: read at steps `offset + n * interval`, n >= 0.

  Example:
    >>> import oryx_gradlog as gl
    >>> schedule = gl.linear_schedule(3, offset=1)
    >>> [step for step in range(9) if schedule(step)]
    [1, 4, 7]
  """
  for arg, value, least in (("interval", interval, 1), ("offset", offset, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
      raise ValueError(f"linear_schedule({arg}={value!r}): give an integer >= {least}.")

  def fn(step):
    shifted = step - offset
    if isinstance(step, int):
      return shifted >= 0 and shifted % interval == 0
    return (shifted >= 0) & (shifted % interval == 0)

  return Schedule(fn, f"steps {offset} + n * {interval}")


def logarithmic_schedule(start: float, end: float, steps: int = 300, base: float = 10,
                         init: bool = True) -> Schedule:
  """Returns Cockpit's `logarithmic` schedule: read at `int(base ** e)` for `steps`
  exponents `e` evenly spaced from `start` to `end`, and at step 0 if `init`.

  Example:
    >>> import oryx_gradlog as gl
    >>> schedule = gl.logarithmic_schedule(0, 2, steps=5)  # 1, 3, 10, 31, 100
    >>> [step for step in range(101) if schedule(step)]
    [0, 1, 3, 10, 31, 100]
  """
  tracked = np.logspace(start, end, steps, base=base).astype(np.int64)
  if init:
    tracked = np.append(tracked, 0)
  tracked = np.unique(tracked)
  members = frozenset(int(t) for t in tracked)

  def fn(step):
    if isinstance(step, int):
      return step in members
    return jnp.any(jnp.asarray(step) == jnp.asarray(tracked, jnp.int32))

  return Schedule(fn, f"{len(tracked)} logarithmically spaced steps up to {tracked[-1]}")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "initial", "previous_update", "previous_loss", "previous_slope",
                 "curvature", "key"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class InstrumentsState:
  """What the instruments remember between steps (`None` where none needs it).

  Attributes:
    step: updates so far.
    initial: the parameters at `init` (for `distance`).
    previous_update: the last started step's update (for `alpha`).
    previous_loss, previous_slope: `(mean, variance)` over the examples of that
      step's losses and of the slopes `<grad l_i, update>` (for `alpha`).
    curvature: the last curvature readings, by name (and per parameter).
    key: the PRNG key for the curvature instruments.
  """

  step: jax.Array
  initial: Any
  previous_update: Any
  previous_loss: tuple[jax.Array, jax.Array] | None
  previous_slope: tuple[jax.Array, jax.Array] | None
  curvature: dict[str, Any]
  key: jax.Array | None


class InstrumentsTransform(NamedTuple):
  """Pure functions, as an optax `GradientTransformation` is (see
  `training_instruments`): `init`, `update`, and `phase`, what a Python int step
  does under the schedule."""

  init: Any
  update: Any
  phase: Any


def _instrument_names(preset) -> tuple[str, ...]:
  if isinstance(preset, str):
    if preset not in PRESETS:
      raise ValueError(f"training_instruments(preset={preset!r}): the presets are "
                       f"{sorted(PRESETS)}; or pass a tuple of instruments from "
                       f"{INSTRUMENTS}.")
    return PRESETS[preset]
  names = tuple(preset)
  unknown = [n for n in names if n not in INSTRUMENTS]
  if unknown or not names:
    raise ValueError(f"training_instruments(preset={preset!r}): {unknown or 'nothing'} "
                     f"is not an instrument; pick from {INSTRUMENTS}.")
  return names


def _schedule(every) -> Schedule:
  if callable(every):
    return every if isinstance(every, Schedule) else Schedule(every, repr(every))
  if not isinstance(every, int) or isinstance(every, bool) or every < 1:
    raise ValueError(f"training_instruments(every={every!r}): give a positive integer or "
                     "a schedule function of the step (gl.linear_schedule, "
                     "gl.logarithmic_schedule).")
  return linear_schedule(every)


def training_instruments(
    preset: str | Sequence[str] = "economy",
    *,
    reduction: str = "mean",
    every: int | Callable[[Any], Any] = 1,
    curvature_every: int = 10,
    num_products: int = 20,
    exact_diagonal: bool = False,
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
    where: Any = None,
    alpha_fit: str = "weighted",
) -> InstrumentsTransform:
  """Returns `init`/`update` functions that read Cockpit's instruments in the step.

  Args:
    preset: `"economy"`, `"business"`, `"full"` or a tuple of instrument names
      (see the module docstring).
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    every: read the per-step instruments on steps 0, k, 2k, ... only (an int k,
      Cockpit's `linear(k)`), or on the steps where a schedule function of the step
      is true (`gl.linear_schedule`, `gl.logarithmic_schedule`, Cockpit's
      `track_schedule`). The steps between read NaN and skip their work. By
      default `update` follows the state's step count with `lax.cond` (fine inside
      a `lax.scan`); from a Python training loop pass
      `phase=instruments.phase(step)` as a static argument of the jitted step.
    curvature_every: measure the curvature instruments every this many steps.
    num_products: Hessian-vector products per curvature instrument and use.
    exact_diagonal: `hessian_trace`, `tic_diag` and `tic_trace` from the exact
      Hessian diagonal (Cockpit's), one product per parameter, instead of
      `num_products` products' estimate: for small models.
    names, tied: the layer records to use, as for `per_example_norms`.
    where: for `alpha` and `tic_diag` with hand-marked records of a plain `reap`
      (which know no parameter path) outside `jit`, or whose weights are not leaves
      of `params` passed as they are: a tree like `params` with `'NAME.w'`,
      `'NAME.b'` or `None` at each leaf, as for `to_param_tree`. Not needed for
      records of `gl.record_layers` (hand-marked layers in it too).
    alpha_fit: `"weighted"` (Cockpit's) or `"unweighted"` (our earlier alpha, from
      the batch means alone; no `losses` needed, NaN without curvature).

  Returns:
    An `InstrumentsTransform`. `init(params, key=None)` gives the state;
    `update(state, records, *, loss, grads, params, updates, losses=None,
    learning_rate=None, hessian_loss=None, phase=None)` returns `(readings,
    state)`: `readings` a dict by instrument name of scalars, of histograms
    (`{"counts", "edges"}`) and, under `"per_parameter"`, of trees like `params`.
    `params` are those the gradient was taken at, `updates` what the optimizer
    adds to them, `losses` the per-example losses (for `alpha`),
    `learning_rate` SGD's (for `cabs`). `phase(step)` says what a Python int step
    does: `"read"`, `"start"` (the step before a read step keeps what alpha
    needs), `"read_start"` or `"skip"`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> @gl.record_layers  # records every layer by parameter path
    ... def loss(w, x):
    ...   losses = jnp.sum((x @ w) ** 2, axis=-1)
    ...   return jnp.mean(losses), losses
    >>> w, x = jnp.ones((1, 1)), jnp.array([[1.0], [3.0]])
    >>> instruments = gl.training_instruments(("loss", "alpha", "grad_norm"))
    >>> state = instruments.init(w)
    >>> for _ in range(2):
    ...   ((value, losses), grads), records = gl.call_and_reap(
    ...       jax.value_and_grad(loss, has_aux=True))(w, x)
    ...   readings, state = instruments.update(
    ...       state, records, loss=value, grads=grads, params=w, updates=-0.05 * grads,
    ...       losses=losses)
    ...   w = w - 0.05 * grads
    >>> round(float(readings["alpha"]), 4)  # f(w) = 5 w^2: step 0.5 / 1 of the way
    -0.5
  """
  api = "training_instruments"
  instruments = _instrument_names(preset)
  if not isinstance(curvature_every, int) or isinstance(curvature_every, bool) or (
      curvature_every < 1):
    raise ValueError(f"{api}(curvature_every={curvature_every!r}): give a positive integer.")
  if not isinstance(exact_diagonal, bool):
    raise ValueError(f"{api}(exact_diagonal={exact_diagonal!r}): give True or False.")
  if alpha_fit not in ("weighted", "unweighted"):
    raise ValueError(f"{api}(alpha_fit={alpha_fit!r}): give 'weighted' (Cockpit's) or "
                     "'unweighted'.")
  schedule = _schedule(every)
  every_step = not callable(every) and every == 1
  curvature = [n for n in instruments if n in _CURVATURE]
  wants = set(instruments)
  wants_alpha = "alpha" in wants
  weighted = wants_alpha and alpha_fit == "weighted"
  per_step = [n for n in instruments if n not in _CURVATURE]

  def init(params, key=None):
    zero = lambda: jnp.zeros((), jnp.float32)  # One buffer each: states get donated.
    if curvature and key is None:
      key = jax.random.PRNGKey(0)
    measured = {n: jnp.full((), jnp.nan, jnp.float32) for n in curvature}
    if "hessian_trace" in wants:
      measured[PER_PARAMETER] = jax.tree.map(lambda _: jnp.full((), jnp.nan, jnp.float32),
                                             params)
    return InstrumentsState(
        step=jnp.zeros((), jnp.int32),
        # A copy: the step may donate `params`, which must not delete `initial`.
        initial=jax.tree.map(jnp.copy, params) if "distance" in wants else None,
        previous_update=(jax.tree.map(jnp.zeros_like, params) if wants_alpha else None),
        previous_loss=(zero(), zero()) if wants_alpha else None,
        previous_slope=(zero(), zero()) if wants_alpha else None,
        curvature=measured,
        key=key if curvature else None)

  def selection_of(records):
    return collect(f"{api}.update", records, names, tied=tied)

  def slopes(selection, directions):
    """`(B,)`: per example, `<grad l_i, direction>` over the recorded layers, the
    direction by key (`Selection.splitter`)."""
    total = selection.products(directions)
    return _common.loss_scale(reduction, total.shape[0]) * total

  def moment_readings(records, loss, learning_rate, params):
    readings = {}
    if wants & {"mean_gsnr", "early_stopping", "cabs"}:
      moments, batch = _instruments.layer_moments(
          f"{api}.update", records, reduction=reduction, names=names, tied=tied)
      mean_sq = [(m * m, s / batch) for moment in moments.values()
                 for m, s in zip(jax.tree.leaves(moment.mean),
                                 jax.tree.leaves(moment.sum_squares))]
      count = sum(m.size for m, _ in mean_sq)
    if "mean_gsnr" in wants:
      readings["mean_gsnr"] = sum(
          jnp.sum(g2 / (s - g2 + _GSNR_EPS)) for g2, s in mean_sq) / count
    if "early_stopping" in wants:
      snr = sum(jnp.sum(g2 / ((s - g2) * batch / (batch - 1) + _EARLY_STOPPING_EPS))
                for g2, s in mean_sq)
      readings["early_stopping"] = 1 - batch * snr / count
    if "cabs" in wants:
      mean_loss = loss / batch if reduction == "sum" else loss
      readings["cabs"] = learning_rate * sum(jnp.sum(s - g2) for g2, s in mean_sq) / mean_loss
    if wants & {"grad_hist_1d", "grad_hist_2d"}:
      selection = selection_of(records)
      batch = _common.one_batch_size(f"{api}.update", selection.batch_sizes, minimum=2)
      two_d = "grad_hist_2d" in wants
      values = ({**selection.values(), **selection.by_path(f"{api}.update", params)}
                if two_d else {})
      hist = _histograms.histograms(f"{api}.update", selection,
                                    _common.loss_scale(reduction, batch), values,
                                    two_d=two_d, one_d="grad_hist_1d" in wants)
      if "grad_hist_1d" in wants:
        readings["grad_hist_1d"] = {"counts": hist.counts_1d, "edges": hist.edges_1d}
      if two_d:
        readings["grad_hist_2d"] = {"counts": hist.counts_2d, "x_edges": hist.edges_2d[0],
                                    "y_edges": hist.edges_2d[1]}
    return readings

  def read(state, records, loss, grads, params, updates, losses, learning_rate, start):
    """The per-step readings, and alpha's start `(loss, slope)` moments if `start`."""
    readings = {}
    if "loss" in wants:
      readings["loss"] = loss
    if wants & set(_TESTS):
      tests = _instruments.batch_size_tests(records, reduction=reduction, names=names,
                                            tied=tied)
      readings.update({n: getattr(tests, n) for n in _TESTS if n in wants})
    if wants & set(_MOMENTS):
      readings.update(moment_readings(records, loss, learning_rate, params))
    pairs = {}
    if "grad_norm" in wants:
      pairs["grad_norm"] = (grads, grads)
    if "update_size" in wants:
      pairs["update_size"] = (updates, updates)
    if "distance" in wants:
      moved = jax.tree.map(jnp.subtract, params, state.initial)
      pairs["distance"] = (moved, moved)
    if wants_alpha:
      pairs["slope_1"] = (grads, state.previous_update)
      pairs["previous_size"] = (state.previous_update, state.previous_update)
    if start:
      pairs["slope_0"] = (grads, updates)
    sums = _step_quality.leaf_inner_products(pairs) if pairs else {}
    treedef = jax.tree.structure(params)
    per_parameter = {}
    for n in _NORMS:
      if n in wants:
        readings[n] = jnp.sqrt(sum(sums[n]))
        per_parameter[n] = jax.tree.unflatten(treedef, [jnp.sqrt(v) for v in sums[n]])
    if per_parameter:
      readings[PER_PARAMETER] = per_parameter
    begun = None
    if weighted:
      selection = selection_of(records)
      split = selection.splitter(f"{api}.update", params, where)
      loss_1 = (jnp.asarray(loss, jnp.float32), jnp.var(losses, ddof=1))
      slope_var = jnp.var(slopes(selection, split(state.previous_update)), ddof=1)
      size = jnp.sqrt(sum(sums["previous_size"]))
      safe = jnp.where(size == 0, 1.0, size)
      slope_1 = sum(sums["slope_1"])
      alpha = _step_quality.alpha_from_moments(
          size, (state.previous_loss[0], loss_1[0], state.previous_slope[0] / safe,
                 slope_1 / safe),
          (state.previous_loss[1], loss_1[1], state.previous_slope[1] / safe**2,
           slope_var / safe**2))
      readings["alpha"] = jnp.where(state.step > 0, alpha, jnp.nan)
      if start:
        begun = (loss_1, (sum(sums["slope_0"]), jnp.var(
            slopes(selection, split(updates)), ddof=1)))
    elif wants_alpha:
      alpha = _step_quality.step_alpha(state.previous_loss[0], state.previous_slope[0],
                                       loss, sum(sums["slope_1"]), fit="unweighted")
      readings["alpha"] = jnp.where(state.step > 0, alpha, jnp.nan)
      if start:
        zero = jnp.zeros((), jnp.float32)
        begun = ((jnp.asarray(loss, jnp.float32), zero), (sum(sums["slope_0"]), zero))
    readings = {n: readings[n] for n in [*per_step, PER_PARAMETER] if n in readings}
    return _float32(readings), begun

  def start_only(records, loss, grads, params, updates, losses):
    """Alpha's start moments alone (a step before a read step)."""
    slope = _step_quality.inner_products({"s": (grads, updates)})["s"]
    if not weighted:
      zero = jnp.zeros((), jnp.float32)
      return (jnp.asarray(loss, jnp.float32), zero), (slope, zero)
    selection = selection_of(records)
    directions = selection.splitter(f"{api}.update", params, where)(updates)
    return ((jnp.asarray(loss, jnp.float32), jnp.var(losses, ddof=1)),
            (slope, jnp.var(slopes(selection, directions), ddof=1)))

  def measure_curvature(records, hessian_loss, params, key):
    measured = {}
    keys = dict(zip(("diagonal", "eigenvalue"), jax.random.split(key)))
    if wants & set(_DIAGONAL):
      diagonal = _hessian.hessian_diagonal(hessian_loss, params, key=keys["diagonal"],
                                           num_products=num_products, exact=exact_diagonal)
      leaves = [jnp.sum(v) for v in jax.tree.leaves(diagonal)]
      trace = sum(leaves)
      if "hessian_trace" in wants:
        measured["hessian_trace"] = trace
        measured[PER_PARAMETER] = jax.tree.unflatten(jax.tree.structure(params), leaves)
      if wants & {"tic_diag", "tic_trace"}:
        moments, batch = _instruments.layer_moments(
            f"{api}.update", records, reduction=reduction, names=names, tied=tied)
        if "tic_trace" in wants:
          second = sum(jnp.sum(v) for m in moments.values()
                       for v in jax.tree.leaves(m.sum_squares))
          measured["tic_trace"] = second / batch / (trace + _TIC_EPS)
        if "tic_diag" in wants:
          curvatures = selection_of(records).splitter(f"{api}.update", params,
                                                       where)(diagonal)
          measured["tic_diag"] = sum(
              jnp.sum(s / batch / (h.reshape(s.shape) + _TIC_EPS))
              for name, m in moments.items()
              for s, h in zip(jax.tree.leaves(m.sum_squares),
                              jax.tree.leaves(curvatures[name])))
    if "hessian_max_eigenvalue" in wants:
      measured["hessian_max_eigenvalue"] = _hessian.hessian_max_eigenvalue(
          hessian_loss, params, key=keys["eigenvalue"], num_products=num_products)
    return _float32(measured)

  def phase(step: int) -> str:
    """What step `step` (a Python int) does under the schedule."""
    reads, starts = bool(schedule(step)), wants_alpha and bool(schedule(step + 1))
    return {(True, True): "read_start", (True, False): "read", (False, True): "start",
            (False, False): "skip"}[reads, starts]

  def when(condition, fn, otherwise):
    """`fn()` or `otherwise()`: chosen in Python for a bool, by `lax.cond` if traced."""
    if isinstance(condition, bool):
      return fn() if condition else otherwise()
    return lax.cond(condition, fn, otherwise)

  def traced_schedule(step):
    try:
      return jnp.asarray(schedule(step), bool)
    except jax.errors.ConcretizationTypeError as error:
      raise ValueError(
          f"{api}.update: the schedule {schedule.description} cannot be evaluated on the "
          "traced step count. Pass phase=instruments.phase(step) as a static argument "
          "of the jitted step, or use gl.linear_schedule / gl.logarithmic_schedule."
      ) from error

  def update(state: InstrumentsState, records, *, loss, grads, params, updates,
             losses=None, learning_rate=None,
             hessian_loss: Callable[[Any], jax.Array] | None = None,
             phase: str | None = None):
    problems = []
    if curvature and hessian_loss is None:
      problems.append(f"the instruments {curvature} need hessian_loss, the batch loss as "
                      "a function of the parameters, e.g. hessian_loss=lambda p: loss(p, x, y)")
    if weighted and losses is None:
      problems.append("alpha needs losses, the per-example losses (B,) of the batch "
                      "(Cockpit's individual_losses), or training_instruments("
                      "alpha_fit='unweighted')")
    if "cabs" in wants and learning_rate is None:
      problems.append("cabs needs learning_rate, SGD's learning rate")
    if phase is not None and phase not in _PHASES:
      problems.append(f"phase={phase!r} is not one of {_PHASES} (give None, the schedule "
                      "from the state's step count, or instruments.phase(step))")
    if problems:
      raise ValueError(f"{api}.update: " + "; ".join(problems) + ".")
    if phase is None and every_step:
      reads = starts = True
    elif phase is None:  # The schedule on the traced step count.
      reads = traced_schedule(state.step)
      starts = traced_schedule(state.step + 1) if wants_alpha else False
    else:
      reads, starts = phase in ("read", "read_start"), wants_alpha and phase in (
          "start", "read_start")
    losses = None if losses is None else jnp.asarray(losses, jnp.float32)
    args = (state, records, loss, grads, params, updates, losses, learning_rate)
    keep = lambda: (state.previous_loss, state.previous_slope, state.previous_update)
    if reads is True and starts is True:  # Read, and start the next alpha in one pass.
      readings, begun = read(*args, start=wants_alpha)
      begun = (*begun, updates) if wants_alpha else None
    else:
      shapes = jax.eval_shape(lambda: read(*args, start=False)[0])
      readings = when(reads, lambda: read(*args, start=False)[0],
                      lambda: jax.tree.map(_unread, shapes))
      begun = None
      if wants_alpha:
        begun = when(starts, lambda: (*start_only(records, loss, grads, params, updates,
                                                  losses), updates), keep)
    previous = {}
    if wants_alpha:
      previous = dict(zip(("previous_loss", "previous_slope", "previous_update"), begun))
    measured, key = state.curvature, state.key
    if curvature:
      key, use = jax.random.split(state.key)
      measured = lax.cond(state.step % curvature_every == 0,
                          lambda: measure_curvature(records, hessian_loss, params, use),
                          lambda: state.curvature)
      readings.update({n: measured[n] for n in curvature})
      if PER_PARAMETER in measured:
        readings[PER_PARAMETER] = {**readings.get(PER_PARAMETER, {}),
                                   "hessian_trace": measured[PER_PARAMETER]}
    readings = {n: readings[n] for n in [*instruments, PER_PARAMETER] if n in readings}
    return readings, dataclasses.replace(state, step=state.step + 1, curvature=measured,
                                         key=key, **previous)

  return InstrumentsTransform(init, update, phase)


def _float32(tree):
  return jax.tree.map(
      lambda v: v if jnp.issubdtype(jnp.result_type(v), jnp.integer)
      else jnp.asarray(v, jnp.float32), tree)


def _unread(shape):
  """What a step that reads nothing reports: NaN, or -1 for counts."""
  fill = -1 if jnp.issubdtype(shape.dtype, jnp.integer) else jnp.nan
  return jnp.full(shape.shape, fill, shape.dtype)
