"""How good an attribution is: the linear datamodeling score, `lds`.

Park et al. (2023, TRAK) judge attribution scores by retraining: train the model
on many random subsets `S_k` of the training data, measure each query on every
retrained model, and ask whether the scores predict those measurements. The
prediction for subset `S_k` and query `q` is the sum of the query's scores over the
subset; the LDS is the Spearman rank correlation, over subsets, of the predictions
with the measurements, averaged over queries (as dattri computes it).

Our scores are `g_q^T H^-1 g_t` with `g_q` the gradient of the query's measurement
(its loss by default): a positive score says that training on `t` lowers the
measurement. The prediction is therefore minus the sum of the scores, so that an
attribution that predicts well has an LDS near 1 whatever the measurement.

Sharp edges:
  * The LDS needs the retrained models: tens of subsets (half the data each, as in
    the papers) and, for each, a training run as the original one. See
    `examples/12_influence_digits.py`, which vmaps the retraining over subsets.
  * Ties are ranked by their mean rank, as `scipy.stats.spearmanr` does; a query
    whose measurements (or predictions) are all equal has no correlation and is
    left out of the mean (NaN if every query is).
"""

from __future__ import annotations

import numpy as np


def _ranks(values: np.ndarray) -> np.ndarray:
  """Ranks along the last axis, ties given their mean rank."""
  order = np.argsort(values, axis=-1, kind="stable")
  ranks = np.empty_like(values, dtype=np.float64)
  np.put_along_axis(ranks, order, np.arange(values.shape[-1], dtype=np.float64)[None], -1)
  for row, (v, r) in enumerate(zip(values, ranks)):  # Mean ranks of ties.
    unique, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    if len(unique) < len(v):
      sums = np.bincount(inverse, weights=r)
      ranks[row] = (sums / counts)[inverse]
  return ranks


def lds(scores: np.ndarray, subsets: np.ndarray, measurements: np.ndarray) -> float:
  """Returns the linear datamodeling score of attribution `scores`.

  Args:
    scores: `(n_query, n_train)` attribution scores (`Influence.scores`).
    subsets: `(n_subsets, n_train)` booleans, which training examples each
      retrained model saw (or `(n_subsets, subset_size)` integer indices).
    measurements: `(n_subsets, n_query)` each query's measurement (its loss, by
      default) on the model retrained on each subset.

  Returns:
    The mean over queries of the Spearman correlation, over subsets, of
    `-sum_{t in S_k} scores[q, t]` with `measurements[k, q]`.

  Example:
    >>> import numpy as np, oryx_gradlog as gl
    >>> scores = np.array([[1.0, 0.0, -1.0]])  # example 0 helps, 2 hurts
    >>> subsets = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]], bool)
    >>> losses = np.array([[0.1], [0.9], [0.5]])  # the query's loss after retraining
    >>> float(gl.lds(scores, subsets, losses))
    1.0
  """
  scores = np.asarray(scores, np.float64)
  subsets, measurements = np.asarray(subsets), np.asarray(measurements, np.float64)
  if scores.ndim != 2:
    raise ValueError(f"lds: scores must be (n_query, n_train); got shape {scores.shape}.")
  n_query, n_train = scores.shape
  if subsets.dtype != bool:
    if subsets.ndim != 2 or not np.issubdtype(subsets.dtype, np.integer):
      raise ValueError("lds: subsets must be (n_subsets, n_train) booleans or "
                       f"(n_subsets, size) indices; got {subsets.dtype} {subsets.shape}.")
    mask = np.zeros((subsets.shape[0], n_train), bool)
    np.put_along_axis(mask, subsets, True, axis=1)
    subsets = mask
  if subsets.ndim != 2 or subsets.shape[1] != n_train:
    raise ValueError(f"lds: subsets have shape {subsets.shape} but the scores have "
                     f"{n_train} training examples; give one row per retrained model.")
  if measurements.shape != (subsets.shape[0], n_query):
    raise ValueError(
        f"lds: measurements have shape {measurements.shape}; expected (n_subsets, "
        f"n_query) = {(subsets.shape[0], n_query)}: each query measured on each model.")
  predicted = -(subsets.astype(np.float64) @ scores.T)  # (n_subsets, n_query)
  x, y = _ranks(predicted.T), _ranks(measurements.T)  # (n_query, n_subsets)
  x -= x.mean(axis=1, keepdims=True)
  y -= y.mean(axis=1, keepdims=True)
  norm = np.sqrt(np.sum(x * x, axis=1) * np.sum(y * y, axis=1))
  with np.errstate(invalid="ignore", divide="ignore"):
    rho = np.sum(x * y, axis=1) / norm
  rho = rho[norm > 0]
  return float(np.mean(rho)) if rho.size else float("nan")
