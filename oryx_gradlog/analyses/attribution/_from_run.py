"""Attribution from a training run's own log: TracIn, influence and the examples
behind a loss spike, from the projected per-example gradients (`gl.projected_grads`)
that each step logged, without running the model again.

A run for these logs, at every step (names are the defaults of the arguments):

* `"train"`: the step's `ProjectedGrads` of its batch (before the update);
* `"ids"`: `(B,)` integer ids of the batch's training examples;
* `"lr"`: the learning rate the step's update used;
* `"loss"`: the batch loss (for `loss_spikes`);
* `"losses"`: `(B,)` the batch's per-example losses, whose mean is `"loss"` (for
  `loss_spikes` to name a spike's own examples);
* `"query"`: for `tracin`, the `ProjectedGrads` of a fixed set of query examples at
  the same parameters.

`tracin` is TracIn-CP (Pruthi et al. 2020) over the logged steps:
`score(q, z) = sum_t lr_t <g_t(q), g_t(z)>` over the steps `t` whose batch held `z`
(the first-order change of q's loss that training on z caused, with the sign that
makes a helpful example positive). `tracin_self_influence` is `sum_t lr_t |g_t(z)|^2`
(large for examples the model keeps fighting: often mislabelled ones).

`influence_from_run` is `fit_influence(..., strategy="full", projection=...)` from
the logged gradients of some steps (an evaluation pass over the training set at the
final parameters, logged with the learning rate 0, or the last epoch): each block's
Fisher from their training gradients, and the scores of the last of those steps'
query gradients against every training example.

`loss_spikes` finds the logged steps whose loss rose most above the median of the
steps before, and for each splits the rise among the previous step's examples: example `i` of batch
`t - 1` contributes `-lr_{t-1} / B <g_{t-1}(i), mean_j g_t(j)>`, its share of the
first-order change that the update of step `t - 1` (plain gradient descent) made to
the loss of batch `t`. A rise that this does not explain (`LossSpike.explained`
well below `LossSpike.rise`) is batch `t`'s own: a batch of unusual or mislabelled
examples has a high loss before any update (and the next step's rise is then its
update's). Where the run logged per-example losses, each of batch `t`'s own examples
gets its share of the rise, `(l_t(i) - baseline) / B` (they add up to the rise), and
`LossSpike.own_ids` ranks them by it.

Sharp edges:
  * Inner products are of the projected gradients (LoGra): with `k x k` per layer
    they approximate the whole gradients' (exact where every side is at most `k`).
  * `tracin` from projected gradients, `tracin_self_influence` and the
    contributions to a spike assume an SGD update `-lr * mean_i g_i`; with momentum
    or Adam they are those of the step's gradient alone. For Adam, `tracin(...,
    products=...)` reads the logged products of each query's preconditioned
    gradient with the batch's (`gl.adam_preconditioner`), and
    `tracin_self_influence(..., self_products=...)` each example's with its own.
  * A spike needs two consecutive logged steps (`t - 1` and `t`): log every step.
  * Each block is read whole, `steps x B x k x k` floats at a time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from oryx_gradlog import _repr
from oryx_gradlog.analyses.attribution._factors import fisher_eigenbasis
from oryx_gradlog.storage._store import open_run


def _dataset(run: Any):
  return open_run(run) if isinstance(run, (str, os.PathLike)) else run


def _blocks(api: str, dataset, key: str, steps=slice(None)) -> dict[str, np.ndarray]:
  """Per block, `(steps, n, S, D)`: the `ProjectedGrads` logged under `key`, each
  layer's gradient flattened (a diagonal block's `S` is 1)."""
  prefix = f"{key}.grads."
  names = sorted(str(n) for n in dataset.data_vars if str(n).startswith(prefix))
  if not names:
    raise ValueError(
        f"{api}: the run has no projected gradients under {key!r} (no variable "
        f"{prefix}...; its variables: {sorted(map(str, dataset.data_vars))[:12]}). Log "
        f"gl.projected_grads(records, projector) at every step, e.g. log.append(step, "
        f"{{{key!r}: projected, ...}}), or pass the key you logged them under.")
  out = {}
  for name in names:
    values = np.asarray(dataset[name].values[steps], np.float64)
    out[name[len(prefix):]] = (values.reshape(values.shape[:3] + (-1,)) if values.ndim == 5
                               else values[:, :, None])
  return out


def _grads(api: str, dataset, key: str) -> np.ndarray:
  """`(steps, n, D)`: the `ProjectedGrads` logged under `key`, every block flattened
  and concatenated in sorted block order."""
  blocks = _blocks(api, dataset, key)
  return np.concatenate([v.reshape(v.shape[:2] + (-1,)) for _, v in sorted(blocks.items())],
                        axis=2)


def _series(api: str, dataset, key: str, what: str) -> np.ndarray:
  if key not in dataset:
    raise ValueError(f"{api}: the run has no {what} {key!r}; log it at every step "
                     f"(log.append(step, {{{key!r}: ...}})) or pass the key it has.")
  return np.asarray(dataset[key].values)


def _ids(api: str, dataset, key: str, batch: int) -> np.ndarray:
  ids = _series(api, dataset, key, "example ids")
  if ids.ndim != 2 or ids.shape[1] != batch or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{api}: {key!r} must be each step's (B,) integer example ids, "
                     f"B = {batch} as the gradients'; got {ids.dtype} {ids.shape[1:]}.")
  if ids.min() < 0:
    raise ValueError(f"{api}: {key!r} holds negative ids; ids index the training set.")
  return ids


def _count(api: str, example: np.ndarray, num_examples: int | None) -> int:
  """The training set's size: `num_examples`, checked against the ids, or the
  largest id + 1."""
  if num_examples is None:
    return int(example.max()) + 1
  if example.max() >= num_examples:
    raise ValueError(f"{api}(num_examples={num_examples}): the run has ids up to "
                     f"{example.max()}; pass the training set's size, or None.")
  return num_examples


def tracin(run: Any, *, train: str = "train", query: str = "query", ids: str = "ids",
           lr: str = "lr", num_examples: int | None = None,
           products: str | None = None) -> np.ndarray:
  """Returns `(n_query, num_examples)` TracIn scores over the logged steps.

  Plain SGD's scores `sum_t lr_t <g_t(q), g_t(z)>` come from the logged projected
  gradients of the training batch and of the queries. For another optimiser, log at
  each step the products of the queries' step directions with the batch's
  gradients and pass their key as `products`: with Adam, `<P_t g_t(q), g_t(z)>`
  (`gl.adam_preconditioner` for `P_t`, `gl.per_example_products` for the products);
  the scores are then `sum_t lr_t` times those, exact up to the momentum's spread
  (see `gl.adam_preconditioner`).

  Args:
    run: a run folder written by `gl.RunLog`, or `gl.open_run`'s dataset.
    train: the key of each step's training `ProjectedGrads`.
    query: the key of each step's query `ProjectedGrads`.
    ids: the key of each step's example ids.
    lr: the key of each step's learning rate.
    num_examples: the training set's size (default: the largest id + 1).
    products: the key of each step's `(n_query, B)` products of the queries' step
      directions with the batch's per-example gradients; where given, `train` and
      `query` are not read.

  Returns:
    A NumPy array: positive where training on the example lowered the query's loss.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.sum((x @ p["w"]) ** 2, axis=-1))
    >>> params, x = {"w": jnp.ones((3, 2))}, jnp.eye(3)
    >>> projector = gl.fit_projector(loss, params, [(x,)], k=4)  # k >= 3: exact
    >>> grads = lambda x: gl.projected_grads(
    ...     gl.reap(jax.grad(gl.record_layers(loss)))(params, x), projector)
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   log.append(0, {"train": grads(x), "query": grads(x[:1]),
    ...                  "ids": jnp.arange(3), "lr": jnp.float32(0.1)})
    >>> gl.tracin(run_dir).round(2)  # 0.1 <g(q), g(z)>: 0.1 * (4 * 2)
    array([[0.8, 0. , 0. ]])
  """
  api = "tracin"
  dataset = _dataset(run)
  if products is None:
    t, q = _grads(api, dataset, train), _grads(api, dataset, query)
    if t.shape[2] != q.shape[2]:
      raise ValueError(f"{api}: the query and training gradients have {q.shape[2]} and "
                       f"{t.shape[2]} numbers; log both with the same projector.")
    step_scores = lambda step: q[step] @ t[step].T
    n_query, batch = q.shape[1], t.shape[1]
  else:
    p = _series(api, dataset, products, "per-example products").astype(np.float64)
    if p.ndim != 3:
      raise ValueError(f"{api}(products={products!r}): each step's products must be "
                       f"(n_query, B), got {p.shape[1:]}; log jax.vmap of "
                       "gl.per_example_products over the queries' directions.")
    step_scores = lambda step: p[step]
    n_query, batch = p.shape[1:]
  example = _ids(api, dataset, ids, batch)
  rate = _series(api, dataset, lr, "learning rate").astype(np.float64)
  n = _count(api, example, num_examples)
  scores = np.zeros((n_query, n))
  for step in range(len(example)):
    if not np.isfinite(rate[step]):  # A step that logged no learning rate.
      continue
    np.add.at(scores.T, example[step], rate[step] * step_scores(step).T)
  return scores


def tracin_self_influence(run: Any, *, train: str = "train", ids: str = "ids",
                          lr: str = "lr", num_examples: int | None = None,
                          self_products: str | None = None) -> np.ndarray:
  """Returns `(num_examples,)`: `sum_t lr_t |g_t(z)|^2` over the logged steps.

  Plain SGD's self-influence comes from the logged projected gradients of the
  training batch. For another optimiser, log at each step each example's gradient
  against its own step direction and pass their key as `self_products`: with Adam,
  `<g_t(z), P_t g_t(z)>` (`gl.per_example_self_products` with
  `gl.adam_preconditioner`'s `P_t`), summed as `sum_t lr_t` times those.

  Args:
    run: a run folder written by `gl.RunLog`, or `gl.open_run`'s dataset.
    train: the key of each step's training `ProjectedGrads`.
    ids: the key of each step's example ids.
    lr: the key of each step's learning rate.
    num_examples: the training set's size (default: the largest id + 1).
    self_products: the key of each step's `(B,)` self-products of the batch's
      per-example gradients; where given, `train` is not read.

  Returns:
    A NumPy array: large for examples the training kept pushing against.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.sum((x @ p["w"]) ** 2, axis=-1))
    >>> params, x = {"w": jnp.ones((3, 2))}, jnp.eye(3)
    >>> projector = gl.fit_projector(loss, params, [(x,)], k=4)
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   log.append(0, {"train": gl.projected_grads(records, projector),
    ...                  "ids": jnp.arange(3), "lr": jnp.float32(0.1)})
    >>> gl.tracin_self_influence(run_dir).round(2)  # 0.1 |g|^2: 0.1 * 8 each
    array([0.8, 0.8, 0.8])
  """
  api = "tracin_self_influence"
  dataset = _dataset(run)
  if self_products is None:
    squares = np.sum(_grads(api, dataset, train) ** 2, axis=2)
  else:
    squares = _series(api, dataset, self_products, "per-example self-products")
    if squares.ndim != 2:
      raise ValueError(f"{api}(self_products={self_products!r}): each step's "
                       f"self-products must be (B,), got {squares.shape[1:]}; log "
                       "gl.per_example_self_products(records, preconditioner).")
    squares = squares.astype(np.float64)
  example = _ids(api, dataset, ids, squares.shape[1])
  rate = _series(api, dataset, lr, "learning rate").astype(np.float64)
  n = _count(api, example, num_examples)
  own = np.zeros(n)
  for step in range(squares.shape[0]):
    if np.isfinite(rate[step]):
      np.add.at(own, example[step], rate[step] * squares[step])
  return own


def influence_from_run(run: Any, *, steps: Any = None, train: str = "train",
                       query: str = "query", ids: str = "ids", damping: float | None = None,
                       num_examples: int | None = None) -> np.ndarray:
  """Returns `(n_query, num_examples)` influence scores from logged projected gradients.

  As `gl.fit_influence(loss, params, batches, strategy="full", projection=projector)
  .scores(queries, batches)`, for steps that logged every training example at the
  same parameters (see the module docstring), without the model.

  Args:
    run: a run folder written by `gl.RunLog`, or `gl.open_run`'s dataset.
    steps: the logged steps to use, a slice or indices into the run's steps
      (default: all).
    train: the key of each step's training `ProjectedGrads`.
    query: the key of the query `ProjectedGrads` (those of the last step used).
    ids: the key of each step's example ids.
    damping: added to every eigenvalue; `None` for 0.1 x each block's mean.
    num_examples: the training set's size (default: the largest id + 1).

  Returns:
    A NumPy array: positive where training on the example lowers the query's loss.
    An example logged at several of the steps gets the mean of its scores.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.sum(jnp.tanh(x @ p["w"]) ** 2, axis=-1))
    >>> params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 8)) / 3}
    >>> x = jax.random.normal(jax.random.PRNGKey(1), (12, 8))
    >>> projector = gl.fit_projector(loss, params, [(x,)], k=2)
    >>> grads = lambda x: gl.projected_grads(
    ...     gl.reap(jax.grad(gl.record_layers(loss)))(params, x), projector)
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:  # An influence pass: every example, lr 0.
    ...   for step in range(3):
    ...     rows = jnp.arange(4) + 4 * step
    ...     log.append(step, {"train": grads(x[rows]), "query": grads(x[:2]),
    ...                       "ids": rows, "lr": jnp.float32(0.0)})
    >>> gl.influence_from_run(run_dir).shape  # (queries, training examples)
    (2, 12)
  """
  api = "influence_from_run"
  dataset = _dataset(run)
  chosen = slice(None) if steps is None else steps
  train_blocks = _blocks(api, dataset, train, chosen)
  query_blocks = {name: v[-1] for name, v in _blocks(api, dataset, query, chosen).items()}
  if set(train_blocks) != set(query_blocks):
    raise ValueError(f"{api}: the query and training gradients have other blocks "
                     f"({sorted(query_blocks)} and {sorted(train_blocks)}); log both with "
                     "the same projector.")
  first = next(iter(train_blocks.values()))
  example = _ids(api, dataset, ids, first.shape[1])[chosen].reshape(-1)
  n = _count(api, example, num_examples)
  total = 0.0
  for name, grads in train_blocks.items():
    grads = grads.reshape((-1,) + grads.shape[2:])  # (N, S, D)
    fisher = np.einsum("nsd,nse->sde", grads, grads) / grads.shape[0]
    q, eig, damp = fisher_eigenbasis(fisher, damping)
    rotated = np.einsum("nsd,sde->nse", grads, q)
    pre = np.einsum("qsd,sde->qse", query_blocks[name], q) / (eig + damp[:, None])
    total = total + np.einsum("qse,nse->qn", pre, rotated)
  scores, counts = np.zeros((total.shape[0], n)), np.zeros(n)
  np.add.at(scores.T, example, total.T)
  np.add.at(counts, example, 1)
  return scores / np.maximum(counts, 1)


@dataclasses.dataclass(frozen=True)
class LossSpike:
  """A rise of the logged loss: the examples of the step before whose update caused
  it, and the spiking batch's own examples.

  Attributes:
    step: the step whose loss rose.
    rise: its loss minus the median loss of the steps before it (`window`).
    cause: the step before, whose update the rise is split among.
    ids: that step's example ids, the largest contribution first.
    contributions: each one's first-order share of the rise (positive: pushed the
      loss up).
    explained: their sum, the first-order rise that the update of `cause` made.
      Much less than `rise`: the rise is the batch of `step`'s own (its examples
      are unusual, or mislabelled), not the update's.
    own_ids: the example ids of `step`'s own batch, the largest share first; `None`
      where the run logged no per-example losses.
    own_shares: each one's share of the rise, `(its loss - baseline) / B` (they add
      up to `rise`); `None` with `own_ids`.
  """

  __repr__ = _repr.dataclass_repr

  step: int
  rise: float
  cause: int
  ids: np.ndarray
  contributions: np.ndarray
  explained: float
  own_ids: np.ndarray | None = None
  own_shares: np.ndarray | None = None


def _baseline(values: np.ndarray, j: int, window: int) -> float:
  """The median of the finite losses of the `window` steps before step `j`."""
  before = values[max(0, j - window):j]
  return float(np.median(before[np.isfinite(before)]))


def loss_spikes(run: Any, *, top: int = 3, window: int = 5, loss: str = "loss",
                train: str = "train", ids: str = "ids", lr: str = "lr",
                losses: str = "losses") -> list[LossSpike]:
  """Returns the `top` largest rises of the logged loss, each split among the
  examples of the step before and, where the run logged per-example losses, among
  the spiking batch's own examples (see the module docstring).

  Args:
    run: a run folder written by `gl.RunLog`, or `gl.open_run`'s dataset.
    top: how many rises, largest first.
    window: a step's rise is its loss less the median loss of the `window` steps
      before it (robust to one of them being a spike itself).
    loss: the key of each step's batch loss.
    train: the key of each step's training `ProjectedGrads`.
    ids: the key of each step's example ids.
    lr: the key of each step's learning rate.
    losses: the key of each step's `(B,)` per-example losses (optional: without it
      a spike's own examples are not named).

  Returns:
    A list of `LossSpike`, the largest rise first (only rises: fewer than `top`
    where the loss rose less often).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda p, x: jnp.mean(jnp.sum((x @ p["w"]) ** 2, axis=-1))
    >>> params, x = {"w": jnp.ones((3, 2))}, jnp.eye(3)
    >>> projector = gl.fit_projector(loss, params, [(x,)], k=4)
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(params, x)
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   for step, value in enumerate([1.0, 4.0]):  # The loss rises at step 1.
    ...     log.append(step, {"train": gl.projected_grads(records, projector),
    ...                       "ids": jnp.arange(3), "lr": jnp.float32(0.1),
    ...                       "loss": jnp.float32(value)})
    >>> [(s.step, s.cause, s.rise, s.ids.tolist()) for s in gl.loss_spikes(run_dir)]
    [(1, 0, 3.0, [0, 1, 2])]
  """
  api = "loss_spikes"
  if not (isinstance(top, int) and top >= 1):
    raise ValueError(f"{api}(top={top!r}): top is how many rises to return, an int >= 1.")
  dataset = _dataset(run)
  values = _series(api, dataset, loss, "loss").astype(np.float64)
  steps = np.asarray(dataset["step"].values)
  pairs = [j for j in range(1, len(steps)) if steps[j] == steps[j - 1] + 1
           and np.isfinite(values[j]) and np.isfinite(values[j - 1])]
  if not pairs:
    raise ValueError(f"{api}: the run has no two consecutive steps with a logged loss "
                     f"(steps {steps[:8].tolist()}...); log every step.")
  rise = {j: values[j] - _baseline(values, j, window) for j in pairs}
  rises = sorted((j for j in pairs if rise[j] > 0), key=lambda j: -rise[j])[:top]
  if not rises:
    return []
  t = _grads(api, dataset, train)
  example = _ids(api, dataset, ids, t.shape[1])
  rate = _series(api, dataset, lr, "learning rate").astype(np.float64)
  own = (_series(api, dataset, losses, "per-example losses").astype(np.float64)
         if losses in dataset else None)
  if own is not None and own.shape != example.shape:
    raise ValueError(f"{api}: {losses!r} has shape {own.shape[1:]} a step but {ids!r} "
                     f"{example.shape[1:]}; log each example's loss, (B,), beside its id.")
  spikes = []
  for j in rises:
    share = -rate[j - 1] / t.shape[1] * (t[j - 1] @ t[j].mean(axis=0))
    order = np.argsort(-share, kind="stable")
    own_ids = own_shares = None
    if own is not None:
      own_shares = (own[j] - (values[j] - rise[j])) / own.shape[1]
      ranked = np.argsort(-own_shares, kind="stable")
      own_ids, own_shares = example[j][ranked], own_shares[ranked]
    spikes.append(LossSpike(int(steps[j]), float(rise[j]),
                            int(steps[j - 1]), example[j - 1][order], share[order],
                            float(share.sum()), own_ids, own_shares))
  return spikes
