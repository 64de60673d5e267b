"""Training instruments in the step, as an optax-style `init`/`update` state.

`training_instruments(preset)` gathers the instruments of `batch_size_tests`,
`gradient_snr`, `step_alpha`, `update_size`, `hessian_trace` and
`hessian_max_eigenvalue` into one pure transform, as Cockpit (Schneider, Dangel and
Hennig 2021) does for PyTorch, but inside the jitted step and on the device:
`update(state, records, ...)` returns a dict of scalars (the readings: hand them to
`RunLog.append` under `"instruments"` and `report` draws them as `dashboard.html`)
and the new state. The state holds what needs memory: the initial parameters (for
the distance), the previous update, loss and slope (for alpha), the last curvature
readings and a PRNG key; curvature is measured every `curvature_every` steps (a
`lax.cond`; between, the last values are repeated).

What a reading costs (measured on a 4 x 512 MLP, batch 128, CPU; see
`benchmarks/RESULTS.md`): the batch-size tests take two small Gram matrices per
dense layer (`B^2 (d_in + d_out)` multiply-adds, about a sixth of the step's
matmuls at that size); grad_norm, update_size, alpha and distance take five
parameter-sized reductions (`|g|^2`, `|u|^2`, `<g, u>`, `<g, u_prev>`,
`|theta - theta_0|^2`), which XLA's CPU backend runs well below memory speed. Read
every step, the economy preset costs 1.3-1.4 plain steps there. `every=k` reads the
per-step instruments on every k-th step only (Cockpit's `track_interval`); the steps
between read NaN, and only the one before each read step keeps what alpha needs.
Scheduled by the state's step count, that takes `lax.cond`s, which inside a
`lax.scan` cost 1.03 (JAX 0.5.0) to 1.17 (JAX 0.10.2) plain steps for `every=10`
even on steps that read nothing. From a Python training loop, give the schedule as
a static argument instead (1.02-1.06):

    instruments = gl.training_instruments("economy", every=10)
    step = jax.jit(train_step, static_argnames="phase")  # passes phase to update
    for i, batch in enumerate(batches):
      params, state, readings = step(params, state, batch, phase=instruments.phase(i))

Cockpit's three configurations are the presets (instruments Cockpit has and we do
not, its histograms, TIC, CABS and early stopping, are left out):

* `"economy"`: loss, grad_norm, norm_test, inner_product_test, orthogonality_test,
  alpha, update_size, distance;
* `"business"`: economy and hessian_trace;
* `"full"`: business, hessian_max_eigenvalue and mean_gsnr.

A tuple of instrument names picks any set.

Sharp edges:
  * `alpha` at step t is that of the previous step's update (it needs the loss and
    gradient after it): NaN at the first step.
  * `grad_norm` and the alpha slopes use `grads` (every parameter); the tests and
    the GSNR use the marked layers of `records` only.
  * The curvature instruments need `hessian_loss`, the batch loss as a function of
    the parameters alone (see `hessian_trace`).
  * With `every=k`, alpha at a read step is that of the update made one step before
    it (its start is kept at the step before each read step).
  * A static `phase` is trusted: pass `instruments.phase(i)` for the i-th call of
    `update` (the state's step count is traced and cannot be checked against it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.analyses import _hessian, _instruments, _step_quality

ECONOMY = ("loss", "grad_norm", "norm_test", "inner_product_test", "orthogonality_test",
           "alpha", "update_size", "distance")
PRESETS = {
    "economy": ECONOMY,
    "business": ECONOMY + ("hessian_trace",),
    "full": ECONOMY + ("hessian_trace", "hessian_max_eigenvalue", "mean_gsnr"),
}
_TESTS = ("norm_test", "inner_product_test", "orthogonality_test")
_CURVATURE = ("hessian_trace", "hessian_max_eigenvalue")
# What a step does under `every`: read the instruments, start the next read step's
# alpha (keep this step's loss, slope and update), or neither.
_PHASES = ("read", "start", "skip")


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
    previous_update, previous_loss, previous_slope: the last step's update, loss and
      `<grads, update>` (for `alpha`).
    curvature: the last curvature readings, by name.
    key: the PRNG key for the curvature instruments.
  """

  step: jax.Array
  initial: Any
  previous_update: Any
  previous_loss: jax.Array | None
  previous_slope: jax.Array | None
  curvature: dict[str, jax.Array]
  key: jax.Array | None


class InstrumentsTransform(NamedTuple):
  """Pure functions, as an optax `GradientTransformation` is (see
  `training_instruments`): `init`, `update`, and `phase`, the schedule of `every`
  for a Python int step."""

  init: Any
  update: Any
  phase: Any


