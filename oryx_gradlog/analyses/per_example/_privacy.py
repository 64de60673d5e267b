"""The rest of a DP-SGD step: Gaussian noise, an optax-style transform, Poisson batches.

With the clipped gradient `sum_i c_i grad_i` from `gl.per_example_clip`, DP-SGD (Abadi
et al. 2016) adds Gaussian noise of standard deviation `sigma * C` to the sum
(`sigma` the noise multiplier, `C` the clip norm) and, for a mean loss, divides by
the batch size: so the noise on a mean is `sigma * C / B`. `add_dp_noise` does this
on a `ClippedGrads`; `dp_noise` is the same as an optax-style transform (a pair of
pure `init`/`update` functions, to put in `optax.chain` before the optimiser) for
gradients already mapped onto the parameter tree (`gl.to_param_tree`).

The privacy analysis of DP-SGD (`gl.dp_epsilon`) assumes Poisson sampling: every
example joins a batch independently with probability `q`. Batch sizes then vary,
which `jit` dislikes; `poisson_batch` returns a fixed number of indices, the
sampled ones first and padding after, with weights 1 and 0. Multiply each
example's loss by its weight: a padding example then has a zero gradient, so it
adds nothing to the clipped sum and its norm is 0.

Sharp edges:
  * `poisson_batch` drops sampled examples beyond `batch_size` (the `count` field
    says how many were sampled). The accounting does not cover that truncation:
    choose `batch_size` well above `q * num_examples` (a few standard deviations,
    `sqrt(q * num_examples)` each) so that it practically never happens.
  * With padded batches and `reduction="mean"`, the loss must divide the weighted
    sum by the padded batch size `B` (what `jnp.mean` of the weighted losses does),
    which is the `B` the noise is divided by.
  * Noise is drawn independently per leaf from `jax.random.split` of the key: use a
    fresh key every step (`dp_noise` keeps one in its state).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from oryx_gradlog._base import Transform
from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.per_example._clip import ClippedGrads


def noise_stddev(api: str, *, l2_norm_clip: float, noise_multiplier: float, reduction: str,
                 batch_size: int | None) -> float:
  """`sigma * C` for a sum loss, `sigma * C / B` for a mean loss."""
  _common.check_reduction(api, reduction)
  if not noise_multiplier >= 0 or not l2_norm_clip > 0:
    raise ValueError(
        f"{api}: got noise_multiplier={noise_multiplier!r} and l2_norm_clip="
        f"{l2_norm_clip!r}; the noise multiplier must be >= 0 and the clip norm > 0.")
  if reduction == "sum":
    return float(noise_multiplier * l2_norm_clip)
  if not batch_size or batch_size < 1:
    raise ValueError(
        f"{api}(reduction='mean'): the noise on a mean is sigma * C / batch_size; pass "
        f"batch_size (the records' batch size, padding included), got {batch_size!r}.")
  return float(noise_multiplier * l2_norm_clip / batch_size)


def _gaussian_noise(tree: Any, key: jax.Array, stddev: float) -> Any:
  """`tree` plus independent N(0, stddev^2) noise on every entry."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noisy = [leaf + stddev * jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf))
           for leaf, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, noisy)


def add_dp_noise(clipped: ClippedGrads, key: jax.Array, *,
                 noise_multiplier: float) -> ClippedGrads:
  """Returns `clipped` with DP-SGD's Gaussian noise added to every layer's gradient.

  The standard deviation is `noise_multiplier * l2_norm_clip` for a sum loss and
  that divided by the batch size for a mean loss (both read from `clipped`).

  Args:
    clipped: what `gl.per_example_clip` returns.
    key: a PRNG key, fresh for every step.
    noise_multiplier: `sigma`, the ratio of the noise's standard deviation to the
      clip norm (`gl.dp_noise_multiplier` finds one for a target epsilon).

  Returns:
    A `ClippedGrads` with noisy `layers` and the same norms.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> loss = lambda w, x: jnp.mean(gl.dense(x, w, name="fc"))
    >>> records = gl.reap(jax.grad(loss))(jnp.ones((1, 1)), jnp.ones((4, 1)))
    >>> clipped = gl.per_example_clip(records, l2_norm_clip=1.0)
    >>> noisy = gl.add_dp_noise(clipped, jax.random.PRNGKey(0), noise_multiplier=0.0)
    >>> noisy.layers["fc"].w  # no noise: the clipped mean gradient
    Array([[1.]], dtype=float32)
  """
  stddev = noise_stddev(
      "add_dp_noise", l2_norm_clip=clipped.l2_norm_clip, noise_multiplier=noise_multiplier,
      reduction=clipped.reduction, batch_size=clipped.batch_size)
  return dataclasses.replace(clipped, layers=_gaussian_noise(clipped.layers, key, stddev))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DPNoiseState:
  """The state of `dp_noise`: the PRNG key of the next step's noise.

  Attributes:
    key: a PRNG key.
  """

  key: jax.Array


