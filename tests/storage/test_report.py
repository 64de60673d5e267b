"""The report as a page a person reads: headings, contents, figures, the dashboard."""

import html.parser
import pathlib
import shutil
import subprocess
from typing import NamedTuple
from urllib.parse import unquote

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("zarr")
pytest.importorskip("xarray")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import oryx_gradlog as gl  # noqa: E402
from oryx_gradlog.storage import _report  # noqa: E402

STEPS = 5


def _mlp_loss(params, x, y):
  h = x
  for i, block in enumerate(params["blocks"]):
    h = h @ block["fc"]["kernel"] + block["fc"]["bias"]
    h = jnp.tanh(h) if i < len(params["blocks"]) - 1 else h
  return jnp.mean((h - y) ** 2)


def _layers_run(run_dir):
  """A run of `record_layers` records (each layer's kernel and bias share its output
  cotangent), a loss, a learning rate, and keys logged at even steps only."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"blocks": [
      {"fc": {"kernel": jax.random.normal(keys[0], (3, 4)), "bias": jnp.zeros(4)}},
      {"fc": {"kernel": jax.random.normal(keys[1], (4, 2)), "bias": jnp.zeros(2)}}]}
  x, y = jax.random.normal(keys[2], (8, 3)), jnp.ones((8, 2))

  @jax.jit
  def step(params):
    (loss, grads), records = gl.call_and_reap(
        jax.value_and_grad(gl.record_layers(_mlp_loss)))(params, x, y)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return loss, params, gl.summarize(records, keep_axes=1)

  with gl.RunLog(run_dir, dims={"*": ("example",)}) as log:
    for t in range(STEPS):
      loss, params, logged = step(params)
      entry = {"loss": loss, "lr": np.float32(0.1), **logged}
      if t % 2 == 0:  # An evaluation every other step: NaN at the others.
        entry["eval/accuracy"] = np.float32(0.5 + 0.1 * t)
        entry["eval/per_example"] = np.arange(8, dtype=np.float32) + t
      log.append(t, entry)
  return run_dir


class _Page(html.parser.HTMLParser):
  """The parts of a page the tests read: headings (with their section's id), ids,
  links, images (src, alt), `<source>` srcsets and the text of paragraphs."""

  def __init__(self, text):
    super().__init__()
    self.headings, self.ids, self.links, self.images, self.sources = [], [], [], [], []
    self.paragraphs, self._in, self._section = [], None, None
    self.feed(text)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if "id" in attrs:
      self.ids.append(attrs["id"])
    if tag == "section":
      self._section = attrs.get("id")
    elif tag == "a" and "href" in attrs:
      self.links.append(attrs["href"])
    elif tag == "img":
      self.images.append((attrs["src"], attrs.get("alt", "")))
    elif tag == "source":
      self.sources.append(attrs["srcset"])
    if tag in ("h2", "p"):
      self._in = tag
      (self.headings if tag == "h2" else self.paragraphs).append([self._section, ""])

  def handle_endtag(self, tag):
    if tag == self._in:
      self._in = None

  def handle_data(self, data):
    if self._in:
      (self.headings if self._in == "h2" else self.paragraphs)[-1][1] += data


class Panel(NamedTuple):
  """What a panel of a saved figure shows: its lines as `(label, x, y)`, the texts of
  its legend, and the x ticks in view once drawn."""

  title: str
  ylabel: str
  xlabel: str
  xticks: list
  lines: list
  legend: list


def _panel(ax) -> Panel:
  low, high = ax.get_xlim()
  return Panel(
      ax.get_title(), ax.get_ylabel(), ax.get_xlabel(),
      [t for t in ax.get_xticks() if low <= t <= high],
      [(line.get_label(), np.asarray(line.get_xdata(), float),
        np.asarray(line.get_ydata(), float)) for line in ax.lines],
      [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else [])


@pytest.fixture
def figures(monkeypatch):
  """The desktop figure of each image the report saves, as `{file: [Panel]}`, read
  once drawn, before the figure is closed."""
  saved = {}
  save = _report.save_figure

  def recording(draw, out_dir, name, plt):
    def drawn(phone):
      fig = draw(phone=phone)
      if not phone:
        fig.canvas.draw()
        saved[_report.store_name(name)] = [
            _panel(ax) for ax in fig.axes if ax.get_label() != "<colorbar>"]
      return fig
    return save(drawn, out_dir, name, plt)

  monkeypatch.setattr(_report, "save_figure", recording)
  return saved


@pytest.fixture(scope="module")
def layers_run(tmp_path_factory):
  return _layers_run(tmp_path_factory.mktemp("layers") / "run")


def test_page_heads_each_figure_with_its_series_and_links_its_contents(layers_run, figures):
  page = pathlib.Path(gl.report(layers_run, progress=False))
  parsed = _Page(page.read_text(encoding="utf-8"))
  headings = [text for _, text in parsed.headings]
  # The loss first, under its own name; the other scalars named in their heading.
  assert headings[:3] == ["Contents", "Loss: loss", "Scalar series: eval/accuracy, lr"]
  assert "Cotangent norms per record: blocks.0.fc.bias = blocks.0.fc.kernel, blocks.1.fc.bias " \
         "= blocks.1.fc.kernel" in headings
  assert "Arrays: eval/per_example" in headings
  # The contents link every section, and every link to the page resolves to an id.
  anchors = [link[1:] for link in parsed.links if link.startswith("#")]
  sections = [section for section, _ in parsed.headings if section]
  assert anchors == sections and set(anchors) <= set(parsed.ids)
  assert len(set(parsed.ids)) == len(parsed.ids)
  # Each figure: a description, an alt text that names its series, a phone drawing.
  described = {section for section, text in parsed.paragraphs if text.strip()}
  assert {s for s in sections if s not in ("last-values", "last-step")} <= described
  for src, alt in parsed.images:
    assert alt, src
    assert (page.parent / unquote(src)).exists()
  assert {alt for _, alt in parsed.images} >= {"Line plot of loss over steps"}
  assert parsed.sources == [src[:-4] + ".phone.png" for src, _ in parsed.images]
  assert all((page.parent / unquote(s)).exists() for s in parsed.sources)
  # Every panel has a y label and whole steps on its step axis; the norms a legend.
  for name, panels in figures.items():
    for panel in panels:
      assert panel.ylabel and panel.xlabel == "step", (name, panel.title)
      assert panel.xticks == list(range(STEPS)), (name, panel.title, panel.xticks)
  assert figures["norms.png"][0].legend == ["blocks.0.fc.bias = blocks.0.fc.kernel",
                                         "blocks.1.fc.bias = blocks.1.fc.kernel"]
  html_text = page.read_text(encoding="utf-8")
  assert "<meta name='viewport'" in html_text and "max-width:100%" in html_text


def test_records_sharing_an_output_cotangent_are_drawn_once(layers_run, figures):
  page = pathlib.Path(gl.report(layers_run, progress=False))
  run = gl.open_run(layers_run)
  # The kernel's and bias's summaries are equal series (one output cotangent).
  for layer in (0, 1):
    for stat in ("norm", "histogram"):
      np.testing.assert_array_equal(
          run[f"blocks.{layer}.fc.kernel.summary.out_cotangent.{stat}"].values,
          run[f"blocks.{layer}.fc.bias.summary.out_cotangent.{stat}"].values)
  # One line per layer, labelled with both records, its values those of the run.
  lines = figures["norms.png"][0].lines
  assert [label for label, _, _ in lines] == ["blocks.0.fc.bias = blocks.0.fc.kernel",
                                              "blocks.1.fc.bias = blocks.1.fc.kernel"]
  np.testing.assert_allclose(
      lines[1][2], run["blocks.1.fc.kernel.summary.out_cotangent.norm"].mean("example").values,
      rtol=1e-6)
  # One histogram per layer, headed by both names.
  histograms = [name for name in figures if name.endswith(".histogram.png")]
  assert len(histograms) == 2
  headings = [text for _, text in _Page(page.read_text(encoding="utf-8")).headings]
  assert "Cotangent magnitude histogram: blocks.1.fc.bias = blocks.1.fc.kernel" in headings
  assert "Per-example cotangent norms: blocks.0.fc.bias = blocks.0.fc.kernel, " \
         "blocks.1.fc.bias = blocks.1.fc.kernel" in headings


def test_keys_logged_at_some_steps_are_drawn_over_their_readings(layers_run, figures):
  gl.report(layers_run, progress=False)
  scalars = {panel.title: panel.lines for panel in figures["scalars_1.png"]}
  (_, x, y), = scalars["eval/accuracy"]
  np.testing.assert_array_equal(x, [0, 2, 4])  # Not the NaN steps: a line, not gaps.
  np.testing.assert_allclose(y, [0.5, 0.7, 0.9], rtol=1e-6)
  # A sparse array: its median over its rows at the steps it was read.
  (panel,) = figures["arrays_1.png"]
  lines, legend = panel.lines, panel.legend
  (label, x, y), = lines
  assert label == "median" and legend == ["5-95 %", "25-75 %", "median"]
  np.testing.assert_array_equal(x, [0, 2, 4])
  np.testing.assert_allclose(y, [3.5, 5.5, 7.5])


def test_step_ticks_are_whole_steps():
  fig, ax = plt.subplots()
  ax.plot(np.arange(STEPS), np.arange(STEPS) ** 2)
  fig.canvas.draw()
  low, high = ax.get_xlim()
  default = [t for t in ax.get_xticks() if low <= t <= high]
  assert any(t != round(t) for t in default)  # Matplotlib's own ticks: 0.5, 1.5, ...
  _report.step_axis(ax)
  fig.canvas.draw()
  ticks = [t for t in ax.get_xticks() if low <= t <= high]
  assert ticks == [0, 1, 2, 3, 4] and ax.get_xlabel() == "step"
  plt.close(fig)


def test_histogram_range_is_fitted_to_the_filled_bins():
  rng = np.random.default_rng(0)
  counts = np.zeros((7, 26), np.int64)
  counts[:, 9:17] = rng.integers(0, 3, (7, 8))
  counts[3, 5] = 1  # One step reaches lower.
  filled = np.flatnonzero(counts.sum(axis=0))
  rows = _report._histogram_rows(counts)
  assert (rows.start, rows.stop) == (filled.min(), filled.max() + 1)
  assert _report._histogram_rows(np.zeros((3, 26))) == slice(0, 26)  # Nothing to fit.
  edges = gl.magnitude_bins()
  fig = _report._histogram_figure(plt, np.arange(7), counts, edges, "h")
  ax = fig.axes[0]
  assert ax.get_ylim() == (rows.start, rows.stop)
  # One format: the default edges are powers of two, 2^-k.
  labels = [t.get_text() for t in ax.get_yticklabels()]
  assert labels[0] == f"$2^{{{int(np.log2(edges[rows.start - 1]))}}}$"
  assert all(label.startswith("$2^{-") for label in labels), labels
  plt.close(fig)


def test_a_constant_is_drawn_from_zero_and_the_header_lists_what_is_plotted(
    layers_run, figures, tmp_path):
  page = pathlib.Path(gl.report(layers_run, tmp_path / "report", progress=False))
  (lr,) = [p for panels in figures.values() for p in panels if p.title.startswith("lr")]
  assert lr.title == "lr\n(constant: 0.1)"  # The note under the name.
  parsed = _Page(page.read_text(encoding="utf-8"))
  intro = parsed.paragraphs[0][1]
  assert "scalar series: loss, eval/accuracy, lr;" in intro, intro
  assert "other arrays: eval/per_example." in intro, intro


def test_a_record_logged_whole_beside_its_summaries_is_not_drawn_twice(tmp_path):
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
  loss = lambda w, x: jnp.sum(jnp.sin(gl.tap(jnp.tanh(x @ w), name="h")) ** 2)
  step = jax.jit(lambda w: gl.summarize(gl.reap(jax.grad(loss))(w, x), full="h",
                                        keep_axes=1))
  with gl.RunLog(tmp_path, dims={"*": ("example",)}) as log:
    for t in range(3):
      log.append(t, step(jnp.ones((3, 4)) * (t + 1)))
  assert "h.full" in gl.open_run(tmp_path)  # Logged whole, as well as summarized.
  page = pathlib.Path(gl.report(tmp_path, progress=False))
  parsed = _Page(page.read_text(encoding="utf-8"))
  assert [src for src, _ in parsed.images if "arrays" in src] == []
  assert "per_example.png" in [src for src, _ in parsed.images]
  assert ("other arrays: none (h.full, logged whole, are shown by their per-example "
          "norms)") in parsed.paragraphs[0][1]


def test_one_far_reading_does_not_flatten_its_panel():
  rng = np.random.default_rng(0)
  alpha = rng.uniform(-1, 1, 300)
  alpha[280] = 125.0
  low, high, below, above = _report._robust_range(alpha)
  assert (below, above) == (0, 1)
  assert low <= alpha[np.arange(300) != 280].min() and high >= np.sort(alpha)[-2]
  assert high < 2  # Not 125: the rest fill the panel.
  fig, ax = plt.subplots()
  note = _report._y_axis(ax, [alpha], log=False, label="alpha", title="Alpha")
  assert note == "1 reading above the range not shown" and note in ax.get_title()
  assert ax.get_ylim() == (low, high)
  plt.close(fig)
  # A falling loss, a series of a few readings and a log-scale spike: nothing to clip,
  # too few to judge, and judged in decades.
  assert _report._robust_range(np.exp(-np.arange(300) / 30)) is None
  assert _report._robust_range([1, 1, 1, 1, 100]) is None
  norms = 10 ** rng.uniform(-3, -2, 200)
  norms[5] = 1e6
  assert _report._robust_range(norms, log=True)[2:] == (0, 1)
  assert _report._left_out(2, 1) == "2 readings below and 1 above the range not shown"


def test_equal_series_are_grouped_in_order():
  a, b = np.array([1.0, np.nan, 2.0]), np.array([3.0, 4.0, 5.0])
  groups = _report._distinct([("k", a), ("other", b), ("bias", a.copy()),
                              ("ints", np.array([3, 4, 5]))])
  assert [names for names, _ in groups] == [["k", "bias"], ["other", "ints"]]


@pytest.fixture(scope="module")
def instruments_run(tmp_path_factory):
  """A run of instruments' readings only, one alpha far out, per-parameter norms."""
  run_dir = tmp_path_factory.mktemp("instruments") / "run"
  rng = np.random.default_rng(0)
  with gl.RunLog(run_dir) as log:
    for t in range(40):
      alpha = np.nan if t == 0 else (125.0 if t == 30 else rng.uniform(-1, 1))
      log.append(t, {"instruments": {
          "loss": np.float32(np.exp(-t / 10)), "alpha": np.float32(alpha),
          "norm_test": np.float32(0.5 + t / 100), "inner_product_test": np.float32(0.3),
          "grad_norm": np.float32(1 + t), "time": np.float64(t * 0.1),
          "per_parameter": {"grad_norm": {"w": np.float32(t), "b": np.float32(1 + t / 2)}}}})
  return run_dir


def test_dashboard_fills_the_width_labels_every_panel_and_names_parameters(
    instruments_run, figures):
  page = gl.report(instruments_run, progress=False)
  assert page.endswith("dashboard.html")
  panels = {p.title.split("\n")[0]: (p.ylabel, p.lines, p.legend)
            for p in figures["instruments.png"]}
  assert list(panels)[0] == "Loss"  # First, full width.
  assert all(ylabel for ylabel, _, _ in panels.values()), panels
  _, lines, legend = panels["Gradient norm"]
  assert legend == ["grad_norm (all parameters)", "b", "w"]
  np.testing.assert_allclose(lines[2][2], np.arange(40))
  assert panels["Gradient tests (below 1: batch large enough)"][2] == [
      "norm_test", "inner_product_test"]
  alpha_title = next(p.title for p in figures["instruments.png"] if p.title.startswith("Alpha"))
  assert "1 reading above the range not shown" in alpha_title
  text = pathlib.Path(page).read_text(encoding="utf-8")
  assert "<tr><td>alpha</td>" in text and "index.html" not in text  # No report to link.
  parsed = _Page(text)
  assert parsed.headings[1][1].startswith("Training instruments: loss, alpha, norm_test")
  # Each row of panels spans the figure: two panels to the alpha row, one to the loss.
  fig = _report._dashboard_figure(
      plt, gl.open_run(instruments_run), np.arange(40),
      [[_report._LOSS], list(_report._COLUMNS[0][1][:1] + _report._COLUMNS[1][1][:1])],
      {"loss": np.ones(40), "alpha": np.zeros(40), "norm_test": np.ones(40)}, {})
  fig.canvas.draw()
  boxes = [ax.get_position() for ax in fig.axes]
  assert boxes[0].x1 - boxes[0].x0 > 0.85
  assert boxes[1].x0 < 0.1 and boxes[2].x1 > 0.9
  plt.close(fig)


@pytest.fixture(scope="module")
def attribution_run(tmp_path_factory):
  """A run that logged projected per-example gradients, ids and queries (TracIn)."""
  from test_tracin import _mlp_run  # pylint: disable=import-outside-toplevel
  folder = tmp_path_factory.mktemp("attribution")
  _mlp_run(folder, k=2)
  return folder / "run"


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(BROWSER is None, reason="no chromium (apt-get install chromium)")
@pytest.mark.parametrize("width", [390, 1400], ids=["phone", "desktop"])
@pytest.mark.parametrize("run", ["layers_run", "instruments_run", "attribution_run"],
                         ids=["index", "dashboard", "attribution"])
def test_pages_fit_a_phone_and_a_desktop_in_a_headless_browser(request, tmp_path, run, width):
  page = pathlib.Path(gl.report(request.getfixturevalue(run), tmp_path / "report",
                                progress=False))
  if run == "attribution_run":
    page = page.with_name("attribution.html")
  # The page in a frame of `width` (a headless window is at least 500 px wide), and a
  # script that reports the frame's width, the page's, and each image's source, decoded
  # width and right edge.
  check = page.with_name("browser_check.html")
  check.write_text(
      f"<!doctype html><iframe id=f src='{page.name}' style='width:{width}px;height:2000px;"
      "border:0'></iframe><script>document.getElementById('f').addEventListener('load', "
      "() => { const w = document.getElementById('f').contentWindow, d = w.document; "
      "const lines = ['width ' + w.innerWidth + ' ' + d.documentElement.scrollWidth].concat("
      "[...d.images].map(i => i.currentSrc.split('/').pop() + ' ' + i.naturalWidth + ' ' + "
      "Math.round(i.getBoundingClientRect().right))); document.body.innerHTML = "
      "'<pre id=result>' + lines.join('\\n') + '</pre>'; });</script>", encoding="utf-8")
  result = subprocess.run(
      [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
       "--disable-background-networking", "--disable-component-update", "--disable-sync",
       "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}", "--hide-scrollbars",
       "--window-size=1600,2000", "--virtual-time-budget=10000", "--dump-dom",
       check.as_uri()], capture_output=True, text=True, timeout=120, check=False)
  lines = result.stdout.split("<pre id=\"result\">")[-1].split("</pre>")[0].splitlines()
  assert lines and lines[0].startswith("width "), result.stdout[-2000:] + result.stderr[-2000:]
  _, inner, scroll = lines[0].split()
  assert int(inner) == width and int(scroll) <= width  # Nothing wider than the window.
  images = [line.split() for line in lines[1:]]
  assert len(images) == len(_Page(page.read_text(encoding="utf-8")).images) >= (
      6 if run == "layers_run" else 1)
  for src, natural, right in images:
    assert int(natural) > 0 and int(right) <= width, (src, natural, right)
    assert src.endswith(".phone.png") == (width < 700), src
