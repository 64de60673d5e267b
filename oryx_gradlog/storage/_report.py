"""The report: PNG plots and an HTML page of every numeric series of a run.

`report(run_dir)` reads what `RunLog` stored and writes, into `run_dir/report/`:

* `norms.png`: the L2 norm of every summarized record over steps, log scale, one
  line per record (and per call, when a leading `call` dim was named);
* `<record>.histogram.png`: a heat map of the magnitude histogram over steps;
* `per_example.png`: per-example norm quantiles (5/25/50/75/95 %) over steps, for
  records whose summaries kept an `example` dim;
* `nonfinite.png`: counts of NaN/inf entries over steps;
  (these four from the summaries: variable groups with `norm`, `histogram`,
  `nonfinite`, ... leaves, as `summarize` makes them);
* `series_N.png`: every other numeric variable, one panel each: a scalar series
  (loss, learning rate, a gradient norm) as a line over steps, an array as
  quantile bands over its rows (its `example` dim, else its first dim; other dims
  reduced to their L2 norm: a full record becomes per-example norms), 12 panels
  to an image;
* `index.html`: all of the above, a table of the summaries' last step and of each
  scalar series' last finite value;
* `dashboard.html` and `instruments.png`, when the run logged training instruments
  (`gl.training_instruments` readings appended under `"instruments"`): laid out as
  Cockpit's dashboard (step size, gradients and curvature columns, the loss and
  step time below, then Cockpit's second screen), per-parameter readings beside
  the global ones, the last read step's gradient histograms, and the last readings.

`python -m oryx_gradlog report RUN_DIR` (or the console script `oryx-gradlog`) runs it.

Sharp edges:
  * Leading dims of summaries other than `call` and `example` are averaged (norm)
    or summed (histogram, non-finite counts) in the plots.
  * Arrays are read a block of steps at a time, but each is read in full: a run
    with large full records takes a while to report.
  * Image files are named like the store's arrays (a `/` in a name is `%2F`), and
    the page links them URL-quoted.
  * Instruments are the variables named `instruments.NAME`; NaN readings (alpha at
    the first step, curvature before its first use, the steps between readings of
    `training_instruments(every=k)`) are left out of the lines, and the dashboard's
    table shows each instrument's last finite reading; the histograms are those of
    the last step that read them. NaN in a scalar series is left out of its line too.
"""

from __future__ import annotations

import html
import os
import warnings
from collections.abc import Iterable
from urllib.parse import quote

import numpy as np

from oryx_gradlog.storage._store import _require, open_run, store_name

_STATS = ("norm", "mean", "variance", "min", "max", "nonfinite")
INSTRUMENTS = "instruments."
PER_PARAMETER = "per_parameter."
# Cockpit's dashboard: three columns (step size, gradients, curvature) of three
# instruments each, then the hyperparameter and performance row, then the
# instruments of Cockpit's second screen. Each panel: (title, instruments, log scale,
# reference line); a histogram panel names its variable.
_COLUMNS = (
    ("Step size", (("Alpha", ("alpha",), False, 0.0),
                   ("Distance and update size", ("distance", "update_size"), True, None),
                   ("Gradient norm", ("grad_norm",), True, None))),
    ("Gradients", (("Gradient tests", ("norm_test", "inner_product_test",
                                       "orthogonality_test"), True, 1.0),
                   ("Gradient elements", ("grad_hist_1d",), False, None),
                   ("Gradient elements vs parameters", ("grad_hist_2d",), False, None))),
    ("Curvature", (("Hessian max eigenvalue", ("hessian_max_eigenvalue",), True, None),
                   ("Hessian trace", ("hessian_trace",), True, None),
                   ("TIC", ("tic_diag", "tic_trace"), True, None))),
)
_BOTTOM = (("Time per step (s)", ("time",), True, None),
           ("Performance: loss", ("loss",), True, None),
           ("Mean GSNR", ("mean_gsnr",), True, None),
           ("CABS batch size", ("cabs",), True, None),
           ("Early stopping (stop above 0)", ("early_stopping",), False, 0.0))
_HISTOGRAMS = ("grad_hist_1d", "grad_hist_2d")


def summary_groups(names: Iterable[str]) -> list[str]:
  """Returns the prefixes `P` for which the run has `P.norm` and `P.histogram`."""
  names = set(names)
  return sorted(name[: -len(".norm")] for name in names
                if name.endswith(".norm") and name[: -len(".norm")] + ".histogram" in names)