def dp_noise(*, l2_norm_clip: float, noise_multiplier: float, reduction: str = "mean",
             batch_size: int | None = None, seed: int = 0) -> Transform:
  """Returns an optax-style transform that adds DP-SGD's noise to clipped gradients.

  Put it in `optax.chain(gl.dp_noise(...), optax.sgd(...))` and feed it the clipped
  gradients on the parameter tree (`gl.to_param_tree(gl.per_example_clip(...).layers,
  ...)`). Each update draws from the state's key and advances it.

  Args:
    l2_norm_clip: the clip norm `C` the gradients were clipped to.
    noise_multiplier: `sigma`.
    reduction: `"mean"` (noise `sigma C / batch_size`) or `"sum"` (`sigma C`).
    batch_size: the batch size (padding included); needed for `"mean"`.
    seed: the seed of the first key.

  Returns:
    A `gl.Transform`: `init(params) -> DPNoiseState`, `update(updates, state,
    params=None) -> (noisy updates, new state)`.

  Example:
    >>> import jax.numpy as jnp, oryx_gradlog as gl
    >>> noise = gl.dp_noise(l2_norm_clip=1.0, noise_multiplier=0.0, reduction="sum")
    >>> state = noise.init({"w": jnp.zeros(2)})
    >>> updates, state = noise.update({"w": jnp.ones(2)}, state)
    >>> updates["w"]
    Array([1., 1.], dtype=float32)
  """
  stddev = noise_stddev("dp_noise", l2_norm_clip=l2_norm_clip,
                        noise_multiplier=noise_multiplier, reduction=reduction,
                        batch_size=batch_size)

  def init(params):
    del params
    return DPNoiseState(jax.random.PRNGKey(seed))

  def update(updates, state, params=None):
    del params
    key, sub = jax.random.split(state.key)
    return _gaussian_noise(updates, sub, stddev), DPNoiseState(key)

  return Transform(init, update)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["indices", "weights", "count"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PoissonBatch:
  """A Poisson-sampled batch padded to a fixed size.

  Attributes:
    indices: `(batch_size,)` int32 example indices, the sampled ones first, then
      padding (index 0).
    weights: `(batch_size,)` float32, 1 for a sampled example, 0 for padding.
    count: the number of examples sampled (may exceed `batch_size`; see the
      module's sharp edges).
  """

  indices: jax.Array
  weights: jax.Array
  count: jax.Array


def poisson_batch(key: jax.Array, num_examples: int, *, sampling_rate: float,
                  batch_size: int) -> PoissonBatch:
  """Returns a Poisson-sampled batch of example indices, padded to `batch_size`.

  Every example is sampled independently with probability `sampling_rate`, as the
  privacy accounting (`gl.dp_epsilon`) assumes. Works under `jit` (the shapes are
  fixed).

  Args:
    key: a PRNG key, fresh for every step.
    num_examples: the size of the data set.
    sampling_rate: `q`, each example's probability of joining the batch.
    batch_size: the fixed, padded batch size; take it well above `q * num_examples`.

  Returns:
    A `PoissonBatch` of indices, weights (1 sampled, 0 padding) and the count.

  Example:
    >>> import jax, oryx_gradlog as gl
    >>> batch = gl.poisson_batch(jax.random.PRNGKey(0), 100, sampling_rate=0.05,
    ...                          batch_size=16)
    >>> batch.indices.shape, int(batch.weights.sum()) == min(int(batch.count), 16)
    ((16,), True)
  """
  if not 0 < sampling_rate <= 1 or batch_size < 1:
    raise ValueError(
        f"poisson_batch: got sampling_rate={sampling_rate!r} and batch_size="
        f"{batch_size!r}; the rate must be in (0, 1] and the batch size positive.")
  sampled = jax.random.uniform(key, (num_examples,)) < sampling_rate
  (indices,) = jnp.nonzero(sampled, size=batch_size, fill_value=0)
  count = jnp.sum(sampled, dtype=jnp.int32)
  weights = (jnp.arange(batch_size) < count).astype(jnp.float32)
  return PoissonBatch(indices.astype(jnp.int32), weights, count)