def _instrument_names(preset) -> tuple[str, ...]:
  known = PRESETS["full"]
  if isinstance(preset, str):
    if preset not in PRESETS:
      raise ValueError(f"training_instruments(preset={preset!r}): the presets are "
                       f"{sorted(PRESETS)}; or pass a tuple of instruments from {known}.")
    return PRESETS[preset]
  names = tuple(preset)
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise ValueError(f"training_instruments(preset={preset!r}): {unknown or 'nothing'} "
                     f"is not an instrument; pick from {known}.")
  return names


def training_instruments(
    preset: str | Sequence[str] = "economy",
    *,
    reduction: str = "mean",
    curvature_every: int = 10,
    num_products: int = 20,
    every: int = 1,
    names: Sequence[str] | None = None,
    tied: Collection[str] = (),
) -> InstrumentsTransform:
  """Returns `init`/`update` functions that read Cockpit's instruments each step.

  Args:
    preset: `"economy"`, `"business"`, `"full"` or a tuple of instrument names
      (see the module docstring).
    reduction: `"mean"` or `"sum"`: how the loss combines the per-example losses.
    curvature_every: measure the curvature instruments every this many steps.
    num_products: Hessian-vector products per curvature instrument and use.
    every: read the other instruments on steps 0, k, 2k, ... only (Cockpit's
      `track_interval`); the steps between read NaN and skip their work. By default
      `update` follows the state's step count with `lax.cond` (fine inside a
      `lax.scan`); from a Python training loop pass `phase=instruments.phase(step)`
      as a static argument of the jitted step instead, so that each phase compiles
      once and the steps between carry no `lax.cond` (measured in a 10-step scan on
      JAX 0.10.2, CPU: 1.17x plain with the conds, 1.02x with static phases).
    names, tied: the layer records to use, as for `per_example_norms`.

  Returns:
    An `InstrumentsTransform`. `init(params, key=None)` gives the state;
    `update(state, records, *, loss, grads, params, updates, hessian_loss=None,
    phase=None)` returns `(readings, state)`, `readings` a dict of scalars by
    instrument name. `params` are those the gradient was taken at, `updates` what
    the optimizer adds to them. `phase(step)` says what a Python int step does under
    `every`: `"read"`, `"start"` (the step before a read step keeps what alpha
    needs) or `"skip"`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc") ** 2)
    >>> w, x = jnp.ones((1, 1)), jnp.array([[1.0], [3.0]])
    >>> instruments = gl.training_instruments("economy")
    >>> state = instruments.init(w)
    >>> for _ in range(2):
    ...   (value, grads), records = gl.call_and_reap(jax.value_and_grad(loss))(w, x)
    ...   readings, state = instruments.update(state, records, loss=value, grads=grads,
    ...                                        params=w, updates=-0.05 * grads)
    ...   w = w - 0.05 * grads
    >>> round(float(readings["alpha"]), 4)  # f(w) = 5 w^2: step 0.5 / 1 of the way
    -0.5
  """
  instruments = _instrument_names(preset)
  for arg, value in (("curvature_every", curvature_every), ("every", every)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"training_instruments({arg}={value!r}): give a positive integer.")
  curvature = [n for n in instruments if n in _CURVATURE]
  wants_alpha, wants_distance = "alpha" in instruments, "distance" in instruments

  def init(params, key=None):
    zero = lambda: jnp.zeros((), jnp.float32)  # One buffer each: states get donated.
    if curvature and key is None:
      key = jax.random.PRNGKey(0)
    return InstrumentsState(
        step=jnp.zeros((), jnp.int32),
        # A copy: the step may donate `params`, which must not delete `initial`.
        initial=jax.tree.map(jnp.copy, params) if wants_distance else None,
        previous_update=(jax.tree.map(jnp.zeros_like, params) if wants_alpha else None),
        previous_loss=zero() if wants_alpha else None,
        previous_slope=zero() if wants_alpha else None,
        curvature={n: jnp.full((), jnp.nan, jnp.float32) for n in curvature},
        key=key if curvature else None)

  def measure_curvature(hessian_loss, params, key):
    fns = {"hessian_trace": _hessian.hessian_trace,
           "hessian_max_eigenvalue": _hessian.hessian_max_eigenvalue}
    keys = jax.random.split(key, len(curvature))
    return {n: fns[n](hessian_loss, params, key=k, num_products=num_products)
            .astype(jnp.float32) for n, k in zip(curvature, keys)}

  per_step = [n for n in instruments if n not in _CURVATURE]

  def read(state, records, loss, grads, params, updates, start: bool):
    """The per-step instruments' readings by name, and `<grads, updates>` if `start`
    (alpha's next start) else `None`."""
    readings = {}
    if "loss" in instruments:
      readings["loss"] = loss
    if any(n in instruments for n in _TESTS):
      tests = _instruments.batch_size_tests(records, reduction=reduction, names=names,
                                            tied=tied)
      readings.update({n: getattr(tests, n) for n in _TESTS if n in instruments})
    if "mean_gsnr" in instruments:
      readings["mean_gsnr"] = _instruments.gradient_snr(
          records, reduction=reduction, names=names, tied=tied).mean
    pairs = {}
    if "grad_norm" in instruments:
      pairs["grad_norm"] = (grads, grads)
    if "update_size" in instruments:
      pairs["update_size"] = (updates, updates)
    if wants_distance:
      moved = jax.tree.map(jnp.subtract, params, state.initial)
      pairs["distance"] = (moved, moved)
    if wants_alpha:
      pairs["slope_1"] = (grads, state.previous_update)
    if start:
      pairs["slope_0"] = (grads, updates)
    sums = {}
    if pairs:
      sums = _step_quality.inner_products(pairs)
      readings.update({n: jnp.sqrt(sums[n]) for n in ("grad_norm", "update_size", "distance")
                       if n in sums})
    if wants_alpha:
      alpha = _step_quality.step_alpha(state.previous_loss, state.previous_slope, loss,
                                       sums["slope_1"])
      readings["alpha"] = jnp.where(state.step > 0, alpha, jnp.nan)
    return {n: jnp.asarray(readings[n], jnp.float32) for n in per_step}, sums.get("slope_0")

  def phase(step: int) -> str:
    """What step `step` (a Python int) does under `every`: "read", "start" or "skip"."""
    if step % every == 0:
      return "read"
    return "start" if wants_alpha and (step + 1) % every == 0 else "skip"

  def when(condition, fn, otherwise):
    """`fn()` or `otherwise()`: chosen in Python for a bool, by `lax.cond` if traced."""
    if isinstance(condition, bool):
      return fn() if condition else otherwise()
    return lax.cond(condition, fn, otherwise)

  def update(state: InstrumentsState, records, *, loss, grads, params, updates,
             hessian_loss: Callable[[Any], jax.Array] | None = None,
             phase: str | None = None):
    if curvature and hessian_loss is None:
      raise ValueError(
          f"training_instruments.update: the instruments {curvature} need "
          "hessian_loss, the batch loss as a function of the parameters, e.g. "
          "hessian_loss=lambda p: loss(p, x, y).")
    if phase is None and every == 1:
      reads = starts = True
    elif phase is None:  # The schedule from the traced step count.
      reads, starts = state.step % every == 0, (state.step + 1) % every == 0
    elif phase in _PHASES:
      reads, starts = phase == "read", phase == "start" or (phase == "read" and every == 1)
    else:
      raise ValueError(
          f"training_instruments.update(phase={phase!r}): give None (the schedule from "
          f"the state's step count) or one of {_PHASES}, as `instruments.phase(step)` "
          "returns for a Python int step.")
    args = (state, records, loss, grads, params, updates)
    start = lambda: (jnp.asarray(loss, jnp.float32),
                     _step_quality.inner_products({"s": (grads, updates)})["s"], updates)
    keep = lambda: (state.previous_loss, state.previous_slope, state.previous_update)
    if reads is True and starts is True:  # Read, and start the next alpha in one pass.
      readings, slope_0 = read(*args, start=wants_alpha)
      begun = (jnp.asarray(loss, jnp.float32), slope_0, updates) if wants_alpha else None
    else:
      nan = {n: jnp.full((), jnp.nan, jnp.float32) for n in per_step}
      readings = when(reads, lambda: read(*args, start=False)[0], lambda: nan)
      begun = when(starts, start, keep) if wants_alpha else None
    previous = {}
    if wants_alpha:  # `inner_products` sums in float32, as the state holds it.
      previous = dict(zip(("previous_loss", "previous_slope", "previous_update"), begun))
    measured, key = state.curvature, state.key
    if curvature:
      key, use = jax.random.split(state.key)
      measured = lax.cond(state.step % curvature_every == 0,
                          lambda: measure_curvature(hessian_loss, params, use),
                          lambda: state.curvature)
      readings.update(measured)
    readings = {n: readings[n] for n in instruments}
    return readings, dataclasses.replace(state, step=state.step + 1, curvature=measured,
                                         key=key, **previous)

  return InstrumentsTransform(init, update, phase)
