"""The report: an HTML page of a run, read top to bottom, with a PNG for each figure.

`report(run_dir)` reads what `RunLog` stored and writes, into `run_dir/report/`,
`index.html`: what the run is (steps, records, config), a table of contents, then
one section per figure, each under a heading that says what it shows and names the
series it holds, with a line on how to read it and the figure (alt text naming the
series; a click opens the PNG at full size). In the order of the page:

* `scalar.NAME.png`: each loss (a scalar series with "loss" in its name; without
  one, the training instruments' loss), full width, first;
* `scalars_N.png`: the other scalar series (learning rate, accuracy, ...), six
  panels to an image, then a table of each scalar series' last finite value;
* `norms.png`: the L2 norm of each summarized record's cotangent over steps (one
  line per record, and per call when a leading `call` dim was named);
* `<record>.histogram.png`: a heat map of the record's cotangent magnitude
  histogram over steps, its y range fitted to the bins that have counts;
* `per_example.png`: per-example cotangent norm quantiles (5/25/50/75/95 %) over
  steps, for records whose summaries kept an `example` dim;
* `nonfinite.png`: counts of NaN/inf cotangent entries over steps (when there is
  one; else a sentence says there is none), and a table of the summaries at the
  last step;
  (these four from the summaries: variable groups with `norm`, `histogram`,
  `nonfinite`, ... leaves, as `summarize` makes them);
* `arrays_N.png`: every other numeric array, one panel each, as quantile bands
  over its rows (its `example` dim, else its first dim; other dims reduced to their
  L2 norm: a full record becomes per-example norms), six panels to an image;
* `attribution.html` and `attribution.png`, when the run logged projected
  per-example gradients with example ids (`gl.projected_grads`, see
  `_attribution_page.py`): loss spikes and the examples behind them, the highest
  TracIn self-influence, each query's most helpful and harmful examples;
* `dashboard.html` and `instruments.png`, when the run logged training instruments
  (`gl.training_instruments` readings appended under `"instruments"`): the loss
  first, full width, then Cockpit's columns (step size, gradients, curvature) row by
  row, then the step time and Cockpit's second screen (GSNR, CABS, early stopping)
  and any other instrument, each row filling the page's width; per-parameter
  readings as thin lines (one colour per parameter, named in the legend) beside the
  global ones; the last read step's gradient histograms; a table of the last readings.

Every panel has a y label, integer step ticks and a legend where it draws more than
one line. The pages fit a phone's width (390 px) and a desktop's: each figure is
drawn twice, `NAME.png` for a desktop and `NAME.phone.png` (one panel to a row,
larger text) that the page shows on screens up to 700 px wide.

`python -m oryx_gradlog report RUN_DIR` (or the console script `oryx-gradlog`) runs it.

Sharp edges:
  * Series that are equal at every step are drawn once and named together, in the
    legend, heading and alt text (a `record_layers` kernel and its bias share the
    layer's output cotangent, so their summaries are equal). Equality is checked on
    the host, of the whole series read back (NaN equal to NaN), per figure.
  * A panel where a few readings (1 % of them at either end, at least one) lie so
    far from the rest that they would squeeze it into a quarter of its height shows
    the rest, and says in its title how many readings are above or below its range
    (alpha's ~125 among readings of -1 to 1). Panels of fewer than 10 readings are
    never clipped so. Log scales are for positive readings spanning a decade or
    more (two decades for the run's own scalar series); judged in decades there.
  * NaN readings (a key logged at some steps only, alpha at the first step, the
    steps between readings of `training_instruments(every=k)`) are left out of the
    lines, which join the steps that were read; series of 50 readings or fewer are
    drawn with markers, so that a single reading shows. Tables show each series'
    last finite reading; the histograms are those of the last step that read them.
  * Leading dims of summaries other than `call` and `example` are averaged (norm)
    or summed (histogram, non-finite counts) in the plots.
  * Arrays are read a block of steps at a time, but each is read in full: a run
    with large full records takes a while to report.
  * Image files are named like the store's arrays (a `/` in a name is `%2F`), and
    the page links them URL-quoted. Files of an earlier report in the same folder
    that this one does not write again (a figure of a series since removed) stay.
  * Instruments are the variables named `instruments.NAME`.
"""

from __future__ import annotations

import functools
import html
import math
import os
import re
import textwrap
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple
from urllib.parse import quote

import numpy as np

from oryx_gradlog.storage import _attribution_page
from oryx_gradlog.storage._store import _require, open_run, run_folder, store_name

_STATS = ("norm", "mean", "variance", "min", "max", "nonfinite")
INSTRUMENTS = "instruments."
PER_PARAMETER = "per_parameter."
# Each figure is drawn twice: for a desktop (_WIDTH inches at _DPI, about the page's
# text width) and, one panel to a row, for a phone (_PHONE_WIDTH at _PHONE_DPI: text
# about as large as the page's at 390 px); the page serves the one that fits.
_WIDTH, _DPI = 11.0, 100
_DASHBOARD_WIDTH = 14.0
_PHONE_WIDTH, _PHONE_DPI = 4.6, 170
_PHONE_PAGE = "(max-width: 700px)"
_PER_IMAGE = 6  # Panels to an image of scalars or arrays.
_FEW = 50  # Lines of this many readings or fewer have markers.


class _Panel(NamedTuple):
  """A dashboard panel: its title, the instruments it draws (a histogram panel names
  its variable), its y label, a log y axis, and a dashed reference line."""

  title: str
  instruments: tuple[str, ...]
  ylabel: str
  log: bool = False
  line: float | None = None


