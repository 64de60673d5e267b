"""oryx_gradlog: record what happens in JAX's backward pass, on the device.

Mark functions with `record_vjp` or values with `tap`, then reap the records from
any function that runs a backward pass through them:

    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> f = lambda x: jnp.sum(gl.tap(jnp.sin(x), name="y") ** 2)
    >>> gl.reap(jax.grad(f))(jnp.array([3.0]))
    {'y': Array([0.28224], dtype=float32)}
"""

from oryx_gradlog.record import _compat

_compat.check_supported()

from oryx_gradlog.record import _oryx_rules  # noqa: F401  (installs Oryx rules)
from oryx_gradlog.analyses.per_example._accounting import (
    dp_epsilon,
    dp_noise_multiplier,
)
from oryx_gradlog.analyses.per_example._clip import (
    ClippedGrads,
    clipped_grad,
    per_example_clip,
    to_param_tree,
)
from oryx_gradlog.analyses.per_example._coverage import (
    LayerCoverage,
    ParamCoverage,
    UseCoverage,
    layer_coverage,
)
from oryx_gradlog.analyses.instruments._cockpit import (
    InstrumentsState,
    InstrumentsTransform,
    Schedule,
    linear_schedule,
    logarithmic_schedule,
    training_instruments,
)
from oryx_gradlog.analyses.attribution._lds import lds
from oryx_gradlog.analyses.attribution._influence import (
    Influence,
    InfluenceFactors,
    fit_influence,
)
from oryx_gradlog.analyses.curvature._curvature import (
    KFACFactors,
    gradient_variance,
    kfac_factors,
    sum_grad_squared,
)
from oryx_gradlog.analyses.per_example._ghost import (
    PerExampleNorms,
    per_example_norms,
)
from oryx_gradlog.analyses.curvature._hessian import (
    hessian_diagonal,
    hessian_max_eigenvalue,
    hessian_trace,
)
from oryx_gradlog.analyses.instruments._histograms import (
    GradientHistograms,
    gradient_histograms,
)
from oryx_gradlog.analyses.instruments._instruments import (
    BatchSizeTests,
    GradientSNR,
    batch_size_tests,
    gradient_snr,
)
from oryx_gradlog.analyses.instruments._step_quality import (
    step_alpha,
    update_size,
)
from oryx_gradlog.record._layers import (
    LayerInputs,
    conv2d,
    dense,
    dense_dot_general,
    embed,
    layer_norm,
)
from oryx_gradlog.statistics._moving_average import (
    MovingAverage,
    moving_average,
)
from oryx_gradlog.analyses.debugging._nan import (
    NonFiniteReport,
    find_nonfinite,
    raise_if_nonfinite,
)
from oryx_gradlog.analyses.instruments._noise import (
    GradientNoise,
    NoiseScale,
    gradient_noise_scale,
)
from oryx_gradlog.analyses.per_example._privacy import (
    DPNoiseState,
    DPNoiseTransform,
    PoissonBatch,
    add_dp_noise,
    dp_noise,
    poisson_batch,
)
from oryx_gradlog.record._canonical import LayerParams
from oryx_gradlog.record._reap import (
    call_and_reap,
    reap,
)
from oryx_gradlog.record.record_layers import (
    LayerUse,
    record_layers,
)
from oryx_gradlog.record._record import (
    VJPRecord,
    record_vjp,
    tap,
)
from oryx_gradlog.storage._report import report
from oryx_gradlog.statistics._running import (
    RunningStats,
    StatisticsTransform,
    running_statistics,
)
from oryx_gradlog.record._sites import DEFAULT_TAG
from oryx_gradlog.storage._store import (
    RunLog,
    open_run,
)
from oryx_gradlog.statistics._summaries import (
    Logged,
    Summary,
    magnitude_bins,
    summarize,
)
from oryx_gradlog.storage._tensorboard import export_tensorboard

__version__ = "0.1.0"

__all__ = (
    "BatchSizeTests",
    "ClippedGrads",
    "DEFAULT_TAG",
    "DPNoiseState",
    "DPNoiseTransform",
    "GradientHistograms",
    "GradientNoise",
    "GradientSNR",
    "Influence",
    "InfluenceFactors",
    "InstrumentsState",
    "InstrumentsTransform",
    "KFACFactors",
    "LayerCoverage",
    "LayerInputs",
    "LayerParams",
    "LayerUse",
    "Logged",
    "MovingAverage",
    "NoiseScale",
    "NonFiniteReport",
    "ParamCoverage",
    "PerExampleNorms",
    "PoissonBatch",
    "RunLog",
    "RunningStats",
    "Schedule",
    "StatisticsTransform",
    "Summary",
    "UseCoverage",
    "VJPRecord",
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
    "gradient_histograms",
    "gradient_noise_scale",
    "gradient_snr",
    "gradient_variance",
    "hessian_diagonal",
    "hessian_max_eigenvalue",
    "hessian_trace",
    "kfac_factors",
    "layer_coverage",
    "layer_norm",
    "lds",
    "linear_schedule",
    "logarithmic_schedule",
    "magnitude_bins",
    "moving_average",
    "open_run",
    "per_example_clip",
    "per_example_norms",
    "poisson_batch",
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
    "training_instruments",
    "update_size",
)

# Names the package no longer has, with the name to use instead (not released: no
# deprecation period, an error that says what to write).
_RENAMED = {
    "clipped_grads": "per_example_clip (records in, the clipped gradient out; "
                     "gl.clipped_grad transforms a loss function, like jax.grad)",
}


def __getattr__(name: str):
  if name in _RENAMED:
    raise AttributeError(f"oryx_gradlog.{name} was renamed: use gl.{_RENAMED[name]}.")
  raise AttributeError(f"module 'oryx_gradlog' has no attribute {name!r}")
