"""Export of a run's summaries to TensorBoard event files (scalars and histograms).

Sharp edges:
  * Scalars are the summaries' statistics averaged over their non-step dims (one
    series per call when a `call` dim was named); non-finite counts are summed.
  * Histograms are of magnitudes |x| in the run's bins; TensorBoard's own min, max
    and sum fields are estimated from the bins, the norm and the extremes.
"""

from __future__ import annotations

import os

import numpy as np

from oryx_gradlog.storage._report import _STATS, _reduce, summary_groups
from oryx_gradlog.storage._store import _require, open_run


def export_tensorboard(run_dir: str | os.PathLike, logdir: str | os.PathLike | None = None
                       ) -> str:
  """Writes a run's summaries as TensorBoard scalars and histograms; returns the logdir.

  Args:
    run_dir: a run folder written by `RunLog`.
    logdir: the TensorBoard log folder (default `run_dir/tensorboard`).

  Returns:
    The logdir, to pass to `tensorboard --logdir`.
  """
  tensorboardx = _require("tensorboardX", "export_tensorboard")
  dataset = open_run(run_dir)
  logdir = os.fspath(logdir or os.path.join(os.fspath(run_dir), "tensorboard"))
  edges = np.asarray(dataset.attrs.get("magnitude_bins"), dtype=np.float64)
  steps = dataset["step"].values
  with tensorboardx.SummaryWriter(logdir) as writer:
    for group in summary_groups(dataset.data_vars):
      series = {stat: dataset[f"{group}.{stat}"].load() for stat in (*_STATS, "histogram")}
      for stat in _STATS:
        values = _reduce(series[stat], ("step", "call"), "sum" if stat == "nonfinite" else "mean")
        calls = range(values.sizes["call"]) if "call" in values.dims else [None]
        for call in calls:
          line = values if call is None else values.isel(call=call)
          tag = f"{group}/{stat}" if call is None else f"{group}/call{call}/{stat}"
          for step, value in zip(steps, line.values):
            writer.add_scalar(tag, float(value), int(step))
      counts = _reduce(series["histogram"], ("step", "magnitude_bin"), "sum")
      norms = _reduce(series["norm"] ** 2, ("step",), "sum") ** 0.5
      extreme = np.maximum(np.abs(_reduce(series["min"], ("step",), "min")),
                           np.abs(_reduce(series["max"], ("step",), "max")))
      for i, step in enumerate(steps):
        bucket_counts = counts.isel(step=i).values.astype(np.float64)
        top = max(float(extreme[i]), edges[-1]) if np.isfinite(extreme[i]) else edges[-1]
        limits = np.concatenate([edges, [top * (1 + 1e-6) + 1e-12]])
        centres = np.concatenate([[edges[0] / 2], np.sqrt(edges[:-1] * edges[1:]), [top]])
        writer.add_histogram_raw(
            f"{group}/magnitude", min=0.0, max=float(top), num=int(bucket_counts.sum()),
            sum=float(bucket_counts @ centres), sum_squares=float(norms[i]) ** 2,
            bucket_limits=limits.tolist(), bucket_counts=bucket_counts.tolist(),
            global_step=int(step))
  return logdir