def _record_name(group: str) -> str:
  return group.split(".summary", 1)[0]


def _reduce(array, keep: Iterable[str], how: str):
  """Reduces an xarray DataArray over all dims but `keep`."""
  other = [d for d in array.dims if d not in keep]
  return getattr(array, how)(dim=other) if other else array


def report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
           *, progress: bool = True) -> str:
  """Writes the plots and `index.html` of a run; returns the path of the HTML page.

  Args:
    run_dir: a run folder written by `RunLog`.
    out_dir: where to write (default `run_dir/report`).
    progress: show a progress bar while reading.

  Returns:
    The path of `index.html` (of `dashboard.html` for a run that logged only
    instruments).

  Raises:
    ValueError: the run has no numeric variable to plot, or no committed step.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, oryx_gradlog as gl
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   for step in range(3):
    ...     log.append(step, {"loss": jnp.float32(1.0 / (step + 1))})
    >>> os.path.relpath(gl.report(run_dir, progress=False), run_dir)
    'report/index.html'
  """
  matplotlib = _require("matplotlib", "report")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  tqdm = _require("tqdm", "report").tqdm

  dataset = open_run(run_dir)
  out_dir = os.fspath(out_dir or os.path.join(os.fspath(run_dir), "report"))
  os.makedirs(out_dir, exist_ok=True)
  groups = summary_groups(dataset.data_vars)
  dashboard = dashboard_page(dataset, run_dir, out_dir, plt)
  series = series_names(dataset)
  if not groups and not series and dashboard:
    return dashboard
  if not groups and not series:
    raise ValueError(
        f"report({os.fspath(run_dir)!r}): the run has no numeric variable to plot (its "
        f"variables: {sorted(map(str, dataset.data_vars))}). Log arrays or numbers with "
        "RunLog.append, e.g. log.append(step, {'loss': loss}).")
  images, table = [], ""
  if groups:
    images, table = summary_images(dataset, groups, out_dir, plt, tqdm, progress)
  series_images_, series_table = series_images(dataset, series, out_dir, plt)
  steps = dataset["step"].values
  page = os.path.join(out_dir, "index.html")
  config = html.escape(str(dataset.attrs.get("config", {})))
  records = sorted({_record_name(g) for g in groups})
  with open(page, "w", encoding="utf-8") as f:
    f.write(
        "<!doctype html><html><head><meta charset='utf-8'><title>oryx_gradlog report</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        "td,th{padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>"
        "</head><body>"
        f"<h1>Run report: {html.escape(os.fspath(run_dir))}</h1>"
        f"<p>{len(steps)} steps ({steps[0]} to {steps[-1]}); records summarized: "
        f"{html.escape(', '.join(records) or 'none')}; other series: {len(series)}.</p>"
        f"<p>config: {config}</p>" +
        ("<p><a href='dashboard.html'>Training instruments dashboard</a></p>"
         if dashboard else "") + table + series_table +
        "".join(f"<h2>{html.escape(name)}</h2><img src='{html.escape(quote(name))}' "
                f"alt='{html.escape(name)}' width='100%'>"
                for name in images + series_images_) +
        "</body></html>")
  return page


def summary_images(dataset, groups, out_dir, plt, tqdm, progress) -> tuple[list[str], str]:
  """Plots the summaries (norms, histograms, per-example norms, non-finite counts);
  returns the image names and the HTML table of the last step."""
  steps = dataset["step"].values
  edges = np.asarray(dataset.attrs.get("magnitude_bins", []), dtype=np.float64)
  data = {}
  for group in tqdm(groups, desc="reading summaries", disable=not progress):
    data[group] = {stat: dataset[f"{group}.{stat}"].load()
                   for stat in (*_STATS, "histogram") if f"{group}.{stat}" in dataset}

  images = []

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for group in groups:
    norm = _reduce(data[group]["norm"], ("step", "call"), "mean")
    if "call" in norm.dims:
      for call in range(norm.sizes["call"]):
        ax.plot(steps, norm.isel(call=call).values, label=f"{_record_name(group)} call {call}")
    else:
      ax.plot(steps, norm.values, label=_record_name(group))
  ax.set(yscale="log", xlabel="step", ylabel="L2 norm (mean over examples, if any)",
         title="Gradient norm per record")
  ax.legend(fontsize="small")
  images.append(_save(fig, out_dir, "norms.png", plt))

  for group in groups:
    hist = _reduce(data[group]["histogram"], ("step", "magnitude_bin"), "sum")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    counts = np.log10(1 + hist.transpose("magnitude_bin", "step").values)
    mesh = ax.imshow(counts, aspect="auto", origin="lower", interpolation="nearest",
                     extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, counts.shape[0] - 0.5))
    ticks = np.arange(1, counts.shape[0], 4)
    ax.set_yticks(ticks - 0.5, [f"{edges[t - 1]:.0e}" for t in ticks])
    ax.set(xlabel="step", ylabel="|cotangent| (bin lower edge)",
           title=f"{_record_name(group)}: histogram of |cotangent| over steps")
    fig.colorbar(mesh, ax=ax, label="log10(1 + count)")
    images.append(_save(fig, out_dir, f"{group}.histogram.png", plt))

  per_example = [g for g in groups if "example" in data[g]["norm"].dims]
  if per_example:
    fig, axes = plt.subplots(len(per_example), 1, figsize=(8, 2.8 * len(per_example)),
                             squeeze=False)
    for ax, group in zip(axes[:, 0], per_example):
      norm = _reduce(data[group]["norm"], ("step", "example"), "mean")
      _band(ax, steps, norm.transpose("step", "example").values)
      ax.set(yscale="log", ylabel="per-example norm", title=_record_name(group))
    axes[-1, 0].set_xlabel("step")
    images.append(_save(fig, out_dir, "per_example.png", plt))

  fig, ax = plt.subplots(figsize=(8, 3.5))
  for group in groups:
    ax.plot(steps, _reduce(data[group]["nonfinite"], ("step",), "sum").values,
            label=_record_name(group))
  ax.set(xlabel="step", ylabel="NaN/inf entries", title="Non-finite cotangent entries")
  ax.legend(fontsize="small")
  images.append(_save(fig, out_dir, "nonfinite.png", plt))

  rows = []
  for group in groups:
    last = {stat: float(_reduce(data[group][stat].isel(step=-1), (),
                                "sum" if stat == "nonfinite" else "mean"))
            for stat in _STATS if stat in data[group]}
    rows.append("<tr><td>" + html.escape(group) + "</td>" +
                "".join(f"<td>{last.get(stat, float('nan')):.4g}</td>" for stat in _STATS) +
                "</tr>")
  table = (f"<h2>Last step ({steps[-1]})</h2><table><tr><th>summary</th>" +
           "".join(f"<th>{stat}</th>" for stat in _STATS) + "</tr>" + "".join(rows) +
           "</table>")
  return images, table