_LOSS = _Panel("Loss", ("loss",), "loss", log=True)
# Cockpit's dashboard: three columns (step size, gradients, curvature) of three
# instruments each, drawn row by row under the loss, then the step time and the
# instruments of Cockpit's second screen.
_COLUMNS = (
    ("Step size", (
        _Panel("Alpha", ("alpha",), "alpha (0: to the minimum)", line=0.0),
        _Panel("Distance and update size", ("distance", "update_size"), "L2 norm", log=True),
        _Panel("Gradient norm", ("grad_norm",), "L2 norm", log=True))),
    ("Gradients", (
        _Panel("Gradient tests (below 1: batch large enough)",
               ("norm_test", "inner_product_test", "orthogonality_test"), "test value",
               log=True, line=1.0),
        _Panel("Gradient elements", ("grad_hist_1d",), "count"),
        _Panel("Gradient elements vs parameters", ("grad_hist_2d",), "parameter"))),
    ("Curvature", (
        _Panel("Hessian max eigenvalue", ("hessian_max_eigenvalue",), "eigenvalue", log=True),
        _Panel("Hessian trace", ("hessian_trace",), "trace", log=True),
        _Panel("TIC", ("tic_diag", "tic_trace"), "TIC", log=True))),
)
_BOTTOM = (_Panel("Time per step", ("time",), "seconds", log=True),
           _Panel("Mean GSNR", ("mean_gsnr",), "GSNR", log=True),
           _Panel("CABS batch size", ("cabs",), "batch size", log=True),
           _Panel("Early stopping (stop above 0)", ("early_stopping",), "criterion", line=0.0))
_HISTOGRAMS = ("grad_hist_1d", "grad_hist_2d")

_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1400px;margin:0 auto;padding:0 12px;"
    "line-height:1.4;color:#222}"
    "h1{font-size:1.5em;overflow-wrap:anywhere}"
    "h2{font-size:1.2em;margin:1.8em 0 .3em;overflow-wrap:anywhere}"
    "section p{margin:.2em 0 .6em;max-width:60em}"
    "img{display:block;max-width:100%;height:auto}"
    "code{overflow-wrap:anywhere}nav li{overflow-wrap:anywhere}"
    ".table{overflow-x:auto}table{border-collapse:collapse}"
    "td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #ddd}"
    "td:first-child,th:first-child{text-align:left;overflow-wrap:anywhere}")


class Section(NamedTuple):
  """A part of a page: a key for its anchor, its heading and its HTML body."""

  key: str
  heading: str
  body: str


def summary_groups(names: Iterable[str]) -> list[str]:
  """Returns the prefixes `P` for which the run has `P.norm` and `P.histogram`."""
  names = set(names)
  return sorted(name[: -len(".norm")] for name in names
                if name.endswith(".norm") and name[: -len(".norm")] + ".histogram" in names)


def _record_name(group: str) -> str:
  return group.split(".summary", 1)[0]


def _label(group: str) -> str:
  """A summary group's name in legends: its record, and the leaf when a record has
  several (`dense[1]`); a layer record's output cotangent is the record's name."""
  record, _, leaf = group.partition(".summary")
  leaf = leaf.lstrip(".")
  return record if leaf in ("", "out_cotangent") else f"{record}[{leaf}]"


def _reduce(array, keep: Iterable[str], how: str):
  """Reduces an xarray DataArray over all dims but `keep`."""
  other = [d for d in array.dims if d not in keep]
  return getattr(array, how)(dim=other) if other else array


