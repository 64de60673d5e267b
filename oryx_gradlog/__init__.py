"""oryx_gradlog: record what happens in JAX's backward pass, on the device.

Mark functions with `record_vjp` or values with `tap`, then reap the records from
any function that runs a backward pass through them:

    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> f = lambda x: jnp.sum(gl.tap(jnp.sin(x), name="y") ** 2)
    >>> gl.reap(jax.grad(f))(jnp.array([3.0]))
    {'y': Array([0.28224], dtype=float32)}
"""

from oryx_gradlog import _compat

_compat.check_versions()

from oryx_gradlog import _oryx_rules  # noqa: F401  (installs Oryx rules)
from oryx_gradlog._reap import (
    call_and_reap,
    reap,
)
from oryx_gradlog._record import (
    VJPRecord,
    record_vjp,
    tap,
)
from oryx_gradlog._report import report
from oryx_gradlog._running import (
    RunningStats,
    StatisticsTransform,
    running_statistics,
)
from oryx_gradlog._sites import DEFAULT_TAG
from oryx_gradlog._tensorboard import export_tensorboard
from oryx_gradlog._store import (
    RunLog,
    open_run,
)
from oryx_gradlog._summaries import (
    Logged,
    Summary,
    magnitude_bins,
    summarize,
)

__version__ = "0.1.0"

__all__ = (
    "DEFAULT_TAG",
    "Logged",
    "RunLog",
    "RunningStats",
    "StatisticsTransform",
    "Summary",
    "VJPRecord",
    "call_and_reap",
    "export_tensorboard",
    "magnitude_bins",
    "open_run",
    "reap",
    "report",
    "record_vjp",
    "running_statistics",
    "summarize",
    "tap",
)
