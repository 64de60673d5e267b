"""Training instruments in the step, as an optax-style `init`/`update` state.

`training_instruments(preset)` gathers Cockpit's instruments (Schneider, Dangel and
Hennig 2021), with Cockpit's definitions, into one pure transform that runs inside
the jitted step and on the device: `update(records, state, ...)` returns the
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

The instruments are small transformations, one per family (loss, batch-size tests,
moments, histograms, norms, alpha, curvature: `_families.py`), each with its state
beside it (`InstrumentsState.families`), chained here: the inputs several families
read (the layer selection, the parameters placed by layer, the layer moments, the
parameter-sized inner products) are computed once per step.

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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog._base import Transform, check_order
from oryx_gradlog.analyses.instruments import _families, _step_quality
from oryx_gradlog.analyses.instruments._families import CURVATURE, PER_PARAMETER, Step
from oryx_gradlog.analyses.instruments._schedule import as_schedule

ECONOMY = ("alpha", "distance", "grad_hist_1d", "grad_norm", "inner_product_test", "loss",
           "norm_test", "orthogonality_test", "update_size")
BUSINESS = ECONOMY + ("tic_diag", "hessian_trace")
PRESETS = {
    "economy": ECONOMY,
    "business": BUSINESS,
    "full": BUSINESS + ("hessian_max_eigenvalue", "grad_hist_2d"),
}
INSTRUMENTS = PRESETS["full"] + ("mean_gsnr", "early_stopping", "cabs", "tic_trace")
# What a step does under `every`: read the instruments, start the next read step's
# alpha (keep this step's loss, slope moments and update), both, or neither.
_PHASES = ("read", "start", "read_start", "skip")


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["step", "families"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class InstrumentsState:
  """What the instruments remember between steps.

  Attributes:
    step: updates so far.
    families: per family of instruments that keeps a state, its state: `"norms"`
      the initial parameters (for `distance`), `"alpha"` the last started step's
      update and its loss and slope moments, `"curvature"` the last curvature
      readings and a PRNG key.
  """

  step: jax.Array
  families: dict[str, Any]


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


def _merge(readings: dict, more: dict) -> dict:
  """Readings of two families, their per-parameter trees side by side."""
  out = {**readings, **more}
  if PER_PARAMETER in readings and PER_PARAMETER in more:
    out[PER_PARAMETER] = {**readings[PER_PARAMETER], **more[PER_PARAMETER]}
  return out


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
) -> Transform:
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
    A `gl.Transform`. `init(params, key=None)` gives the state;
    `update(records, state, *, loss, grads, params, updates, losses=None,
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
    ...       records, state, loss=value, grads=grads, params=w, updates=-0.05 * grads,
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
  schedule = as_schedule(every)
  every_step = not callable(every) and every == 1
  wants = set(instruments)
  curvature = [n for n in instruments if n in CURVATURE]
  wants_alpha = "alpha" in wants
  weighted = wants_alpha and alpha_fit == "weighted"
  config = _families.Config(api, reduction, names, tied, where, alpha_fit, curvature_every,
                            num_products, exact_diagonal)
  chosen = _families.families(wants, config)
  per_step = {n: f for n, f in chosen.items() if not f.every_step}
  every_call = {n: f for n, f in chosen.items() if f.every_step}
  starting = [n for n, f in per_step.items() if f.start is not None]

  def init(params, key=None):
    states = {n: f.init(params, key) for n, f in chosen.items()}
    return InstrumentsState(step=jnp.zeros((), jnp.int32),
                            families={n: v for n, v in states.items() if v is not None})

  def read(step: Step, states: dict, start: bool):
    """The per-step families' readings and states after a read step; their leaf
    inner products in one pass."""
    pairs = {}
    for name, family in per_step.items():
      if family.pairs is not None:
        pairs.update(family.pairs(step, states.get(name), start))
    step.sums = _step_quality.leaf_inner_products(pairs) if pairs else {}
    readings, states = {}, dict(states)
    for name, family in per_step.items():
      out, new = family.update(step, states.get(name), start)
      readings = _merge(readings, out)
      if new is not None:
        states[name] = new
    return readings, states

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

  def update(records, state: InstrumentsState, *, loss, grads, params, updates,
             losses=None, learning_rate=None,
             hessian_loss: Callable[[Any], jax.Array] | None = None,
             phase: str | None = None):
    check_order(f"{api}.update", InstrumentsState, records)
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

    # `call.fresh()` in each branch: nothing traced in one is read in another.
    call = Step(config, state.step, records, loss=loss, grads=grads, params=params,
                updates=updates, losses=losses, learning_rate=learning_rate,
                hessian_loss=hessian_loss)

    states = dict(state.families)
    if reads is True and starts is True:  # Read, and start the next alpha in one pass.
      readings, states = read(call.fresh(), states, start=wants_alpha)
    else:
      shapes = jax.eval_shape(lambda: read(call.fresh(), states, start=False)[0])
      readings = when(reads, lambda: read(call.fresh(), states, start=False)[0],
                      lambda: jax.tree.map(_unread, shapes))
      if starting:  # Only the states that a start changes go through its condition.
        kept = {n: states[n] for n in starting}
        states.update(when(
            starts, lambda: {n: per_step[n].start(call.fresh(), kept[n]) for n in starting},
            lambda: kept))
    for name, family in every_call.items():
      out, states[name] = family.update(call.fresh(), states[name], False)
      readings = _merge(readings, out)
    readings = {n: readings[n] for n in [*instruments, PER_PARAMETER] if n in readings}
    return readings, InstrumentsState(state.step + 1, states)

  return Transform(init, update, phase)


def _unread(shape):
  """What a step that reads nothing reports: NaN, or -1 for counts."""
  fill = -1 if jnp.issubdtype(shape.dtype, jnp.integer) else jnp.nan
  return jnp.full(shape.shape, fill, shape.dtype)