def series_names(dataset) -> list[str]:
  """The numeric variables that are neither summaries nor instruments: a run's own
  series (loss, learning rate, full records, per-example norms, ...)."""
  summarized = {f"{group}.{stat}" for group in summary_groups(dataset.data_vars)
                for stat in (*_STATS, "histogram")}
  names = [str(name) for name in dataset.data_vars
           if name not in summarized and not str(name).startswith(INSTRUMENTS)
           and dataset[name].dtype.kind in "biuf" and dataset[name].dims[:1] == ("step",)
           and dataset[name].size]
  return sorted(names, key=lambda name: (dataset[name].ndim > 1, name))  # Scalars first.


def series_values(array, max_entries: int = 2**24) -> tuple[np.ndarray, str]:
  """Per step, a scalar series' values `(steps,)`, or the rows of an array `(steps,
  rows)`: its `example` axis (else its first axis) with any other axes reduced to
  their L2 norm; and a label that says which. Reads `max_entries` at a time."""
  dims = [d for d in array.dims if d != "step"]
  if not dims:
    return np.asarray(array.values, np.float64), array.name
  rows = "example" if "example" in dims else dims[0]
  rest = [d for d in dims if d != rows]
  block = max(1, max_entries // max(1, array[{"step": 0}].size))
  parts = []
  for start in range(0, array.sizes["step"], block):
    part = array.isel(step=slice(start, start + block)).astype(np.float64)
    parts.append((part if not rest else np.sqrt((part ** 2).sum(rest, skipna=False)))
                 .transpose("step", rows).values)
  label = f"{array.name} over {rows}" + (f" (L2 norm over {', '.join(rest)})" if rest else "")
  return np.concatenate(parts), label


def series_images(dataset, names: list[str], out_dir: str, plt,
                  per_figure: int = 12) -> tuple[list[str], str]:
  """Plots each series in a panel (a line, or 5-95 % and 25-75 % bands and the median
  over rows), `per_figure` panels per image; returns the image names and the HTML
  table of each scalar series' last finite value."""
  steps = np.asarray(dataset["step"].values)
  images, last = [], {}
  for first in range(0, len(names), per_figure):
    chunk = names[first:first + per_figure]
    columns = min(3, len(chunk))
    rows = -(-len(chunk) // columns)
    fig, axes = plt.subplots(rows, columns, squeeze=False,
                             figsize=(4 * columns, 2.8 * rows))
    for ax, name in zip(axes.ravel(), chunk):
      values, label = series_values(dataset[name])
      if values.ndim == 1:
        last[name] = _last_reading(values)
        read = np.isfinite(values)
        ax.plot(steps[read], values[read], marker="." if np.sum(read) < 20 else None)
        shown = values[read]
        if shown.size and np.all(shown > 0) and shown.max() > 100 * shown.min():
          ax.set_yscale("log")  # Spans more than two decades.
      else:
        _band(ax, steps, values)
      ax.set_title(label, fontsize="small")
      ax.set_xlabel("step")
    for ax in axes.ravel()[len(chunk):]:
      ax.axis("off")
    images.append(_save(fig, out_dir, f"series_{first // per_figure + 1}.png", plt))
  table = ("<h2>Series, last values</h2><table><tr><th>series</th><th>value</th></tr>" +
           "".join(f"<tr><td>{html.escape(n)}</td><td>{v:.4g}</td></tr>"
                   for n, v in last.items()) + "</table>") if last else ""
  return images, table


def _band(ax, steps, values) -> None:
  """Quantiles over the rows of `values` `(steps, rows)`: 5-95 %, 25-75 %, median."""
  with np.errstate(all="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # An all-NaN step: no band there.
    q = np.nanpercentile(values, [5, 25, 50, 75, 95], axis=1)
  ax.fill_between(steps, q[0], q[4], alpha=0.2, label="5-95 %")
  ax.fill_between(steps, q[1], q[3], alpha=0.4, label="25-75 %")
  ax.plot(steps, q[2], label="median")
  ax.legend(fontsize="small")


def dashboard_page(dataset, run_dir, out_dir: str, plt) -> str | None:
  """Writes `instruments.png` and `dashboard.html` if the run logged instruments.

  The figure is laid out as Cockpit's: step size, gradients and curvature in three
  columns, the loss and step time below, then Cockpit's second screen (GSNR, CABS,
  early stopping) and any other instrument. Per-parameter readings
  (`instruments.per_parameter.NAME.*`) are thin lines beside their global reading.

  Returns:
    The path of `dashboard.html`, or `None` when the run has no `instruments.*`.
  """
  names = [n[len(INSTRUMENTS):] for n in dataset.data_vars if n.startswith(INSTRUMENTS)]
  if not names:
    return None
  steps = np.asarray(dataset["step"].values)
  value = lambda name: np.asarray(dataset[INSTRUMENTS + name].values, np.float64)
  scalars = {n: value(n).reshape(len(steps), -1).mean(axis=1) for n in names
             if not n.startswith(PER_PARAMETER) and n.split(".")[0] not in _HISTOGRAMS}
  if "time" in scalars:  # Cockpit's Time is the wall clock: draw its differences.
    scalars["time"] = np.concatenate([[np.nan], np.diff(scalars["time"])])
  per_parameter = {}
  for n in names:
    if n.startswith(PER_PARAMETER):
      instrument, _, leaf = n[len(PER_PARAMETER):].partition(".")
      per_parameter.setdefault(instrument, {})[leaf] = value(n).reshape(len(steps))
  logged = set(scalars) | {n.split(".")[0] for n in names}
  known = {i for _, panel in _COLUMNS for _, group, _, _ in panel for i in group}
  known |= {i for _, group, _, _ in _BOTTOM for i in group}
  other = [(n, (n,), False, None) for n in sorted(set(scalars) - known)]
  rows = [[panel for _, column in _COLUMNS for panel in column[r:r + 1]] for r in range(3)]
  rows += [list(_BOTTOM[:2]), list(_BOTTOM[2:])] + [other[k:k + 3] for k in range(0, len(other), 3)]
  rows = [[p for p in row if any(i in logged for i in p[1])] for row in rows]
  rows = [row for row in rows if row]
  fig, axes = plt.subplots(len(rows), 3, squeeze=False, figsize=(12, 3 * len(rows)))
  for r, row in enumerate(rows):
    for c in range(3):
      ax = axes[r, c]
      if c >= len(row):
        ax.axis("off")
        continue
      title, group, log, line = row[c]
      if group[0] in _HISTOGRAMS:
        _histogram_panel(ax, dataset, group[0], steps)
        ax.set_title(title)
        continue
      drawn = []
      for name in (i for i in group if i in scalars):
        values = scalars[name]
        read = np.isfinite(values)  # Untracked steps read NaN: join the rest.
        ax.plot(steps[read], values[read], marker="." if np.sum(read) < 20 else None,
                label=name)
        drawn.append(values[read])
        for leaf, leaf_values in sorted(per_parameter.get(name, {}).items()):
          ok = np.isfinite(leaf_values)
          ax.plot(steps[ok], leaf_values[ok], linewidth=0.6, alpha=0.5)
          drawn.append(leaf_values[ok])
      if line is not None:
        ax.axhline(line, color="grey", linestyle="--", linewidth=1)
      if log and drawn and all(np.all(v > 0) for v in drawn):
        ax.set_yscale("log")
      if len(group) > 1:
        ax.legend(fontsize="x-small")
      ax.set(title=title, xlabel="step")
  image = _save(fig, out_dir, "instruments.png", plt)
  last = {name: _last_reading(values) for name, values in scalars.items()}
  page = os.path.join(out_dir, "dashboard.html")
  with open(page, "w", encoding="utf-8") as f:
    f.write(
        "<!doctype html><html><head><meta charset='utf-8'><title>oryx_gradlog dashboard"
        "</title><style>body{font-family:sans-serif;max-width:80em;margin:auto}"
        "td,th{padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>"
        "</head><body>"
        f"<h1>Training instruments: {html.escape(os.fspath(run_dir))}</h1>"
        f"<p>{len(steps)} steps ({steps[0]} to {steps[-1]}), laid out as Cockpit's "
        "dashboard (step size, gradients, curvature). Batch-size tests below 1 "
        "(dashed) say the batch is large enough; alpha 0 is a step to the minimum of the "
        "local quadratic, -1 no progress, 1 an overshoot to the same loss; thin lines are "
        "per-parameter readings. <a href='index.html'>Gradient report</a></p>"
        "<h2>Last readings</h2><table><tr><th>instrument</th><th>value</th></tr>" +
        "".join(f"<tr><td>{html.escape(n)}</td><td>{v:.4g}</td></tr>"
                for n, v in sorted(last.items())) +
        f"</table><img src='{image}' width='100%'></body></html>")
  return page


def _histogram_panel(ax, dataset, name, steps) -> None:
  """The last read step's histogram (counts -1 on steps that read nothing)."""
  counts = np.asarray(dataset[f"{INSTRUMENTS}{name}.counts"].values, np.float64)
  read = [i for i in range(len(steps)) if np.all(counts[i] >= 0)]
  if not read:
    ax.axis("off")
    return
  last = counts[read[-1]]
  if name == "grad_hist_1d":
    edges = np.asarray(dataset[f"{INSTRUMENTS}{name}.edges"].values)[read[-1]]
    ax.stairs(last, edges, fill=True)
    ax.set(yscale="log" if np.any(last > 0) else "linear", xlabel="gradient element",
           ylabel=f"count (step {steps[read[-1]]})")
    return
  x = np.asarray(dataset[f"{INSTRUMENTS}{name}.x_edges"].values)[read[-1]]
  y = np.asarray(dataset[f"{INSTRUMENTS}{name}.y_edges"].values)[read[-1]]
  ax.pcolormesh(x, y, np.log10(1 + last.T), shading="flat")
  ax.set(xlabel="gradient element", ylabel=f"parameter (step {steps[read[-1]]})")


def _last_reading(values: np.ndarray) -> float:
  """The last finite value, NaN if there is none."""
  finite = values[np.isfinite(values)]
  return float(finite[-1]) if finite.size else float("nan")


def _save(fig, out_dir, name, plt) -> str:
  """Saves `fig` as `name` (percent-encoded as the store encodes names, so a record
  name with `/` stays one file); returns the file's name."""
  name = store_name(name)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=90)
  plt.close(fig)
  return name
