"""oryx_gradlog: record what happens in JAX's backward pass, on the device.

Mark functions with `record_vjp` or values with `tap`, then reap the records from
any function that runs a backward pass through them:

    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> f = lambda x: jnp.sum(gl.tap(jnp.sin(x), name="y") ** 2)
    >>> gl.reap(jax.grad(f))(jnp.array([3.0]))
    {'y': Array([0.28224], dtype=float32)}

Sharp edges:
  * `import oryx_gradlog` is quick and imports neither JAX nor Oryx: the first use of
    a public name (`gl.reap`, `from oryx_gradlog import reap`) loads them and the
    whole API (so `python -m oryx_gradlog --help` answers at once). A JAX and Oryx
    pair that cannot work together raises its `ImportError`, with the install lines,
    at that first use.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Type checkers and IDEs see every public name.
  from oryx_gradlog._api import *  # noqa: F403  # pylint: disable=wildcard-import

__version__ = "0.1.0"

__all__ = (
    "BatchSizeTests",
    "ClippedGrads",
    "DEFAULT_TAG",
    "DPNoiseState",
    "GradientHistograms",
    "GradientNoise",
    "GradientSNR",
    "Influence",
    "InfluenceFactors",
    "InstrumentsState",
    "KFACFactors",
    "LayerCoverage",
    "LayerInputs",
    "LayerParams",
    "LayerUse",
    "Logged",
    "LossSpike",
    "MovingAverage",
    "NoiseScale",
    "NonFiniteReport",
    "ParamCoverage",
    "PerExampleNorms",
    "PoissonBatch",
    "ProjectedGrads",
    "Projector",
    "RunLog",
    "RunningStats",
    "Schedule",
    "Summary",
    "Transform",
    "UseCoverage",
    "VJPRecord",
    "adam_preconditioner",
    "add_dp_noise",
    "batch_size_tests",
    "call_and_reap",
    "clipped_grad",
    "conv2d",
    "dense",
    "dense_dot_general",
    "dp_epsilon",
    "dp_noise",
    "dp_noise_multiplier",
    "embed",
    "export_tensorboard",
    "find_nonfinite",
    "fit_influence",
    "fit_projector",
    "gradient_histograms",
    "gradient_noise_scale",
    "gradient_snr",
    "gradient_variance",
    "hessian_diagonal",
    "hessian_max_eigenvalue",
    "hessian_trace",
    "influence_from_run",
    "kfac_factors",
    "layer_coverage",
    "layer_norm",
    "lds",
    "linear_schedule",
    "logarithmic_schedule",
    "loss_spikes",
    "magnitude_bins",
    "moving_average",
    "open_run",
    "per_example_clip",
    "per_example_norms",
    "per_example_products",
    "per_example_self_products",
    "poisson_batch",
    "projected_grads",
    "raise_if_nonfinite",
    "reap",
    "record_layers",
    "record_vjp",
    "report",
    "running_statistics",
    "step_alpha",
    "sum_grad_squared",
    "summarize",
    "tap",
    "to_param_tree",
    "tracin",
    "tracin_self_influence",
    "training_instruments",
    "update_size",
)

# Names the package no longer has, with the name to use instead (not released: no
# deprecation period, an error that says what to write).
_RENAMED = {
    "clipped_grads": "per_example_clip (records in, the clipped gradient out; "
                     "gl.clipped_grad transforms a loss function, like jax.grad)",
    **dict.fromkeys(
        ("DPNoiseTransform", "InstrumentsTransform", "StatisticsTransform"),
        "Transform (one init/update type for every stateful transformation; update "
        "takes (inputs, state) in optax's order and returns (outputs, state))"),
}


def __getattr__(name: str):
  """Loads the whole public API on the first use of any of its names (or of a
  subpackage: `gl.analyses`, which the API's imports make attributes)."""
  if not name.startswith("_") and name not in _RENAMED:
    api = importlib.import_module("oryx_gradlog._api")
    globals().update((n, getattr(api, n)) for n in __all__)
    if name in globals():
      return globals()[name]
  if name in _RENAMED:
    raise AttributeError(f"oryx_gradlog.{name} was renamed: use gl.{_RENAMED[name]}.")
  raise AttributeError(f"module 'oryx_gradlog' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
