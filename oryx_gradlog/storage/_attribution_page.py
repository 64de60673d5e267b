"""The report's attribution page, and its text for the command line, of a run that
logged projected per-example gradients (`gl.projected_grads`) with example ids.

`attribution_page(dataset, out_dir, plt)` writes `attribution.html` and
`attribution.png` (the loss over steps, its largest rises marked), when the run has
the keys of `gl.tracin` and `gl.loss_spikes` (`train`, `ids`, `lr`; `loss` for the
spikes, `query` for the queries' helpful and harmful examples; or, for a run with
Adam, `products`, each step's products of the queries' preconditioned gradients with
the batch's, `gl.tracin(run, products="products")`, and `self`, each example's with
its own, `gl.tracin_self_influence(run, self_products="self")`):

* the steps where the loss rose most, and for each the examples of the step before
  that pushed it up, with their first-order shares, and (where the run logged
  per-example `losses`) the spiking batch's own examples by their share of the rise;
* the training examples of the largest TracIn self-influence (mislabelled or
  unusual examples are often among them);
* per query, its most helpful and most harmful training examples by TracIn.

`attribution_text(dataset)` is the same as plain text (`python -m oryx_gradlog
attribute RUN_DIR`).

Every example id is shown with what the run said of that example
(`RunLog.describe_examples`: a label, a short text), where it said anything.

Sharp edges:
  * The keys are `gl.tracin`'s defaults; a run logged under other keys has no page.
  * Images (`describe_examples(images=...)`) are drawn on the page only, each
    scaled to its own range; the command line shows ids and columns.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import os
from typing import Any

import numpy as np

from oryx_gradlog.analyses.attribution import _from_run

_SHOWN = 5  # Examples per spike and per query.


def _has_grads(dataset, key: str) -> bool:
  return any(str(n).startswith(f"{key}.grads.") for n in dataset.data_vars)


def has_attribution(dataset) -> bool:
  names = [str(n) for n in dataset.data_vars]
  return ("ids" in names and "lr" in names
          and (_has_grads(dataset, "train") or "products" in names or "self" in names))


def _findings(dataset, top: int) -> dict[str, Any]:
  found: dict[str, Any] = {"described": dict(dataset.attrs.get("examples") or {}),
                           "spikes": []}
  n = int(np.asarray(dataset["ids"].values).max()) + 1
  if _has_grads(dataset, "train"):
    found["own"] = _from_run.tracin_self_influence(dataset, num_examples=n)
    if "loss" in dataset:
      found["spikes"] = _from_run.loss_spikes(dataset, top=top)
  elif "self" in dataset:
    found["own"] = _from_run.tracin_self_influence(dataset, num_examples=n,
                                                   self_products="self")
  if "products" in dataset:
    found["scores"] = _from_run.tracin(dataset, num_examples=n, products="products")
  elif _has_grads(dataset, "query"):
    found["scores"] = _from_run.tracin(dataset, num_examples=n)
  return found


def _example(i: int, described: dict[str, list]) -> str:
  """Example `i` as its id and what the run described of it: `7 [label 3, text 'a cat']`."""
  parts = [f"{name} {column[i]!r}" if isinstance(column[i], str) else f"{name} {column[i]}"
           for name, column in described.items() if 0 <= i < len(column)]
  return f"{i} [{', '.join(parts)}]" if parts else str(i)


class _Html(str):
  """A table cell's HTML, written as it is (other cells are escaped)."""


def _named(ids, texts, thumbnail=None) -> str:
  """`texts` (one per example id) joined, as text; as HTML with each example's image
  in front where `thumbnail(i)` draws it."""
  if thumbnail is None:
    return ", ".join(texts)
  return _Html(", ".join(thumbnail(int(i)) + html.escape(t) for i, t in zip(ids, texts)))


def _examples(ids, values, described: dict[str, list], thumbnail=None) -> str:
  """Examples with their values (`_named`)."""
  return _named(ids, [f"{_example(int(i), described)} ({v:+.3g})"
                      for i, v in zip(ids, values)], thumbnail)


def _own(spike, described: dict[str, list], thumbnail=None) -> str:
  """The spiking batch's own examples, or how to have them named."""
  if spike.own_ids is None:
    return "(log each step's per-example 'losses' to name them)"
  return _examples(spike.own_ids[:_SHOWN], spike.own_shares[:_SHOWN], described, thumbnail)


def _thumbnails(dataset, plt):
  """`thumbnail(i)`: example i's image (`RunLog.describe_examples(images=...)`) as an
  inline PNG, `""` for an example without one; `None` for a run without images."""
  path = dataset.attrs.get("examples_images")
  if not path or not os.path.exists(path):
    return None
  images = np.load(path)

  @functools.lru_cache(maxsize=None)
  def thumbnail(i: int) -> str:
    if not 0 <= i < len(images):
      return ""
    image = images[i].astype(np.float64)
    image = (image - image.min()) / (np.ptp(image) or 1.0)
    buffer = io.BytesIO()
    plt.imsave(buffer, image, cmap="gray", vmin=0.0, vmax=1.0, format="png")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (f"<img alt='example {i}' src='data:image/png;base64,{data}' style='height:"
            "2.4em;image-rendering:pixelated;vertical-align:middle;margin-right:.2em'>")

  return thumbnail