def report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
           *, progress: bool = True) -> str:
  """Writes the figures and `index.html` of a run; returns the path of the HTML page.

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

  run_dir = run_folder(run_dir, "report")  # A run folder, or its log.zarr.
  dataset = open_run(run_dir)
  out_dir = os.fspath(out_dir or os.path.join(run_dir, "report"))
  os.makedirs(out_dir, exist_ok=True)
  groups = summary_groups(dataset.data_vars)
  series = series_names(dataset)
  attribution = _attribution_page.attribution_page(dataset, out_dir, plt)
  if attribution:  # Projected gradients and ids are that page's, not panels of their own.
    series = [n for n in series
              if n != "ids" and not n.startswith(("train.grads.", "query.grads."))]
  dashboard = dashboard_page(dataset, run_dir, out_dir, plt,
                             report_link=bool(groups or series))
  if not groups and not series and dashboard:
    return dashboard
  if not groups and not series:
    raise ValueError(
        f"report({os.fspath(run_dir)!r}): the run has no numeric variable to plot (its "
        f"variables: {sorted(map(str, dataset.data_vars))}). Log arrays or numbers with "
        "RunLog.append, e.g. log.append(step, {'loss': loss}).")
  steps = np.asarray(dataset["step"].values)
  scalars, arrays = {}, {}
  for name in series:
    values, label = series_values(dataset[name])
    (scalars if values.ndim == 1 else arrays)[name] = (values, label)
  # A record logged whole beside its per-example summaries: its rows' norms are the
  # per-example norm panel's, so it gets no panel of its own.
  per_example = {_record_name(g) for g in _per_example_groups(dataset, groups)}
  whole = sorted(n for n in arrays if n.endswith(".full") and n[:-5] in per_example)
  arrays = {n: v for n, v in arrays.items() if n not in whole}
  sections, plotted = scalar_sections(dataset, {n: v for n, (v, _) in scalars.items()},
                                      out_dir, plt)
  if groups:
    sections += summary_sections(dataset, groups, out_dir, plt, tqdm, progress)
  sections += array_sections(steps, arrays, out_dir, plt)
  records = sorted({_record_name(g) for g in groups})
  config = html.escape(str(dataset.attrs.get("config", {})))
  intro = (
      f"<p>{len(steps)} steps ({steps[0]} to {steps[-1]}); records summarized: "
      f"{html.escape(', '.join(records) or 'none')}; scalar series: "
      f"{html.escape(_listing(plotted) or 'none')}; other arrays: "
      f"{html.escape(_listing(arrays) or 'none')}" +
      (f" ({html.escape(_listing(whole))}, logged whole, are shown by their per-example "
       "norms)" if whole else "") +
      f".</p><p>config: <code>{config}</code></p>" +
      ("<p><a href='dashboard.html'>Training instruments dashboard</a></p>"
       if dashboard else "") +
      ("<p><a href='attribution.html'>Training-data attribution: loss spikes, "
       "self-influence, queries</a></p>" if attribution else ""))
  page = os.path.join(out_dir, "index.html")
  with open(page, "w", encoding="utf-8") as f:
    f.write(page_html("oryx_gradlog report", f"Run report: {os.fspath(run_dir)}", intro, sections))
  return page


# The page.


def page_html(title: str, heading: str, intro: str, sections: Sequence[Section]) -> str:
  """A page: its heading, `intro` (HTML), a table of contents, then the sections."""
  anchors = _anchors([s.key for s in sections])
  toc = "".join(f"<li><a href='#{a}'>{html.escape(s.heading)}</a></li>"
                for a, s in zip(anchors, sections))
  return (
      "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
      "<meta name='viewport' content='width=device-width,initial-scale=1'>"
      f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
      f"<h1>{html.escape(heading)}</h1>{intro}"
      f"<nav><h2 id='contents'>Contents</h2><ol>{toc}</ol></nav>" +
      "".join(f"<section id='{a}'><h2>{html.escape(s.heading)}</h2>{s.body}</section>"
              for a, s in zip(anchors, sections)) +
      "</body></html>")


def _anchors(keys: Sequence[str]) -> list[str]:
  """Unique HTML ids made of `keys` (letters, digits, `-`, `_` and `.`)."""
  anchors, seen = [], {"contents"}
  for key in keys:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", key).strip("-.") or "section"
    anchor, n = base, 1
    while anchor in seen:
      n += 1
      anchor = f"{base}-{n}"
    seen.add(anchor)
    anchors.append(anchor)
  return anchors


def figure_section(key: str, heading: str, image: str, alt: str, description: str) -> Section:
  """A figure's section: its description, then the image (its drawing for a phone on
  narrow screens), which links to the desktop drawing at full size."""
  src, phone = html.escape(quote(image)), html.escape(quote(_phone_image(image)))
  return Section(key, heading, (
      f"<p>{html.escape(description)}</p><a href='{src}'><picture>"
      f"<source media='{_PHONE_PAGE}' srcset='{phone}'>"
      f"<img src='{src}' alt='{html.escape(alt)}'></picture></a>"))


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
  return ("<div class='table'><table><tr>" +
          "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" +
          "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                  for row in rows) + "</table></div>")


def _listing(names: Sequence[str], limit: int = 8) -> str:
  """`names` joined by commas, the ones past `limit` counted."""
  names = list(names)
  if len(names) <= limit:
    return ", ".join(names)
  return f"{', '.join(names[:limit])} and {len(names) - limit} more"


# The scalar series: losses first, full width; the others six to an image.


def _is_loss(name: str) -> bool:
  return "loss" in name.lower()


def scalar_sections(dataset, scalars: dict[str, np.ndarray], out_dir: str, plt
                    ) -> tuple[list[Section], list[str]]:
  """The sections of the scalar series, and the names of the series they plot: each
  loss in a figure of its own (the instruments' loss when the run's own series have
  none), the others six to a figure, then a table of the last finite values."""
  steps = np.asarray(dataset["step"].values)
  losses = [n for n in scalars if _is_loss(n)]
  shown = {n: scalars[n] for n in losses}
  loss = INSTRUMENTS + "loss"
  if not losses and loss in dataset and dataset[loss].dims == ("step",):
    shown[loss] = np.asarray(dataset[loss].values, np.float64)
  sections = []
  for name, values in shown.items():
    image = save_figure(functools.partial(_scalar_figure, plt, steps, [(name, values)]), out_dir,
                  f"scalar.{name}.png", plt)
    sections.append(figure_section(
        f"scalar-{name}", f"Loss: {name}", image, f"Line plot of {name} over steps",
        _reading_note(name, values, steps) +
        (" Read by the training instruments (see the dashboard)."
         if name.startswith(INSTRUMENTS) else "")))
  others = [n for n in scalars if n not in shown]
  for first in range(0, len(others), _PER_IMAGE):
    chunk = others[first:first + _PER_IMAGE]
    image = save_figure(functools.partial(_scalar_figure, plt, steps, [(n, scalars[n]) for n in chunk]),
                  out_dir, f"scalars_{first // _PER_IMAGE + 1}.png", plt)
    sparse = [n for n in chunk if not np.all(np.isfinite(scalars[n]))]
    sections.append(figure_section(
        "scalars-" + "-".join(chunk[:3]), f"Scalar series: {_listing(chunk)}", image,
        f"Line plots over steps, one panel each: {', '.join(chunk)}",
        "One panel per series, over steps." +
        (f" {_listing(sparse)} {'was' if len(sparse) == 1 else 'were'} not logged at every "
         "step: the lines join the steps that were." if sparse else "")))
  if scalars:
    rows = []
    for name, values in scalars.items():
      read = np.flatnonzero(np.isfinite(values))
      rows.append((name, f"{_last_reading(values):.4g}",
                   str(steps[read[-1]]) if read.size else "never"))
    sections.append(Section("last-values", "Scalar series: last values",
                             _table(("series", "last value", "at step"), rows)))
  return sections, list(shown) + others


def _reading_note(name: str, values: np.ndarray, steps: np.ndarray) -> str:
  read = np.flatnonzero(np.isfinite(values))
  if not read.size:
    return f"{name} has no finite reading."
  when = (f"at every step ({len(steps)})" if read.size == len(steps) else
          f"at {read.size} of the {len(steps)} steps (the line joins them)")
  return (f"{name} over steps, read {when}; last reading {values[read[-1]]:.4g} at step "
          f"{steps[read[-1]]}.")


def _scalar_figure(plt, steps: np.ndarray, named: Sequence[tuple[str, np.ndarray]], *,
                   phone: bool = False):
  """A figure of scalar series, one panel each (two columns when there are several,
  but on a `phone`); a series spanning more than two decades gets a log scale."""
  fig, axes = _panels(plt, len(named), phone, height=3.6 if len(named) == 1 else 2.8)
  for ax, (name, values) in zip(axes.ravel(), named):
    drawn = _line(ax, steps, values)
    wide = drawn.size and np.all(drawn > 0) and drawn.max() > 100 * drawn.min()
    _y_axis(ax, [drawn], log=bool(wide), label=name.rsplit("/", 1)[-1], title=name)
    step_axis(ax)
  for ax in axes.ravel()[len(named):]:
    ax.axis("off")
  return fig


# The summaries: cotangent norms, histograms, per-example norms, non-finite counts.


def _per_example_groups(dataset, groups) -> list[str]:
  """The summary groups logged per example (their norms have an `example` axis): the
  per-example norm panel's, and the records whose whole `*.full` it stands for."""
  return [g for g in groups if "example" in dataset[f"{g}.norm"].dims]


