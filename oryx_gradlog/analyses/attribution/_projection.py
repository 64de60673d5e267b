"""LoGra's projected per-example gradients (Choe et al. 2024, LogIX): small enough
to log at every training step.

A dense or convolution layer's per-example gradient is `G_i = sum_t a_it g_it^T`
(`d_in x d_out`); LoGra keeps `P_in^T G_i P_out = sum_t (P_in^T a_it)(P_out^T g_it)^T`
(`k x k`), computed from the projected layer inputs and output cotangents, so
`G_i` is never formed. `fit_projector` makes the projections of every block (the
blocks of `fit_influence`: a layer's weight with its bias, or one other parameter);
`projected_grads` applies them to the records of one backward pass, inside a
jitted training step; `fit_influence(projection=...)` fits and scores influence in
the projected space.

* `init="random"`: Gaussian `P` with entries of variance `1/k` (inner products are
  kept in expectation), seeded. `init="pca"`: the top `k` eigenvectors of each
  block's covariances `A` (inputs) and `S` (cotangents), LoGra's initialisation,
  from one pass over the batches given; an embedding's `A` is diagonal, so its
  projection keeps the `k` most frequent ids.
* A side of at most `k` dimensions is kept whole (`None`: no projection, exact),
  as is a diagonal block of at most `k * k` numbers. A larger diagonal block (a
  position embedding, a norm's scales) is projected to `k * k`: `"random"` lays
  its `n` numbers out as a near-square `n1 x n2` grid (zero-padded) and keeps
  `P_1^T V P_2`, two Gaussians of `(n1 + n2) k` numbers rather than one of `n k^2`
  (GPT-2's position embedding: 80 K numbers, not 1.6 G); `"pca"` keeps its `k * k`
  coordinates of largest mean square (a mask).

Sharp edges:
  * A convolution's inputs are its unfolded patches (`d_in` = kernel size x input
    channels), as in `fit_influence`: they are formed per example and position.
  * The projection is fitted for one model: `projected_grads` of records whose
    blocks differ (another parameter, a new use) is an error naming them.
  * `"pca"` reads the batches once; the eigenvectors are computed in float64 on the
    host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog import _repr
from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.attribution import _batches
from oryx_gradlog.analyses.attribution._blocks import (
    DIAGONAL, KRONECKER, Gradients, Layout, block_arrays, factor_sums, per_example, summed)
from oryx_gradlog.record._kinds import EMBED

INITS = ("random", "pca")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks"],
                   meta_fields=["k", "init"])
@dataclasses.dataclass(frozen=True)
class Projector:
  """LoGra's projections of every block, a frozen pytree of arrays.

  Attributes:
    blocks: per block name (its weight's parameter path), `(P_in, P_out)`: for a
      Kronecker block `(S, d_in(+1), k)` and `(S, d_out, k)` (one per layer `S` of
      a scan-stacked use; an embedding's `P_in` is `(S, vocabulary, k)`); for a
      diagonal block its grid's `(n1, k)` and `(n2, k)` (`"random"`) or a
      `(size,)` mask and `None` (`"pca"`); `None` where a side is kept whole.
    k: the projected dimension of each side.
    init: `"random"` or `"pca"`.

  A convolution's `P_in` rows are in the order of its unfolded patches
  (`lax.conv_general_dilated_patches`: input channels major, then the kernel's
  positions), with the bias's row last.
  """

  __repr__ = _repr.dataclass_repr

  blocks: dict[str, tuple[jax.Array | None, jax.Array | None]]
  k: int
  init: str


@functools.partial(jax.tree_util.register_dataclass, data_fields=["grads"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ProjectedGrads:
  """Projected per-example gradients of one batch, of the per-example losses.

  Attributes:
    grads: per block, a Kronecker block's `(B, S, k_in, k_out)` (`P_in^T G_i
      P_out` per layer of a stacked use), a diagonal block's `(B, k * k)` (or its
      whole `(B, size)`).
  """

  __repr__ = _repr.dataclass_repr

  grads: dict[str, jax.Array]

  def flat(self) -> jax.Array:
    """`(B, D)`: every block's projected gradient, flattened and concatenated in
    sorted block order (inner products of examples are those of the blocks)."""
    return jnp.concatenate([self.grads[name].reshape(self.grads[name].shape[0], -1)
                            for name in sorted(self.grads)], axis=1)


def _sizes(value, layout: Layout) -> tuple[int, ...]:
  """A block's sizes that its projections meet: `(layers, d_in(+1), d_out)` (an
  embedding's d_in its vocabulary), a diagonal block's `(n,)`."""
  if layout.kind == DIAGONAL:
    return (value.shape[1],)
  x, g = value
  d_in = layout.vocabulary if layout.kind == EMBED else x.shape[-1]
  return (g.shape[0], d_in, g.shape[-1])


def _check_blocks(api: str, projector: Projector, arrays: dict[str, Any],
                  layout: dict[str, Layout]) -> None:
  missing = sorted(set(layout) - set(projector.blocks))
  extra = sorted(set(projector.blocks) - set(layout))
  wrong = []
  for name in sorted(set(layout) & set(projector.blocks)):
    here = _sizes(arrays[name], layout[name])
    p_in, p_out = projector.blocks[name]
    if layout[name].kind == DIAGONAL and p_in is not None and p_out is not None:
      grid = (p_in.shape[0], p_out.shape[0])
      fitted = here if grid == _grid(here[0]) else f"a {grid[0]} x {grid[1]} grid"
    elif layout[name].kind == DIAGONAL and p_in is not None and p_in.ndim != 1:
      fitted = "a dense projection, from an older oryx_gradlog"
    elif layout[name].kind == DIAGONAL:
      fitted = here if p_in is None else (p_in.shape[0],)
    else:
      layers = next((p.shape[0] for p in (p_in, p_out) if p is not None), here[0])
      fitted = (layers, here[1] if p_in is None else p_in.shape[-2],
                here[2] if p_out is None else p_out.shape[-2])
    if fitted != here:
      wrong.append(f"{name!r} (fitted for {fitted}, here {here})")
  if missing or extra or wrong:
    raise ValueError(
        f"{api}: the projector was fitted for other blocks (here without a projection: "
        f"{missing}; fitted but not here: {extra}; of other sizes: {wrong or 'none'}). "
        "Fit the projector with the loss and model whose records you project "
        "(gl.fit_projector).")


def project(api: str, projector: Projector, arrays: dict[str, Any],
            layout: dict[str, Layout]) -> tuple[dict[str, Any], dict[str, Layout]]:
  """The blocks' arrays (`_blocks.block_arrays`) with their projections applied:
  Kronecker `(x P_in, g P_out)`, an embedding's `P_in` rows at its ids (a dense
  block from then on, unless its `P_in` is `None`), diagonal `_diagonal`'s."""
  _check_blocks(api, projector, arrays, layout)
  out, new_layout = {}, {}
  for name, value in arrays.items():
    p_in, p_out = projector.blocks[name]
    kind = layout[name].kind
    if kind == DIAGONAL:
      out[name] = _diagonal(value, p_in, p_out, projector.k)
      new_layout[name] = layout[name]
      continue
    x, g = value
    if p_out is not None:
      g = _common.dot("sbto,sok->sbtk", g, p_out.astype(g.dtype))
    if kind == EMBED and p_in is not None:  # The one-hot rows of P_in: a gather.
      x = jax.vmap(lambda p, ids: p[ids])(p_in.astype(g.dtype), x)
      kind = KRONECKER
    elif kind != EMBED and p_in is not None:
      x = _common.dot("sbti,sik->sbtk", x, p_in.astype(x.dtype))
    out[name] = (x, g)
    new_layout[name] = layout[name]._replace(kind=kind)
  return out, new_layout


def _grid(n: int) -> tuple[int, int]:
  """The near-square grid `(n1, n2)`, `n1 = ceil(sqrt(n))`, that a diagonal block of
  `n` numbers is laid out in (zero-padded) for its random projection."""
  n1 = math.isqrt(n - 1) + 1
  return n1, -(-n // n1)


def _diagonal(value: jax.Array, p_in, p_out, k: int) -> jax.Array:
  """A diagonal block's per-example gradients `(B, n)` projected: whole (`p_in`
  `None`), the coordinates of a mask, or `P_1^T V P_2` of its grid, `(B, k * k)`."""
  if p_in is None:
    return value
  if p_out is None:
    return value[:, jnp.nonzero(p_in, size=k * k)[0]]
  (n1, _), n2 = p_in.shape, p_out.shape[0]
  grid = jnp.pad(value, ((0, 0), (0, n1 * n2 - value.shape[1]))).reshape(-1, n1, n2)
  left = _common.dot("bij,ik->bkj", grid, p_in.astype(value.dtype))
  return _common.dot("bkj,jl->bkl", left, p_out.astype(value.dtype)).reshape(-1, k * k)


def projected_grads(records: dict, projector: Projector) -> ProjectedGrads:
  """Returns LoGra's projected per-example gradients of one backward pass's records.

  For use inside a jitted training step, on the records of `gl.record_layers` (or of
  hand-marked layers), to log every step's per-example gradients at `k x k` numbers
  per layer.

  Args:
    records: the records of one backward pass of a loss that is the mean over the
      batch of per-example losses.
    projector: from `gl.fit_projector`, for this model.

  Returns:
    A `ProjectedGrads` of the per-example losses' gradients.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> def loss(w, x):
    ...   return jnp.mean(jnp.sum(jnp.tanh(x @ w["w"]) ** 2, axis=-1))
    >>> w, x = {"w": jnp.ones((40, 30)) / 40}, jnp.ones((8, 40))
    >>> projector = gl.fit_projector(loss, w, [(x,)], k=4)
    >>> records = gl.reap(jax.grad(gl.record_layers(loss)))(w, x)
    >>> gl.projected_grads(records, projector).grads["w"].shape  # (B, layers, k, k)
    (8, 1, 4, 4)
  """
  api = "projected_grads"
  arrays, layout = block_arrays(api, records)
  arrays, layout = project(api, projector, arrays, layout)
  grads = {name: per_example(layout[name], value) for name, value in arrays.items()}
  return ProjectedGrads({name: g if layout[name].kind == DIAGONAL else jnp.swapaxes(g, 0, 1)
                         for name, g in grads.items()})


def _top(matrix: np.ndarray, k: int) -> np.ndarray:
  """The eigenvectors of the `k` largest eigenvalues of each `(S, d, d)` matrix."""
  _, vectors = np.linalg.eigh(matrix)
  return vectors[..., ::-1][..., :k].copy()


def _columns(indices: np.ndarray, size: int) -> np.ndarray:
  """`(..., size, k)` one-hot columns at `indices` `(..., k)`."""
  return (np.arange(size)[:, None] == indices[..., None, :]).astype(np.float64)


def fit_projector(
    loss: Callable[..., jax.Array],
    params: Any,
    batches: Iterable[Sequence[Any]],
    *,
    k: int = 16,
    init: str = "random",
    seed: int = 0,
    argnums: int = 0,
    batch_argnums: int | Sequence[int] | None = None,
) -> Projector:
  """Fits LoGra's projections of every block of `loss` (see the module docstring).

  Args:
    loss: the batch loss, `loss(params, *batch)`, as for `gl.fit_influence`.
    params: the parameters (`"pca"` computes the covariances there).
    batches: batch tuples: `"random"` reads the first one's shapes only, `"pca"`
      all of them, once.
    k: the projected dimension of each side of a layer (`k x k` per layer).
    init: `"random"` (seeded Gaussian) or `"pca"` (top eigenvectors).
    seed: the random projections' seed.
    argnums: the positional argument holding the parameters.
    batch_argnums: the arguments holding the batch (default: all others).

  Returns:
    A `Projector`.

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(jnp.sum((x @ w["w"]) ** 2, axis=-1))
    >>> w, x = {"w": jnp.ones((40, 30))}, jnp.ones((8, 40))
    >>> projector = gl.fit_projector(loss, w, [(x,)], k=4)
    >>> [p.shape for p in projector.blocks["w"]]  # P_in, P_out of the one layer
    [(1, 40, 4), (1, 30, 4)]
  """
  api = "fit_projector"
  if init not in INITS:
    raise ValueError(f"{api}(init={init!r}): init must be 'random' (seeded Gaussian "
                     "projections) or 'pca' (the top eigenvectors of each layer's "
                     "covariances, from one pass over the batches).")
  if not (isinstance(k, int) and k >= 1):
    raise ValueError(f"{api}(k={k!r}): k is the projected size of each side of a "
                     "layer, an int >= 1 (LoGra uses 16 to 64).")
  if not isinstance(argnums, int):
    raise TypeError(f"{api}(argnums={argnums!r}): one positional argument holds the "
                    "parameters (an int); gather several into one tree.")
  _batches.check_params(api, params)
  gradients = Gradients(api, loss, argnums, batch_argnums)
  layout: dict[str, Layout] = {}  # Filled when `arrays` is traced.

  def arrays(params, batch):
    out, found = gradients.arrays(params, batch)
    layout.update(found)
    return out

  if init == "random":  # The first batch's shapes are all it needs.
    first = next(iter(batches), None)
    if first is None:
      raise ValueError(f"{api}: `batches` is empty; pass at least one batch.")
    return _random(jax.eval_shape(arrays, params, _batches.as_args(api, first, "batches[0]")),
                   layout, k, seed)
  def covariances(params, batch):
    return {name: factor_sums(layout[name], value)
            for name, value in arrays(params, batch).items()}

  jitted = jax.jit(covariances)
  sums = summed(jitted(params, _batches.as_args(api, batch, f"batches[{i}]"))
                for i, batch in enumerate(batches))
  if sums is None:
    raise ValueError(f"{api}: `batches` is empty; pass at least one batch.")
  return _pca(sums, layout, k)


def _gaussian(key, *shape) -> jax.Array:
  """Entries of variance `1 / k` (`k` the last axis): inner products kept in
  expectation."""
  return jax.random.normal(key, shape) / np.sqrt(shape[-1])


def _random(shapes, layout: dict[str, Layout], k: int, seed: int) -> Projector:
  blocks = {}
  for i, name in enumerate(sorted(shapes)):
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    if layout[name].kind == DIAGONAL:
      size = shapes[name].shape[1]
      if size <= k * k:
        blocks[name] = (None, None)
        continue
      (n1, n2), (key_1, key_2) = _grid(size), jax.random.split(key)
      blocks[name] = (_gaussian(key_1, n1, k), _gaussian(key_2, n2, k))
      continue
    x, g = shapes[name]
    stacks, d_out = g.shape[0], g.shape[-1]
    d_in = layout[name].vocabulary if layout[name].kind == EMBED else x.shape[-1]
    key_in, key_out = jax.random.split(key)
    blocks[name] = (_gaussian(key_in, stacks, d_in, k) if d_in > k else None,
                    _gaussian(key_out, stacks, d_out, k) if d_out > k else None)
  return Projector(blocks, k, "random")


def _pca(sums: dict[str, list], layout: dict[str, Layout], k: int) -> Projector:
  blocks = {}
  for name, parts in sums.items():
    if layout[name].kind == DIAGONAL:
      square, count = parts
      mask = np.zeros(square.size, bool)
      mask[np.argsort(-square, kind="stable")[:k * k]] = True
      blocks[name] = (jnp.asarray(mask) if square.size > k * k else None, None)
      continue
    a, s, count = parts
    if layout[name].kind == EMBED:  # Diagonal A: the k most frequent ids.
      top = np.argsort(-a, axis=-1, kind="stable")[:, :k]
      p_in = _columns(top, a.shape[-1]) if a.shape[-1] > k else None
    else:
      p_in = _top(a / count, k) if a.shape[-1] > k else None
    p_out = _top(s / count, k) if s.shape[-1] > k else None
    blocks[name] = tuple(None if p is None else jnp.asarray(p) for p in (p_in, p_out))
  return Projector(blocks, k, "pca")