def attribution_text(dataset, *, top: int = 5) -> str:
  """The page's findings as plain text."""
  found = _findings(dataset, top)
  described = found["described"]
  lines = []
  for spike in found["spikes"]:
    pushed = _examples(spike.ids[:_SHOWN], spike.contributions[:_SHOWN], described)
    lines.append(f"step {spike.step}: loss {spike.rise:+.4g} above the steps before; "
                 f"{spike.explained:+.4g} from step {spike.cause}'s update, pushed up by "
                 f"{pushed}; its own examples: {_own(spike, described)}")
  if not _has_grads(dataset, "train"):
    lines.append("no projected gradients 'train' logged: no spikes"
                 + ("" if "own" in found else ", no self-influence"))
  elif not found["spikes"]:
    lines.append("no rise of the logged loss" if "loss" in dataset
                 else "no 'loss' logged: no spikes")
  if "own" in found:
    own = found["own"]
    order = np.argsort(-own, kind="stable")[:top * 2]
    lines.append("highest TracIn self-influence: "
                 + _examples(order, own[order], described))
  if "scores" in found:
    for q, row in enumerate(found["scores"]):
      best, worst = np.argsort(-row, kind="stable"), np.argsort(row, kind="stable")
      helpful = _examples(best[:_SHOWN], row[best[:_SHOWN]], described)
      harmful = _examples(worst[:_SHOWN], row[worst[:_SHOWN]], described)
      lines.append(f"query {q}: helpful {helpful}; harmful {harmful}")
  return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
  head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
  cell = lambda v: v if isinstance(v, _Html) else html.escape(str(v))
  body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>"
                 for row in rows)
  return f"<div class='table'><table><tr>{head}</tr>{body}</table></div>"


def attribution_page(dataset, out_dir: str, plt, *, top: int = 5) -> str | None:
  """Writes `attribution.html` (and `attribution.png` where the run logged its loss);
  returns its path, or `None` for a run without projected gradients (or products)
  and ids."""
  if not has_attribution(dataset):
    return None
  from oryx_gradlog.storage import _report  # pylint: disable=import-outside-toplevel
  found = _findings(dataset, top)
  described = found["described"]
  thumbnail = _thumbnails(dataset, plt)
  sections = []
  if "loss" in dataset:
    steps = np.asarray(dataset["step"].values)
    loss = np.asarray(dataset["loss"].values, np.float64)
    spikes = found["spikes"]

    def draw(phone: bool):
      fig, ax = plt.subplots(figsize=(6, 4) if phone else (11, 3.5), layout="constrained")
      ax.plot(steps, loss, lw=1, label="loss")
      if spikes:
        ax.scatter([s.step for s in spikes], [loss[steps == s.step][0] for s in spikes],
                   color="C3", zorder=3, label="largest rises")
      ax.set(xlabel="step", ylabel="loss", title="Loss, its largest rises marked")
      _report.step_axis(ax)
      ax.legend(loc="upper right")
      return fig

    image = _report.save_figure(draw, out_dir, "attribution.png", plt)
    sections.append(_report.figure_section(
        "spikes", "Loss spikes and the examples that caused them", image,
        "the logged loss over steps, its largest rises marked",
        "Each rise is the loss less the median of the steps before it. Its part that the "
        "update of the step before explains is split among that step's examples by "
        "their first-order share (-lr <g_i, g_next>: positive pushed the loss up). A "
        "rise that the update explains little of is the batch's own (unusual or "
        "mislabelled examples): its own examples are ranked by their share of the rise, "
        "(loss - baseline) / B, from the per-example losses the run logged."))
    rows = [(s.step, f"{s.rise:+.4g}", s.cause, f"{s.explained:+.4g}",
             _examples(s.ids[:_SHOWN], s.contributions[:_SHOWN], described, thumbnail),
             _own(s, described, thumbnail)) for s in spikes]
    sections[-1] = sections[-1]._replace(body=sections[-1].body + _table(
        ("step", "rise", "update of step", "explained", "its examples (share)",
         "the batch's own examples (share)"), rows))
  if "own" in found:
    own = found["own"]
    order = np.argsort(-own, kind="stable")[:top * 4]
    sections.append(_report.Section(
        "self-influence", "Training examples of the highest TracIn self-influence",
        "<p>sum over the logged steps of "
        + ("lr |g|^2 of each example's projected gradient" if _has_grads(dataset, "train")
           else "lr &lt;g, P g&gt; of each example's gradient, P the optimiser's "
                "preconditioner (the logged 'self')") +
        ": the examples training kept pushing against (mislabelled or unusual ones are "
        "often among them).</p>" +
        _table(("example", "self-influence"),
               [(_named([i], [_example(int(i), described)], thumbnail), f"{own[i]:.4g}")
                for i in order])))
  if "scores" in found:
    rows = []
    for q, row in enumerate(found["scores"]):
      best, worst = np.argsort(-row, kind="stable"), np.argsort(row, kind="stable")
      rows.append((q, _examples(best[:_SHOWN], row[best[:_SHOWN]], described, thumbnail),
                   _examples(worst[:_SHOWN], row[worst[:_SHOWN]], described, thumbnail)))
    sections.append(_report.Section(
        "queries", "Each query's most helpful and most harmful training examples",
        "<p>TracIn over the logged steps: sum of lr &lt;g(query), g(example)&gt; "
        + ("with the query's gradient in the optimiser's direction (the logged "
           "'products': Adam's P g(query)) " if "products" in dataset else "") +
        "(positive: training on the example lowered the query's loss).</p>" +
        _table(("query", "most helpful (score)", "most harmful (score)"), rows)))
  page = os.path.join(out_dir, "attribution.html")
  intro = ("<p>From the projected per-example gradients the run logged at each step "
           "(gl.projected_grads), without running the model again. <a href='index.html'>"
           "Run report</a></p>")
  with open(page, "w", encoding="utf-8") as f:
    f.write(_report.page_html("oryx_gradlog attribution", "Training-data attribution",
                          intro, sections))
  return page