def summary_sections(dataset, groups, out_dir, plt, tqdm, progress) -> list[Section]:
  """The sections of the summaries: cotangent norms, one histogram per distinct
  record, per-example norms, non-finite counts, and the table of the last step."""
  steps = np.asarray(dataset["step"].values)
  edges = np.asarray(dataset.attrs.get("magnitude_bins", []), dtype=np.float64)
  data = {}
  for group in tqdm(groups, desc="reading summaries", disable=not progress):
    data[group] = {stat: dataset[f"{group}.{stat}"].load()
                   for stat in (*_STATS, "histogram") if f"{group}.{stat}" in dataset}
  sections = []

  lines = []
  for group in groups:
    norm = _reduce(data[group]["norm"], ("step", "call"), "mean")
    if "call" in norm.dims:
      lines += [(f"{_label(group)} call {call}", norm.isel(call=call).values)
                for call in range(norm.sizes["call"])]
    else:
      lines.append((_label(group), norm.values))
  lines = _distinct(lines)
  over = " (mean over examples)" if any("example" in data[g]["norm"].dims for g in groups) else ""
  names = [_equal(n) for n, _ in lines]
  image = save_figure(functools.partial(_lines_figure, plt, steps, lines,
                                  ylabel=f"cotangent L2 norm{over}",
                                  title="Cotangent norm per record"), out_dir, "norms.png", plt)
  sections.append(figure_section(
      "norms", f"Cotangent norms per record: {_listing(names)}", image,
      f"Line plot of the cotangent L2 norm over steps of {', '.join(names)}",
      "The L2 norm, per step, of the cotangent each record saw: the gradient of the loss "
      "with respect to the recorded output, not a parameter's gradient" +
      (", averaged over examples" if over else "") + "; a log scale when they span a decade "
      "or more." + _shared_note(lines)))

  histograms = _distinct([
      (_label(g), _reduce(data[g]["histogram"], ("step", "magnitude_bin"), "sum")
       .transpose("step", "magnitude_bin").values) for g in groups])
  first_group = {_label(g): g for g in groups}
  for names_, counts in histograms:
    rows = _histogram_rows(counts)
    low, high = _bin_edge(edges, rows.start), _bin_edge(edges, rows.stop)
    image = save_figure(functools.partial(_histogram_figure, plt, steps, counts, edges,
                                    title=_equal(names_)),
                  out_dir, f"{first_group[names_[0]]}.histogram.png", plt)
    sections.append(figure_section(
        f"histogram-{names_[0]}", f"Cotangent magnitude histogram: {_equal(names_)}", image,
        f"Heat map of the cotangent magnitude histogram over steps of {_equal(names_)}",
        f"How many entries of the cotangent had each magnitude |cotangent|, per step "
        f"(colour: log10(1 + count)); the y axis shows the bins that had entries, from "
        f"{low} to {high}." + _shared_note([(names_, None)])))

  per_example = _distinct([
      (_label(g), _reduce(data[g]["norm"], ("step", "example"), "mean")
       .transpose("step", "example").values)
      for g in _per_example_groups(dataset, groups)])
  if per_example:
    image = save_figure(functools.partial(_bands_figure, plt, steps,
                                    [(_equal(n), v) for n, v in per_example],
                                    ylabel="per-example norm", log=True),
                  out_dir, "per_example.png", plt)
    names = [_equal(n) for n, _ in per_example]
    sections.append(figure_section(
        "per-example", f"Per-example cotangent norms: {_listing(names)}", image,
        f"Quantile bands over examples of the per-example cotangent norm of {', '.join(names)}",
        "Per step, the quantiles over the batch's examples of each example's cotangent "
        "norm: 5-95 % and 25-75 % bands and the median; a log scale when they span a "
        "decade or more." +
        _shared_note(per_example)))

  counts = _distinct([(_label(g), _reduce(data[g]["nonfinite"], ("step",), "sum").values)
                      for g in groups])
  names = [_equal(n) for n, _ in counts]
  if all(np.nansum(c) == 0 for _, c in counts):  # A flat line at 0 says no more than this.
    records = [label for labels, _ in counts for label in labels]
    sections.append(Section(
        "nonfinite", f"Non-finite cotangent entries: none in {_listing(records)}",
        "<p>No record's cotangent had a NaN or inf entry at any step.</p>"))
  else:
    image = save_figure(functools.partial(_lines_figure, plt, steps, counts, log=False,
                                    ylabel="NaN/inf entries", title="Non-finite cotangent entries",
                                    height=3.0), out_dir, "nonfinite.png", plt)
    sections.append(figure_section(
        "nonfinite", f"Non-finite cotangent entries: {_listing(names)}", image,
        f"Line plot of the count of NaN and inf cotangent entries over steps of "
        f"{', '.join(names)}",
        "The number of NaN and inf entries in each record's cotangent, per step; "
        "gl.find_nonfinite names the layer where the first one entered." +
        _shared_note(counts)))

  rows = []
  for group in groups:
    last = {stat: float(_reduce(data[group][stat].isel(step=-1), (),
                                "sum" if stat == "nonfinite" else "mean"))
            for stat in _STATS if stat in data[group]}
    rows.append((group, *(f"{last.get(stat, float('nan')):.4g}" for stat in _STATS)))
  sections.append(Section("last-step", f"Summaries at the last step ({steps[-1]})",
                           _table(("summary", *_STATS), rows)))
  return sections


