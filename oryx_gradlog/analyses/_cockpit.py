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
  """A pair of pure functions, as an optax `GradientTransformation` is."""

  init: Any
  update: Any


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
    names, tied: the layer records to use, as for `per_example_norms`.

  Returns:
    An `InstrumentsTransform`. `init(params, key=None)` gives the state;
    `update(state, records, *, loss, grads, params, updates, hessian_loss=None)`
    returns `(readings, state)`, `readings` a dict of scalars by instrument name.
    `params` are those the gradient was taken at, `updates` what the optimizer
    adds to them.

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
  if not isinstance(curvature_every, int) or curvature_every < 1:
    raise ValueError(f"training_instruments(curvature_every={curvature_every!r}): give a "
                     "positive integer.")
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

  def update(state: InstrumentsState, records, *, loss, grads, params, updates,
             hessian_loss: Callable[[Any], jax.Array] | None = None):
    readings = {}
    if "loss" in instruments:
      readings["loss"] = loss
    if "grad_norm" in instruments:
      readings["grad_norm"] = _step_quality.update_size(grads)
    if any(n in instruments for n in _TESTS):
      tests = _instruments.batch_size_tests(records, reduction=reduction, names=names,
                                            tied=tied)
      readings.update({n: getattr(tests, n) for n in _TESTS if n in instruments})
    if "mean_gsnr" in instruments:
      readings["mean_gsnr"] = _instruments.gradient_snr(
          records, reduction=reduction, names=names, tied=tied).mean
    previous = {}
    if wants_alpha:
      slope_1 = _step_quality.directional_derivative(grads, state.previous_update)
      alpha = _step_quality.step_alpha(state.previous_loss, state.previous_slope, loss,
                                       slope_1)
      readings["alpha"] = jnp.where(state.step > 0, alpha, jnp.nan)
      previous = {"previous_update": updates, "previous_loss": jnp.asarray(loss, jnp.float32),
                  "previous_slope": _step_quality.directional_derivative(grads, updates)}
    if "update_size" in instruments:
      readings["update_size"] = _step_quality.update_size(updates)
    if wants_distance:
      readings["distance"] = _step_quality.update_size(
          jax.tree.map(jnp.subtract, params, state.initial))
    measured, key = state.curvature, state.key
    if curvature:
      if hessian_loss is None:
        raise ValueError(
            f"training_instruments.update: the instruments {curvature} need "
            "hessian_loss, the batch loss as a function of the parameters, e.g. "
            "hessian_loss=lambda p: loss(p, x, y).")
      key, use = jax.random.split(state.key)
      measured = lax.cond(state.step % curvature_every == 0,
                          lambda: measure_curvature(hessian_loss, params, use),
                          lambda: state.curvature)
      readings.update(measured)
    readings = {n: jnp.asarray(readings[n], jnp.float32) for n in instruments}
    return readings, dataclasses.replace(state, step=state.step + 1, curvature=measured,
                                         key=key, **previous)

  return InstrumentsTransform(init, update)
