"""Export of a run to TensorBoard event files: every numeric series, as scalars or histograms.

`export_tensorboard(run_dir)` writes, with tensorboardX, into `run_dir/tensorboard`:

* summaries (`summarize` output): each statistic as a scalar `GROUP/STAT`, and the
  magnitude histogram as `GROUP/magnitude`;
* instruments (`instruments.NAME`) and every other numeric series of the run
  (loss, learning rate, per-example norms, full records), under the name it was
  logged with: a scalar series as a scalar, an array as a histogram of its entries
  at each step.

`python -m oryx_gradlog tensorboard RUN_DIR` runs it; `tensorboard --logdir
RUN_DIR/tensorboard` (the `tensorboard` package) shows it.

Sharp edges:
  * Summary scalars are the statistics averaged over their non-step dims (one
    series per call when a `call` dim was named); non-finite counts are summed.
  * Summary histograms are of magnitudes |x| in the run's bins; TensorBoard's own
    min, max and sum fields are estimated from the bins, the norm and the extremes.
  * NaN instrument readings (steps an instrument was not read) are left out; NaN
    in other scalar series is written as NaN. Histograms of arrays are of their
    finite entries; a step with none is left out.
  * A histogram instrument (`grad_hist_1d`: counts and edges) becomes a TensorBoard
    histogram at the steps that read it. TensorBoard has no 2-D histogram:
    `grad_hist_2d` is in the dashboard (and the store) only.
  * A run with nothing numeric to export is a `ValueError`, not an empty file.
  * One event file per run: an export replaces the file an earlier export wrote
    (named `events.out.tfevents.*.oryx_gradlog`) once the new one is written, and
    leaves other event files in `logdir` alone.
  * Tags are the run's names as they are: tensorboardX's `SummaryWriter` would
    replace characters such as `%`, `\\` and spaces, so summaries go through its
    `FileWriter` with the tags kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from oryx_gradlog.storage._report import _STATS, INSTRUMENTS, _reduce, series_names, summary_groups
from oryx_gradlog.storage._store import _require, open_run, run_folder

# The suffix of the event files we write: a re-export replaces ours, and only ours.
_SUFFIX = ".oryx_gradlog"


def export_tensorboard(run_dir: str | os.PathLike, logdir: str | os.PathLike | None = None
                       ) -> str:
  """Writes every numeric series of a run as TensorBoard scalars and histograms.

  Args:
    run_dir: a run folder written by `RunLog`.
    logdir: the TensorBoard log folder (default `run_dir/tensorboard`).

  Returns:
    The logdir, to pass to `tensorboard --logdir`.

  Raises:
    ValueError: the run has no numeric variable to export, or no committed step.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, oryx_gradlog as gl
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   log.append(0, {"loss": jnp.float32(2.0)})
    >>> os.path.relpath(gl.export_tensorboard(run_dir), run_dir)
    'tensorboard'
  """
  tensorboardx = _require("tensorboardX", "export_tensorboard")
  run_dir = run_folder(run_dir, "export_tensorboard")
  dataset = open_run(run_dir)
  groups = summary_groups(dataset.data_vars)
  instruments = sorted(str(name) for name in dataset.data_vars
                       if str(name).startswith(INSTRUMENTS))
  series = series_names(dataset)
  if not (groups or instruments or series):
    raise ValueError(
        f"export_tensorboard({os.fspath(run_dir)!r}): the run has no numeric variable to "
        f"export (its variables: {sorted(map(str, dataset.data_vars))}). Log arrays or "
        "numbers with RunLog.append, e.g. log.append(step, {'loss': loss}).")
  logdir = os.fspath(logdir or os.path.join(os.fspath(run_dir), "tensorboard"))
  steps = dataset["step"].values
  histograms = [name[:-len(".counts")] for name in instruments
                if name.endswith(".counts") and name[:-len(".counts")] + ".edges" in dataset]
  parts = {f"{h}.{part}" for h in histograms for part in ("counts", "edges")}
  # Written aside, then moved in: an export that fails leaves the earlier one whole.
  os.makedirs(logdir, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".export-", dir=logdir)
  try:
    writer = _Writer(tensorboardx, staging)
    try:
      for group in groups:
        _write_summary(writer, dataset, group, steps)
      for name in histograms:
        _write_counts(writer, dataset, name, steps)
      for name in instruments + series:
        if name not in parts and not _is_2d_histogram(dataset, name):
          _write_series(writer, dataset[name], steps, skip_nan=name in instruments)
    finally:
      writer.close()
    (written,) = os.listdir(staging)
    for name in os.listdir(logdir):  # TensorBoard would show an earlier export's too.
      if name.startswith("events.out.tfevents.") and name.endswith(_SUFFIX):
        os.remove(os.path.join(logdir, name))
    os.replace(os.path.join(staging, written), os.path.join(logdir, written))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return logdir


class _Writer:
  """Writes tensorboardX summaries under the tags given: tensorboardX's
  `SummaryWriter` would replace characters outside `[-/\\w.]` and a leading `/`
  (rules of TensorFlow's old op names, which TensorBoard does not need)."""

  def __init__(self, tensorboardx, logdir: str):
    self._summary = tensorboardx.summary
    self._file = tensorboardx.FileWriter(logdir, filename_suffix=_SUFFIX)

  def _add(self, summary, tag: str, step: int) -> None:
    for value in summary.value:
      value.tag = tag
    self._file.add_summary(summary, int(step))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._add(self._summary.scalar(tag, float(value)), tag, step)

  def add_histogram(self, tag: str, values: np.ndarray, step: int) -> None:
    self._add(self._summary.histogram(tag, values, "auto"), tag, step)

  def add_histogram_raw(self, tag: str, *, global_step: int, **fields) -> None:
    self._add(self._summary.histogram_raw(tag, **fields), tag, global_step)

  def close(self) -> None:
    self._file.close()


def _write_summary(writer, dataset, group, steps) -> None:
  """A summary group: its statistics as scalars, its histogram as a histogram."""
  edges = np.asarray(dataset.attrs.get("magnitude_bins"), dtype=np.float64)
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


def _is_2d_histogram(dataset, name: str) -> bool:
  """Whether `name` is part of a 2-D histogram instrument (counts and x/y edges)."""
  base = name.rsplit(".", 1)[0]
  return f"{base}.x_edges" in dataset and name.split(".")[-1] in ("counts", "x_edges", "y_edges")


def _write_counts(writer, dataset, name, steps) -> None:
  """A histogram instrument (`NAME.counts` in the bins `NAME.edges`) as TensorBoard
  histograms, at the steps that read it (counts of -1 elsewhere)."""
  counts = np.asarray(dataset[f"{name}.counts"].values, np.float64)
  edges = np.asarray(dataset[f"{name}.edges"].values, np.float64)
  for step, count, edge in zip(steps, counts, edges):
    if np.all(count >= 0):
      centres = (edge[:-1] + edge[1:]) / 2
      writer.add_histogram_raw(
          name, min=float(edge[0]), max=float(edge[-1]), num=int(count.sum()),
          sum=float(count @ centres), sum_squares=float(count @ centres**2),
          bucket_limits=edge[1:].tolist(), bucket_counts=count.tolist(), global_step=int(step))


def _write_series(writer, array, steps, *, skip_nan: bool, max_entries: int = 2**24) -> None:
  """A scalar series as scalars; an array as a histogram of its entries per step,
  read `max_entries` at a time."""
  if array.ndim == 1:
    for step, value in zip(steps, np.asarray(array.values, np.float64)):
      if not (skip_nan and np.isnan(value)):
        writer.add_scalar(array.name, float(value), int(step))
    return
  block = max(1, max_entries // max(1, array[{"step": 0}].size))
  for start in range(0, len(steps), block):
    values = np.asarray(array.isel(step=slice(start, start + block)).values, np.float64)
    for step, entries in zip(steps[start:start + block], values):
      entries = entries[np.isfinite(entries)]
      if entries.size:
        writer.add_histogram(array.name, entries, int(step))