def _shared_note(groups: Sequence[tuple[Sequence[str], object]]) -> str:
  if not any(len(names) > 1 for names, _ in groups):
    return ""
  return (" Series equal at every step are drawn once and named together (a layer's "
          "kernel and bias, for one, share its output cotangent).")


def _equal(names: Sequence[str]) -> str:
  """The names of series drawn as one: `kernel = bias`."""
  return " = ".join(names)


def _distinct(named: Iterable[tuple[str, np.ndarray]]) -> list[tuple[list[str], np.ndarray]]:
  """Groups `(name, values)` pairs whose values are equal at every entry (NaN equal to
  NaN), in order of first appearance: `[(names, values)]`."""
  groups: list[tuple[list[str], np.ndarray]] = []
  for name, values in named:
    values = np.asarray(values)
    for names, first in groups:
      if first.shape == values.shape and np.array_equal(
          first.astype(np.float64), values.astype(np.float64), equal_nan=True):
        names.append(name)
        break
    else:
      groups.append(([name], values))
  return groups


def _lines_figure(plt, steps, lines, *, ylabel: str, title: str, log: bool = True,
                  height: float = 4.0, phone: bool = False):
  """One full-width panel of lines `[(names, values)]`, each labelled with its names,
  the legend below the panel."""
  fig, axes = _panels(plt, 1, phone, height=height)
  ax = axes[0, 0]
  drawn = [_line(ax, steps, values, label=_equal(names)) for names, values in lines]
  _y_axis(ax, drawn, log=log, label=ylabel, title=title)
  step_axis(ax)
  _legend(ax)
  return fig


def _histogram_rows(counts: np.ndarray) -> slice:
  """The bins (last axis of `counts`) from the first to the last that has a count at
  some step; all of them when none has."""
  filled = np.flatnonzero(np.any(np.asarray(counts) > 0, axis=tuple(range(counts.ndim - 1))))
  return slice(int(filled[0]), int(filled[-1]) + 1) if filled.size else slice(0, counts.shape[-1])


def _bin_edge(edges: np.ndarray, boundary: int) -> str:
  """The magnitude at the lower boundary of bin `boundary`: bin 0 starts at 0 and the
  last (`len(edges)`) ends at infinity."""
  if not edges.size:
    return f"bin {boundary}"
  if boundary == 0:
    return "0"
  return f"{edges[boundary - 1]:.2g}" if boundary <= edges.size else "inf"


def _bin_tick(edges: np.ndarray, boundary: int) -> str:
  """`_bin_edge` as a tick label of one format: a power of two (as the default edges
  are) as `2^-8`, another edge as `3.9e-03`."""
  if not 0 < boundary <= edges.size:
    return _bin_edge(edges, boundary)
  edge = edges[boundary - 1]
  if edge > 0 and np.log2(edge) == round(np.log2(edge)):
    return f"$2^{{{int(np.log2(edge))}}}$"
  return f"{edge:.1e}"


