"""The public API's imports, loaded on first use by `oryx_gradlog.__getattr__`.

Importing this module imports JAX and Oryx: `record/_internals.py` checks first that
the installed pair works together (an `ImportError` with the install lines if not),
and `record/_reap.py` installs our Oryx reap rules. Internal: `oryx_gradlog` is the
public namespace, and its `__all__` the list of names.
"""

# pylint: disable=unused-import
from oryx_gradlog._base import Transform
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
    training_instruments,
)
from oryx_gradlog.analyses.instruments._schedule import (
    Schedule,
    linear_schedule,
    logarithmic_schedule,
)
from oryx_gradlog.analyses.attribution._lds import lds
from oryx_gradlog.analyses.attribution._projection import (
    ProjectedGrads,
    Projector,
    fit_projector,
    projected_grads,
)
from oryx_gradlog.analyses.attribution._from_run import (
    LossSpike,
    influence_from_run,
    loss_spikes,
    tracin,
    tracin_self_influence,
)
from oryx_gradlog.analyses.attribution._factors import InfluenceFactors
from oryx_gradlog.analyses.attribution._optimizers import adam_preconditioner
from oryx_gradlog.analyses.attribution._influence import Influence, fit_influence
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
from oryx_gradlog.analyses.per_example._products import (
    per_example_products,
    per_example_self_products,
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
