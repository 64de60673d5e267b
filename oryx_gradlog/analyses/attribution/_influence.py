"""Influence functions from the records: which training examples did this.

`fit_influence` fits a damped curvature `H` of the training loss from the layer
records of `gl.record_layers` (any model, unchanged; the blocks, strategies and
Kronfluence's conventions are in `_factors.py`); `Influence.scores` gives, for
query examples q and training examples t,

    score(q, t) = g_q^T (H + damping)^-1 g_t,

summed over layer blocks, with `g` the gradient of each example's own loss (not
divided by the batch size). Positive: training on t lowers q's loss (a helpful
example); negative: harmful.

The curvature is fitted from the gradients of the loss on the batch's own labels
(the empirical Fisher, Kronfluence's `use_empirical_fisher=True`), or with
`sampled_loss` on labels sampled from the model (the true Fisher, Kronfluence's
default); scores are always of `loss` (or a `measurement`) on the data's labels.

Sharp edges:
  * Memory: `scores` holds the preconditioned gradients of the queries of one
    block (`query_block x n_params` floats, in the blocks' rotated bases: all the
    queries by default; 64 queries of a 1 M-parameter model take 256 MiB) and
    one training batch's (`batch x n_params`), plus the `(n_query, n_train)`
    result; diagonal blocks form each batch's per-example gradients of their
    parameters. Each block of queries reads the training batches once more.
    With `query_rank=r` a query's dense or convolution layer takes `r (d_in +
    d_out)` floats, so many queries fit at once and the training batches are
    read once: example 13's GPT-2-sized model at `r = 32` takes 22.8 MiB a
    query, and its scoring step for all 481 queries, compiled for a TPU v5e,
    peaks at 14.3 GiB of the chip's 15.7 (8.9 GiB at `query_block=241`). The
    query batches are joined as each batch's arrays are freed (held once).
  * The eigenvalues are fitted at the parameters given to `fit_influence`, which
    `Influence` keeps; scores are gradients at those parameters.
  * Compiled once: the steps of `fit_influence` and `Influence` are kept per loss
    (the last 16 losses, by identity: define the loss once, not in a loop), so a
    second fit and its scores at the same shapes compile nothing. A loss object
    that is not hashable gets steps of its own at each call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.attribution import _batches, _low_rank
from oryx_gradlog.analyses.attribution._blocks import DIAGONAL, KRONECKER, Gradients
from oryx_gradlog.analyses.attribution._factors import (
    DiagonalBlock, FullBlock, InfluenceFactors, KroneckerBlock, divide, flat_grads, Pass,
    rotated, block_shape, fit_factors, shapes)


def fit_influence(
    loss: Callable[..., jax.Array],
    params: Any,
    batches: Iterable[Sequence[Any]],
    *,
    strategy: str = "ekfac",
    damping: float | None = None,
    projection: Any = None,
    argnums: int = 0,
    batch_argnums: int | Sequence[int] | None = None,
    sampled_loss: Callable[..., jax.Array] | None = None,
    key: jax.Array | None = None,
    progress: bool = True,
) -> Influence:
  """Fits influence functions of the training examples on `loss` at `params`.

  `Influence.scores(queries, train)` then gives `g_q^T (H + damping)^-1 g_t` for every
  pair of a query and a training example (positive: training on t lowers q's loss),
  `Influence.self_influence` each training example's own score (large for
  surprising, often mislabelled, examples) and `Influence.top_k` the most helpful and
  harmful ones. `H` is fitted per block (a layer's weight with its bias, or one
  parameter; `gl.layer_coverage` lists them) from the per-example gradients of
  `loss` that `gl.record_layers` finds in any model, as Kronfluence does.

  Args:
    loss: the batch loss, `loss(params, *batch)`: the mean over the batch of the
      per-example losses (any model, unchanged).
    params: the trained parameters (a pytree of arrays; for a Flax NNX model, the
      `nnx.State` of `nnx.split(model, nnx.Param, ...)`, merged in `loss`).
    batches: the training data, an iterable of batches (re-iterable for `"ekfac"`,
      which reads it twice): tuples of the loss's batch arguments, `(x, y)` for
      `loss(params, x, y)`, or one pytree such as a dict for `loss(params, batch)`,
      with the examples on every array's leading axis; of any sizes, one example
      included.
    strategy: `"ekfac"` (Kronecker factors of each block with their eigenvalues
      refitted, Kronfluence's default), `"kfac"` (the factors alone, one pass over
      the batches), `"full"` (each block's whole Fisher: small or projected blocks)
      or `"identity"` (no curvature: plain gradient products, as TracIn at one
      checkpoint).
    damping: added to every eigenvalue; `None` for 0.1 x each block's mean.
    projection: a `gl.Projector` (LoGra): the blocks are fitted, and examples
      scored, in its projected space; `None` for the whole gradients.
    argnums: the positional argument holding the parameters.
    batch_argnums: the arguments holding the batch (default: all others).
    sampled_loss: for the true Fisher, `sampled_loss(params, *batch, key)`: the
      mean loss on labels drawn with `key` from the model's output (e.g. `labels =
      jax.random.categorical(key, lax.stop_gradient(logits))` for a classifier);
      the curvature is fitted from its gradients. `None`: the empirical Fisher, of
      `loss` on the batch's labels.
    key: the PRNG key of `sampled_loss` (default `jax.random.PRNGKey(0)`).
    progress: show a progress bar of each pass over the batches (tqdm's, where it
      is installed).

  Returns:
    An `Influence`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(w, x, y):
    ...   return jnp.mean(0.5 * jnp.sum((x @ w - y) ** 2, axis=-1))
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
    >>> y = x @ jnp.ones((3, 2))
    >>> w = jnp.zeros((3, 2))
    >>> influence = gl.fit_influence(loss, w, [(x[:4], y[:4]), (x[4:], y[4:])])
    >>> influence.scores([(x[:2], y[:2])], [(x, y)]).shape  # (queries, training)
    (2, 8)
  """
  factors = fit_factors(loss, params, batches, dict(
      strategy=strategy, damping=damping, projection=projection, argnums=argnums,
      batch_argnums=batch_argnums, sampled_loss=sampled_loss, key=key, progress=progress))
  return Influence(loss, params, factors, argnums=argnums, batch_argnums=batch_argnums)


@functools.lru_cache(maxsize=16)
def _steps_of(loss: Callable, argnums: int, batch_argnums) -> dict[Any, Callable]:
  """The jitted steps of the `Influence`s of one loss (its last 16 losses kept), by
  step: each takes the factors and parameters as arguments, so one compile serves
  every `Influence` of that loss at those shapes."""
  del loss, argnums, batch_argnums  # The key.
  return {}


def _joined(parts: list) -> Any:
  """The query batches' preconditioned gradients `parts`, joined along the queries'
  axis, emptying `parts`: each part's array is deleted once copied, so the device
  holds the whole once plus one array's parts, not the whole twice."""
  treedef = jax.tree.structure(parts[0])
  columns = list(zip(*(jax.tree.leaves(part) for part in parts)))
  single = len(parts) == 1
  parts.clear()
  out = []
  for column in columns:
    if single:
      out.append(column[0])
      continue
    out.append(jnp.concatenate(column, axis=1 if column[0].ndim == 4 else 0))
    for value in column:
      value.delete()
  return jax.tree.unflatten(treedef, out)


class Influence:
  """Influence scores of training examples, from fitted `InfluenceFactors`.

  Make one with `fit_influence`, or from saved factors with
  `Influence(loss, params, factors)`.

  Attributes:
    factors: the `InfluenceFactors`.
    params: the parameters they were fitted at.
  """

  def __init__(self, loss: Callable, params: Any, factors: InfluenceFactors, *,
               argnums: int = 0, batch_argnums: int | Sequence[int] | None = None):
    self.loss, self.params, self.factors = loss, params, factors
    self.argnums, self.batch_argnums = argnums, batch_argnums
    # Shared by every Influence of this loss: a new one compiles nothing anew.
    self._jitted = _batches.kept_per_loss(_steps_of, loss, argnums, batch_argnums)

  def __repr__(self) -> str:
    projected = "" if self.factors.projection is None else ", projected"
    return (f"Influence(strategy={self.factors.strategy!r}{projected}, blocks="
            f"{sorted(self.factors.blocks)})")

  def _preconditioned(self, fun: Callable, api: str, rank: int | None = None):
    """A jitted `(factors, params, batch) -> {block: (H + damping)^-1 g per example}`
    (in the blocks' rotated bases) for `fun`; with `rank`, a dense or convolution
    block's marked `Whole`, for `_low_rank.factorized`."""
    key = ("pre", _batches.cache_key(fun), rank)
    if key not in self._jitted:
      gradients = self._rotated_gradients(fun, api)

      def pre(factors, params, batch):
        out, layouts = gradients(factors, params, batch)
        out = {name: divide(factors, name, value) for name, value in out.items()}
        if rank is None or factors.strategy == "full":
          return out
        return {name: _low_rank.Whole(value) if layouts[name].kind == KRONECKER else value
                for name, value in out.items()}

      self._jitted[key] = jax.jit(pre)
    return self._jitted[key]

  def _rotated_gradients(self, fun: Callable, api: str):
    """`(factors, params, batch, raw=()) -> ({block: rotated per-example gradients},
    {block: Layout})` of `fun` (the blocks in `raw` as their records `(x, g)`), made
    once per function and API (its record_layers trace is then shared by the
    queries' and the training examples' steps of `scores`)."""
    key = ("gradients", _batches.cache_key(fun), api)
    if key not in self._jitted:
      self._jitted[key] = self._make_gradients(fun, api)
    return self._jitted[key]

  def _make_gradients(self, fun: Callable, api: str):
    passes = Pass(Gradients(api, fun, self.argnums, self.batch_argnums), api)

    def gradients(factors, params, batch, raw=()):
      out = {}
      arrays = passes.arrays(params, batch, factors.projection)
      layouts = passes.layouts[shapes(params, batch, factors.projection)]
      bad = []
      for name, value in arrays.items():
        layout = layouts[name]
        block = factors.blocks.get(name)
        keys = (name,) if layout.bias is None else (name, layout.bias)
        kind = (FullBlock if factors.strategy == "full" else
                DiagonalBlock if layout.kind == DIAGONAL else KroneckerBlock)
        if not isinstance(block, kind) or block.keys != keys:
          bad.append(repr(name))
        elif block_shape(block) != block_shape(value, layout, kind is FullBlock):
          bad.append(f"{name!r} (fitted with {block_shape(block)}, here "
                     f"{block_shape(value, layout, kind is FullBlock)})")
        elif kind is FullBlock:  # Rotated, as a `(S, B, D, 1)` Kronecker-like array.
          flat = flat_grads(layout, value)
          out[name] = _common.dot("sbd,sde->sbe", flat, block.q.astype(flat.dtype))[..., None]
        elif layout.kind == DIAGONAL or name in raw:
          out[name] = value
        else:
          out[name] = rotated(block, layout, value, rotate=factors.strategy != "identity")
      if bad:
        raise ValueError(
            f"{api}: the parameters {', '.join(bad)} are not covered by the fitted factors "
            f"as they are used here (blocks: {sorted(factors.blocks)}; a parameter used "
            "once more, or a different model, changes them). Score with the loss, "
            "parameters and model that fit_influence was given.")
      return out, layouts

    return gradients

  def _scored(self, api: str):
    key = ("score", api)
    if key not in self._jitted:
      gradients = self._rotated_gradients(self.loss, api)

      def score(factors, params, batch, queries):
        raw = tuple(name for name, q in queries.items() if isinstance(q, _low_rank.LowRank))
        train, _ = gradients(factors, params, batch, raw)
        total = 0.0
        for name, q in queries.items():
          t = train[name]
          total = total + (_low_rank.scores(q, *t) if name in raw else
                           _common.dot("sqio,stio->qt", q, t) if q.ndim == 4
                           else _common.dot("qn,tn->qt", q, t))
        return total

      self._jitted[key] = jax.jit(score)
    return self._jitted[key]

  def scores(self, query_batches: Iterable[Sequence[Any]],
             train_batches: Iterable[Sequence[Any]], *,
             measurement: Callable | None = None,
             query_block: int | None = None, query_rank: int | None = None,
             progress: bool = True) -> np.ndarray:
    """Returns `(n_query, n_train)`: `g_q^T (H + damping)^-1 g_t` per pair.

    Args:
      query_batches: batches of query examples, as `loss` takes them.
      train_batches: batches of training examples.
      measurement: what the query gradient is of, with `loss`'s signature and the
        mean over the batch of a per-example quantity (a margin, a logit), as
        Kronfluence's `compute_measurement`; default: `loss`.
      query_block: score at most this many queries at a time (whole query batches;
        a larger batch is a block of its own), each block reading the training
        batches again (then re-iterable), to bound memory (see the module
        docstring); `None`: every query at once.
      query_rank: keep each query's preconditioned gradient of a dense or
        convolution layer as its best rank-`query_rank` approximation `a b^T`
        (Kronfluence's `query_gradient_low_rank`; 32-64 for a language model),
        `query_rank x (d_in + d_out)` numbers instead of `d_in x d_out`, scored
        against the training examples' layer records without forming their
        gradients in the curvature's eigenbasis (`_low_rank.py`): all the queries
        of a large model fit at once, and the training batches are read once.
        Exact where `query_rank + 10 >= min(d_in, d_out)`; `None`: whole gradients.
      progress: show a progress bar of each pass over the training batches.

    Returns:
      A NumPy array: positive where training on the example lowers the query's
      loss (its measurement), negative where it raises it.
    """
    api = "Influence.scores"
    if query_block is not None and (not isinstance(query_block, int)
                                    or isinstance(query_block, bool) or query_block < 1):
      raise ValueError(f"{api}(query_block={query_block!r}): give a positive number of "
                       "queries, or None for all at once.")
    if query_rank is not None and (not isinstance(query_rank, int)
                                   or isinstance(query_rank, bool) or query_rank < 1):
      raise ValueError(f"{api}(query_rank={query_rank!r}): give a positive rank, or None "
                       "for the queries' whole gradients.")
    if query_block is not None and iter(train_batches) is train_batches:
      raise TypeError(f"{api}: `train_batches` is an iterator, which the first block of "
                      "queries would exhaust; pass a list (or another re-iterable).")
    pre = self._preconditioned(measurement or self.loss, api, query_rank)
    score = self._scored(api)

    def rows(parts):
      queries = _joined(parts)
      shown = _batches.progress(train_batches, f"{api}: training batches", progress)
      # Read back at the end: the device works while the host waits.
      columns = list(_batches.one_ahead(
          score(self.factors, self.params, _batches.as_args(api, b, f"train_batches[{i}]"),
                queries) for i, b in enumerate(shown)))
      if not columns:
        raise ValueError(f"{api}: train_batches is empty; pass at least one batch.")
      return np.concatenate([np.asarray(c) for c in columns], axis=1)

    blocks, parts, held = [], [], 0
    for i, batch in enumerate(query_batches):
      batch = _batches.as_args(api, batch, f"query_batches[{i}]")
      size = _batches.size(batch)
      if parts and query_block is not None and held + size > query_block:
        blocks.append(rows(parts))
        held = 0
      part = pre(self.factors, self.params, batch)
      if query_rank is not None:  # Not kept: the whole gradients are the largest.
        part = _low_rank.factorized(part, self.factors.blocks, query_rank)
      parts.append(part)
      held += size
    if not parts:
      raise ValueError(f"{api}: query_batches is empty; pass at least one batch.")
    blocks.append(rows(parts))
    return np.concatenate(blocks, axis=0)

  def self_influence(self, batches: Iterable[Sequence[Any]], *,
                     progress: bool = True) -> np.ndarray:
    """Returns `(n,)`: `g_t^T (H + damping)^-1 g_t` per example (large for
    examples the model finds surprising: often mislabelled ones).

    Args:
      batches: batches of training examples, as `fit_influence` takes them.
      progress: show a progress bar of the pass over the batches.
    """
    api = "Influence.self_influence"
    key = ("self", api)
    if key not in self._jitted:
      gradients = self._rotated_gradients(self.loss, api)

      def own(factors, params, batch):
        out, _ = gradients(factors, params, batch)
        total = 0.0
        for name, g in out.items():
          p = divide(factors, name, g)
          total = total + (jnp.sum(p * g, axis=(0, 2, 3)) if g.ndim == 4
                           else jnp.sum(p * g, axis=1))
        return total

      self._jitted[key] = jax.jit(own)
    shown = _batches.progress(batches, api, progress)
    values = list(_batches.one_ahead(
        self._jitted[key](self.factors, self.params, _batches.as_args(api, b, f"batches[{i}]"))
        for i, b in enumerate(shown)))
    if not values:
      raise ValueError(f"{api}: batches is empty; pass at least one batch.")
    return np.concatenate([np.asarray(v) for v in values])

  @staticmethod
  def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns `(helpful, harmful)`, each `(n_query, k)` training indices: the k
    largest scores per query (most helpful first) and the k smallest (most harmful
    first)."""
    scores = np.asarray(scores)
    if scores.ndim != 2 or not 1 <= k <= scores.shape[1]:
      raise ValueError(f"Influence.top_k: expected (n_query, n_train) scores and 1 <= k "
                       f"<= n_train; got shape {scores.shape} and k={k}.")
    order = np.argsort(-scores, axis=1, kind="stable")
    return order[:, :k], np.argsort(scores, axis=1, kind="stable")[:, :k]