def _histogram_figure(plt, steps, counts: np.ndarray, edges: np.ndarray, title: str, *,
                      phone: bool = False):
  """A heat map of `counts` `(steps, bins)`, its y range fitted to the filled bins."""
  rows = _histogram_rows(counts)
  fig, axes = _panels(plt, 1, phone, height=3.6)
  ax = axes[0, 0]
  y = np.arange(rows.start, rows.stop + 1)
  mesh = ax.pcolormesh(_step_edges(steps), y,
                       np.log10(1 + np.asarray(counts, np.float64)[:, rows].T), shading="flat")
  ticks = y[::max(1, -(-len(y) // 8))]
  ax.set_yticks(ticks, [_bin_tick(edges, int(t)) for t in ticks])
  ax.set_ylabel("|cotangent| (bin's lower edge)")
  _title(ax, f"{title}: |cotangent| histogram")
  step_axis(ax)
  fig.colorbar(mesh, ax=ax, label="log10(1 + count)")
  return fig


def _step_edges(steps: np.ndarray) -> np.ndarray:
  """Cell edges between steps (half-way to the neighbours), for heat maps of runs
  whose steps have gaps."""
  steps = np.asarray(steps, np.float64)
  if steps.size == 1:
    return np.array([steps[0] - 0.5, steps[0] + 0.5])
  middle = (steps[1:] + steps[:-1]) / 2
  return np.concatenate([[2 * steps[0] - middle[0]], middle, [2 * steps[-1] - middle[-1]]])


# The other arrays.


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


def array_sections(steps, arrays: dict[str, tuple[np.ndarray, str]], out_dir: str, plt
                   ) -> list[Section]:
  """The sections of the other arrays: quantile bands over their rows, six panels
  to a figure; arrays equal at every step share a panel."""
  panels = _distinct((label, values) for values, label in arrays.values())
  names = {label: name for name, (_, label) in arrays.items()}
  sections = []
  for first in range(0, len(panels), _PER_IMAGE):
    chunk = panels[first:first + _PER_IMAGE]
    image = save_figure(functools.partial(_bands_figure, plt, steps,
                                    [(_equal(n), v) for n, v in chunk], ylabel="value"),
                  out_dir, f"arrays_{first // _PER_IMAGE + 1}.png", plt)
    shown = [names[label] for labels, _ in chunk for label in labels]
    sections.append(figure_section(
        "arrays-" + "-".join(shown[:3]), f"Arrays: {_listing(shown)}", image,
        "Quantile bands over steps, one panel each: " +
        "; ".join(_equal(labels) for labels, _ in chunk),
        "Per step, the quantiles over each array's rows (its example axis, else its first "
        "axis; other axes reduced to their L2 norm, as the panel's title says): 5-95 % "
        "and 25-75 % bands and the median." + _shared_note(chunk)))
  return sections


def _bands_figure(plt, steps, panels: Sequence[tuple[str, np.ndarray]], *, ylabel: str,
                  log: bool | None = None, phone: bool = False):
  """Quantile bands, one panel per `(title, values (steps, rows))`, two columns (one on
  a `phone`); log scale when `log`, or (None) when every value is positive and spans
  two decades."""
  fig, axes = _panels(plt, len(panels), phone, height=3.6 if len(panels) == 1 else 3.0)
  for ax, (title, values) in zip(axes.ravel(), panels):
    q = _band(ax, steps, values)
    finite = q[np.isfinite(q)]
    wide = finite.size and np.all(finite > 0) and finite.max() > 100 * finite.min()
    _y_axis(ax, [finite], log=bool(wide) if log is None else log, label=ylabel, title=title)
    step_axis(ax)
  for ax in axes.ravel()[len(panels):]:
    ax.axis("off")
  return fig


def _band(ax, steps, values) -> np.ndarray:
  """Quantiles over the rows of `values` `(steps, rows)`: 5-95 %, 25-75 %, median, at
  the steps where some row is finite; returns them `(5, read steps)`."""
  read = np.any(np.isfinite(values), axis=1)  # An array logged at some steps only.
  steps, values = np.asarray(steps)[read], np.asarray(values)[read]
  with np.errstate(all="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    q = np.nanpercentile(values, [5, 25, 50, 75, 95], axis=1) if steps.size else (
        np.zeros((5, 0)))
  ax.fill_between(steps, q[0], q[4], alpha=0.2, label="5-95 %")
  ax.fill_between(steps, q[1], q[3], alpha=0.4, label="25-75 %")
  ax.plot(steps, q[2], label="median", marker="." if steps.size <= _FEW else None)
  _legend(ax)
  return q


# Lines, axes and legends.


def _line(ax, steps, values, **style) -> np.ndarray:
  """Draws the finite readings of `values` over `steps`, joined (markers when there
  are few, so that a series read at one step shows); returns them."""
  values = np.asarray(values, np.float64).reshape(len(steps))
  read = np.isfinite(values)
  ax.plot(np.asarray(steps)[read], values[read],
          marker="." if 0 < read.sum() <= _FEW else None, **style)
  return values[read]


def step_axis(ax) -> None:
  """Labels the x axis "step", with ticks at whole steps only."""
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins="auto", integer=True))
  ax.set_xlabel("step")


def _legend(ax, **kwargs) -> None:
  """The legend of the panel's labelled lines, below the panel (off the data), in as
  many columns as fit its width."""
  from matplotlib import transforms  # pylint: disable=import-outside-toplevel
  _, labels = ax.get_legend_handles_labels()
  if not labels:
    return
  inches = ax.get_position().width * ax.figure.get_figwidth()
  columns = int(inches // (0.065 * max(map(len, labels)) + 0.45))  # Inches a column takes.
  below = transforms.offset_copy(ax.transAxes, fig=ax.figure, y=-34, units="points")
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below,
            ncol=max(1, min(len(labels), columns)), fontsize="small", frameon=False, **kwargs)


def _robust_range(values, log: bool = False, share: float = 0.01, squeeze: float = 0.25
                  ) -> tuple[float, float, int, int] | None:
  """Y limits that leave out a few far readings, or None when all of them fit well.

  When the readings left once the `share` of them at either end (at least one) is
  set aside take up less than `squeeze` of the span of all of them, the limits are
  those of the readings within half their spread of that range, plus a margin.

  Returns:
    `(low, high, below, above)`: the limits, and the number of readings under and
    over them; None for fewer than 10 finite readings or none far out.
  """
  v = np.asarray(values, np.float64).ravel()
  v = v[np.isfinite(v)]
  if log:
    v = np.log10(v[v > 0])
  if v.size < 10:
    return None
  v = np.sort(v)
  end = max(1, int(share * v.size))
  low, high = v[end], v[-1 - end]
  span = v[-1] - v[0]
  if span == 0 or high - low > squeeze * span:
    return None
  margin = max(high - low, 1e-3 * span) / 2
  inside = v[(v >= low - margin) & (v <= high + margin)]
  low, high = inside.min(), inside.max()
  pad = 0.05 * (high - low) if high > low else 0.05 * max(abs(high), 1e-3 * span)
  limits = (low - pad, high + pad)
  if log:
    limits = (10 ** limits[0], 10 ** limits[1])
  return (float(limits[0]), float(limits[1]), int(np.sum(v < low)), int(np.sum(v > high)))


def _title(ax, *lines: str) -> None:
  """Sets the panel's title, its `lines` wrapped to the panel's width."""
  chars = max(20, int(ax.get_position().width * ax.figure.get_figwidth() * 12))
  ax.set_title("\n".join(textwrap.fill(line, chars) for line in lines if line),
               fontsize="medium")


def _left_out(below: int, above: int) -> str:
  """Says how many readings are below and above a panel's range ("" for none)."""
  if below and above:
    return (f"{below} reading{'s' if below > 1 else ''} below and {above} above the range "
            "not shown")
  count, where = (below, "below") if below else (above, "above")
  return f"{count} reading{'s' if count > 1 else ''} {where} the range not shown" if count else ""


def _y_axis(ax, drawn: Sequence[np.ndarray], *, log: bool, label: str, title: str) -> str:
  """Labels the y axis, with a log scale when `log` and the drawn readings are positive
  and span a decade or more, and limits that leave out a few far readings (as the
  title then says); returns that note ("" when nothing is left out)."""
  drawn = [np.asarray(v, np.float64).ravel() for v in drawn]
  values = np.concatenate(drawn) if drawn else np.zeros(0)
  values = values[np.isfinite(values)]
  log = bool(log and values.size and np.all(values > 0) and values.max() >= 10 * values.min())
  if log:
    ax.set_yscale("log")
  ax.set_ylabel(label)
  if values.size and values.min() == values.max():  # A constant, drawn from 0 up.
    value = float(values[0])
    ax.set_ylim(*(sorted((0.0, 2.0 * value)) if value else (-1.0, 1.0)))
    _title(ax, title, f"(constant: {value:.4g})")
    return ""
  limits = _robust_range(values, log=log)
  note = ""
  if limits is not None:
    ax.set_ylim(limits[0], limits[1])
    note = _left_out(limits[2], limits[3])
  _title(ax, title, f"({note})" if note else "")
  return note


# The instruments' dashboard.


def dashboard_page(dataset, run_dir, out_dir: str, plt, *, report_link: bool = True
                   ) -> str | None:
  """Writes `instruments.png` and `dashboard.html` if the run logged instruments.

  The figure has the loss first, full width, then Cockpit's columns (step size,
  gradients, curvature) row by row, then the step time and Cockpit's second screen
  (GSNR, CABS, early stopping) and any other instrument; each row fills the width.
  Per-parameter readings (`instruments.per_parameter.NAME.*`) are thin lines beside
  their global reading, one colour per parameter across panels.

  Args:
    dataset: the run, as `open_run` reads it.
    run_dir: its folder (for the page's heading).
    out_dir: where to write.
    plt: `matplotlib.pyplot`.
    report_link: link the page to `index.html`.

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
  rows = _dashboard_rows(set(scalars) | {n.split(".")[0] for n in names}, scalars)
  image = save_figure(functools.partial(_dashboard_figure, plt, dataset, steps, rows, scalars,
                                  per_parameter), out_dir, "instruments.png", plt)
  shown = [i for row in rows for panel in row for i in panel.instruments
           if i in scalars or i in _HISTOGRAMS]
  last = {name: _last_reading(values) for name, values in scalars.items()}
  intro = (
      f"<p>{len(steps)} steps ({steps[0]} to {steps[-1]}), read by "
      "<code>gl.training_instruments</code> and laid out as Cockpit's dashboard: the loss, "
      "then step size, gradients and curvature. Batch-size tests below 1 (dashed) say "
      "the batch is large enough; alpha 0 is a step to the minimum of the local "
      "quadratic, -1 no progress, 1 an overshoot to the same loss; thin lines are "
      "per-parameter readings, one colour per parameter." +
      (" <a href='index.html'>Gradient report</a>" if report_link else "") + "</p>")
  sections = [
      figure_section("instruments", f"Training instruments: {_listing(shown, 12)}", image,
                      f"Dashboard of the training instruments over steps: {', '.join(shown)}",
                      "Each panel over steps, but the gradient histograms, which are those "
                      "of the last step that read them. A panel whose few far readings "
                      "would flatten it says how many it leaves out."),
      Section("last-readings", "Last readings",
               "<div class='table'><table><tr><th>instrument</th><th>value</th></tr>" +
               "".join(f"<tr><td>{html.escape(n)}</td><td>{v:.4g}</td></tr>"
                       for n, v in sorted(last.items())) + "</table></div>")]
  page = os.path.join(out_dir, "dashboard.html")
  with open(page, "w", encoding="utf-8") as f:
    f.write(page_html("oryx_gradlog dashboard", f"Training instruments: {os.fspath(run_dir)}",
                  intro, sections))
  return page


def _dashboard_rows(logged: set[str], scalars) -> list[list[_Panel]]:
  """The dashboard's rows of panels that draw something logged."""
  known = {i for _, column in _COLUMNS for panel in column for i in panel.instruments}
  known |= {i for panel in (_LOSS, *_BOTTOM) for i in panel.instruments}
  other = [_Panel(n, (n,), n) for n in sorted(set(scalars) - known)]
  rows = [[_LOSS]]
  rows += [[column[r] for _, column in _COLUMNS] for r in range(3)]
  rows += [list(_BOTTOM[k:k + 3]) for k in range(0, len(_BOTTOM), 3)]
  rows += [other[k:k + 3] for k in range(0, len(other), 3)]
  rows = [[p for p in row if any(i in logged for i in p.instruments)] for row in rows]
  return [row for row in rows if row]


def _dashboard_figure(plt, dataset, steps, rows, scalars, per_parameter, *,
                      phone: bool = False):
  """The dashboard's figure: `rows` of panels, each row as wide as the figure (on a
  `phone`, one panel to a row)."""
  if phone:
    rows = [[panel] for row in rows for panel in row]
  span = math.lcm(*(len(row) for row in rows))
  fig = plt.figure(figsize=(_PHONE_WIDTH if phone else _DASHBOARD_WIDTH, 3.6 * len(rows)),
                   layout="constrained")
  grid = fig.add_gridspec(len(rows), span)
  leaves = sorted({leaf for readings in per_parameter.values() for leaf in readings})
  colours = {leaf: f"C{i % 10}" for i, leaf in enumerate(leaves)}
  for r, row in enumerate(rows):
    width = span // len(row)
    for c, panel in enumerate(row):
      ax = fig.add_subplot(grid[r, c * width:(c + 1) * width])
      if panel.instruments[0] in _HISTOGRAMS:
        _histogram_panel(ax, dataset, panel.instruments[0], steps)
        _title(ax, panel.title)
      else:
        _instrument_panel(ax, panel, steps, scalars, per_parameter, colours)
  return fig


_STYLES = ("-", "--", ":")


def _instrument_panel(ax, panel: _Panel, steps, scalars, per_parameter, colours) -> None:
  """A panel's instruments as lines: global readings thick (dark when per-parameter
  lines are drawn beside them, in that instrument's line style), per-parameter ones
  thin in their parameter's colour and their instrument's line style."""
  drawn, named = [], set()
  instruments = [i for i in panel.instruments if i in scalars]
  styles = {name: _STYLES[k % len(_STYLES)] for k, name in enumerate(instruments)}
  # A model of one parameter reads it as the global reading: drawn once.
  per_parameter = {name: {leaf: v for leaf, v in per_parameter.get(name, {}).items()
                          if not np.array_equal(v, scalars[name], equal_nan=True)}
                   for name in instruments}
  for name in instruments:
    leaves = per_parameter[name]
    dark = {"color": "black", "linewidth": 1.8} if leaves else {}
    drawn.append(_line(ax, steps, scalars[name], zorder=3, linestyle=styles[name], **dark,
                       label=f"{name} (all parameters)" if leaves else name))
  for name in instruments:
    for leaf, leaf_values in sorted(per_parameter[name].items()):
      label = None if leaf in named else leaf or "parameters"  # Each colour named once.
      named.add(leaf)
      drawn.append(_line(ax, steps, leaf_values, linewidth=0.8, alpha=0.8,
                         color=colours[leaf], linestyle=styles[name], label=label))
  if panel.line is not None:
    ax.axhline(panel.line, color="grey", linestyle="--", linewidth=1)
  _y_axis(ax, drawn, log=panel.log, label=panel.ylabel, title=panel.title)
  step_axis(ax)
  if len(instruments) > 1 or named:
    _legend(ax, title="thin: per parameter" if named else None, title_fontsize="small")


def _histogram_panel(ax, dataset, name, steps) -> None:
  """The last read step's histogram (counts -1 on steps that read nothing), its x
  range (1-D) fitted to the filled bins."""
  counts = np.asarray(dataset[f"{INSTRUMENTS}{name}.counts"].values, np.float64)
  read = [i for i in range(len(steps)) if np.all(counts[i] >= 0)]
  if not read:
    ax.axis("off")
    return
  last = counts[read[-1]]
  if name == "grad_hist_1d":
    edges = np.asarray(dataset[f"{INSTRUMENTS}{name}.edges"].values)[read[-1]]
    ax.stairs(last, edges, fill=True)
    filled = _histogram_rows(last)
    if np.any(last > 0):
      ax.set_xlim(edges[filled.start], edges[filled.stop])
    ax.set(yscale="log" if np.any(last > 0) else "linear", xlabel="gradient element",
           ylabel=f"count (step {steps[read[-1]]})")
    return
  x = np.asarray(dataset[f"{INSTRUMENTS}{name}.x_edges"].values)[read[-1]]
  y = np.asarray(dataset[f"{INSTRUMENTS}{name}.y_edges"].values)[read[-1]]
  mesh = ax.pcolormesh(x, y, np.log10(1 + last.T), shading="flat")
  ax.figure.colorbar(mesh, ax=ax, label="log10(1 + count)")
  ax.set(xlabel="gradient element", ylabel=f"parameter (step {steps[read[-1]]})")


def _last_reading(values: np.ndarray) -> float:
  """The last finite value, NaN if there is none."""
  finite = values[np.isfinite(values)]
  return float(finite[-1]) if finite.size else float("nan")


def _panels(plt, count: int, phone: bool, height: float):
  """A figure of `count` panels `height` inches high: two columns, one on a `phone`."""
  columns = 1 if phone else min(2, count)
  rows = -(-count // columns)
  return plt.subplots(rows, columns, squeeze=False, layout="constrained",
                      figsize=(_PHONE_WIDTH if phone else _WIDTH, height * rows))


def _phone_image(name: str) -> str:
  """The file of an image's drawing for a phone."""
  return name[:-len(".png")] + ".phone.png"


def save_figure(draw, out_dir, name, plt) -> str:
  """Saves the figures `draw(phone=False)` as `name` and `draw(phone=True)` beside it
  (named by `_phone_image`), percent-encoded as the store encodes names (a record
  name with `/` stays one file); returns the first file's name."""
  name = store_name(name)
  for phone, file, dpi in ((False, name, _DPI), (True, _phone_image(name), _PHONE_DPI)):
    fig = draw(phone=phone)
    fig.savefig(os.path.join(out_dir, file), dpi=dpi)
    plt.close(fig)
  return name
