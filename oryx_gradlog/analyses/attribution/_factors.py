"""The curvature of influence functions, fitted from the records: `fit_factors`.

`fit_factors` (behind `gl.fit_influence`) fits a damped curvature `H` of the
training loss, block by block, from the layer records of `gl.record_layers` (any
model, unchanged), with Kronfluence's (Grosse et al. 2023) conventions, so that
the numbers can be compared one to one:

* A dense or convolution use of a view of its parameter, which has no other use,
  is a Kronecker block. `A` is the mean of `a a^T` over examples x positions (a
  convolution's unfolded patches at its output locations), with a 1 appended to
  `a` where a bias is added to the layer's output (the bias is in its layer's
  block: the last row of the block's gradient); `S` the same mean of `g g^T`.
  Their eigenbases `Q_A`, `Q_S` are computed in float64 on the host.
* `strategy="kfac"`: the block's eigenvalues are `eig(A) (x) eig(S)`;
  `"ekfac"` (eigenvalue-corrected K-FAC, Kronfluence's default): the mean over
  examples of `(Q_A^T G_i Q_S)^2`, `G_i = sum_t a_it g_it^T` the example's
  gradient, from a second pass over the data. `"identity"`: `H = 0` and no
  damping, the plain inner products of gradients.
* An embedding (the table's only use) is a Kronecker block too, of one-hot
  inputs: `A` is the diagonal of the ids' frequencies over examples x positions
  (its eigenbasis the identity, never formed), `S` as above over the gathered
  rows' cotangents.
* Every other parameter (element-wise scales and shifts that are not a layer's
  bias, generic uses, a parameter with several uses) is a diagonal block: the mean
  of the per-example squared gradients (the empirical Fisher's diagonal) for both
  `"kfac"` and `"ekfac"`.
* `strategy="full"`: each block's whole empirical Fisher, the mean of `vec(G_i)
  vec(G_i)^T` over examples (per layer of a stacked block), inverted in its float64
  eigenbasis: LoGra's curvature (LogIX's `"raw"`) for projected gradients, and for
  blocks of at most 4,096 numbers without a projection.
* `projection=gl.fit_projector(...)` (LoGra): every block's inputs and cotangents
  are projected first, and the strategies fit and score the projected gradients.
* `damping=None` is 0.1 times the mean of each block's eigenvalues (per layer of a
  scan-stacked block), as Kronfluence's `damping_factor=None`; a number is added
  to every eigenvalue as it is.

The curvature is fitted from the gradients of the loss on the batch's own labels
(the empirical Fisher, Kronfluence's `use_empirical_fisher=True`), or with
`sampled_loss` on labels sampled from the model (the true Fisher, Kronfluence's
default); scores are always of `loss` (or a `measurement`) on the data's labels.

Sharp edges:
  * `loss(params, *batch)` must be the mean over the batch of per-example losses
    (checked on the first batch). Batches may differ in size, one example included
    (`_batches`); each new size compiles its step once.
  * `batches` is read twice by `"ekfac"` (once by the others): pass a list or
    another re-iterable, not a generator.
  * An embedding's out-of-range ids count as the row they are clamped to in `A`
    (their gradient is dropped as the gather's vjp drops it).
  * EK-FAC's correction forms each example's gradient in the eigenbasis (`B x
    d_in x d_out` floats per layer, `B x vocabulary x d` for an embedding).
  * `sampled_loss` draws batch i's labels with `jax.random.fold_in(key, i)`: the
    same labels in both passes of `"ekfac"`.
  * Each pass sums over the batches on the device, in float32 (float64 with
    `jax_enable_x64`), and reads its sums back once: the device holds two copies of
    every block's `A` and `S` in the first pass (`d_in^2 + d_out^2` floats per layer;
    2.2 GiB at GPT-2-small's shape) and of its eigenvalues in the second (`d_in x
    d_out`), besides the batch's own program. On a TPU the products are at the
    default matmul precision (one bfloat16 pass), as the model's own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog import _repr
from oryx_gradlog.analyses import _common
from oryx_gradlog.analyses.attribution import _batches
from oryx_gradlog.analyses.attribution._blocks import (
    DIAGONAL, Gradients, Layout, as_count, factor_sums, per_example, summed)
from oryx_gradlog.analyses.attribution._projection import Projector, project
from oryx_gradlog.record._kinds import EMBED

STRATEGIES = ("identity", "kfac", "ekfac", "full")
_FULL_MAX = 4096  # Numbers per example of a block that `"full"` inverts (128 MiB).
_DAMPING_FACTOR = 0.1  # Kronfluence's `damping_factor=None`: 0.1 x the mean eigenvalue.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_a", "q_s", "eigenvalues", "damping"], meta_fields=["keys"])
@dataclasses.dataclass(frozen=True)
class KroneckerBlock:
  """The curvature of one dense, convolution or embedding layer, in its eigenbasis.

  Attributes:
    q_a: `(S, d_in(+1), d_in(+1))` the eigenvectors of `A` (a row and column for
      the bias's 1 last), one per layer `S` of a scan-stacked or grouped use;
      `None` for an embedding, whose one-hot inputs make `A` diagonal (`d_in` is
      the vocabulary, the eigenbasis the identity).
    q_s: `(S, d_out, d_out)` the eigenvectors of `S`.
    eigenvalues: `(S, d_in(+1), d_out)` the block's eigenvalues (K-FAC's products
      or EK-FAC's corrected ones); zeros for `"identity"`.
    damping: `(S,)` added to the eigenvalues.
    keys: the parameter paths in the block (the weight's, and the bias's).
  """

  __repr__ = _repr.dataclass_repr

  q_a: jax.Array | None
  q_s: jax.Array
  eigenvalues: jax.Array
  damping: jax.Array
  keys: tuple[str, ...]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["eigenvalues", "damping"], meta_fields=["keys"])
@dataclasses.dataclass(frozen=True)
class DiagonalBlock:
  """The curvature of one parameter as a diagonal: its mean squared per-example
  gradient (flattened), and the damping added to it.

  Attributes:
    eigenvalues: `(size,)` the diagonal; zeros for `"identity"`.
    damping: `()` added to it.
    keys: the parameter's path, alone.
  """

  __repr__ = _repr.dataclass_repr

  eigenvalues: jax.Array
  damping: jax.Array
  keys: tuple[str, ...]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "eigenvalues", "damping"], meta_fields=["keys"])
@dataclasses.dataclass(frozen=True)
class FullBlock:
  """The full empirical Fisher of one block's per-example gradients (`"full"`), in its
  eigenbasis: LoGra's and LogIX's `"raw"` curvature of projected gradients.

  Attributes:
    q: `(S, D, D)` the eigenvectors, per layer `S` of a stacked use; `D` the block's
      (projected) gradient size per layer, flattened.
    eigenvalues: `(S, D)` the eigenvalues.
    damping: `(S,)` added to them.
    keys: the parameter paths in the block.
  """

  __repr__ = _repr.dataclass_repr

  q: jax.Array
  eigenvalues: jax.Array
  damping: jax.Array
  keys: tuple[str, ...]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["blocks", "projection"],
    meta_fields=["strategy"])
@dataclasses.dataclass(frozen=True)
class InfluenceFactors:
  """The fitted curvature, a frozen pytree of arrays (save and load it as any).

  Attributes:
    blocks: per block name (its weight's parameter path), a `KroneckerBlock` or a
      `DiagonalBlock` (a `FullBlock` for `"full"`).
    strategy: `"identity"`, `"kfac"`, `"ekfac"` or `"full"`.
    projection: the `Projector` whose projected gradients the blocks are of
      (LoGra), or `None`.
  """

  __repr__ = _repr.dataclass_repr

  blocks: dict[str, Any]
  strategy: str
  projection: Projector | None = None


def _call(loss, argnums, positions, params, others, examples=None):
  """`loss` of the parameters and the batch arguments `others`, the arguments at
  `positions` replaced by one-example batches of `examples` where given."""
  n_args = len(others) + 1
  args, rest = [None] * n_args, iter(others)
  for i in range(n_args):
    args[i] = params if i == argnums else next(rest)
  for i, example in zip(positions, examples or ()):
    args[i] = jax.tree.map(lambda v: v[None], example)
  return loss(*args)


def _whole_and_mean(loss, argnums, positions, params, others, examples):
  each = jax.vmap(functools.partial(_call, loss, argnums, positions),
                  in_axes=(None, None, 0))
  return (_call(loss, argnums, positions, params, others),
          jnp.mean(each(params, others, examples)))


@functools.lru_cache(maxsize=16)
def _whole_and_mean_of(loss, argnums, positions) -> Callable:
  """The check's program, compiled once a loss and shapes (`_batches.kept_per_loss`)."""
  return jax.jit(functools.partial(_whole_and_mean, loss, argnums, positions))


def _check_loss_is_a_mean(api, loss, params, batch, argnums, batch_argnums):
  """`loss(params, *batch)` equals the mean of the losses of one-example batches."""
  n_args = len(batch) + 1
  positions = _batches.positions(argnums, batch_argnums, n_args)
  others = tuple(batch)
  examples = [others[i - (i > argnums)] for i in positions]
  check = _batches.kept_per_loss(_whole_and_mean_of, loss, argnums, positions)
  whole, mean = check(params, others, examples)
  if jnp.shape(whole):
    raise ValueError(
        f"{api}: loss(params, *batch) returns an array of shape {jnp.shape(whole)} on the "
        "first batch, not a number. Return the mean over the batch of the per-example "
        "losses, e.g. jnp.mean(per_example_losses).")
  whole, mean = float(whole), float(mean)
  if not np.isclose(whole, mean, rtol=1e-4, atol=1e-6 * max(1.0, abs(mean))):
    raise ValueError(
        f"{api}: loss(params, *batch) is {whole:.6g} on the first batch but the mean of "
        f"its examples' losses is {mean:.6g}. The loss must be the mean over the batch "
        "of per-example losses (as for gl.clipped_grad): divide a sum by the batch size, "
        "and keep terms of the parameters alone (weight decay) out of it.")


class Pass:
  """What one batch gives each block (internal): `arrays` is jitted; the blocks'
  layout (static) is kept when it is traced, in `layouts` by the shapes it was
  traced at (`shapes(params, batch, projection)`). With a `Projector`, the blocks
  are those of the projected gradients."""

  def __init__(self, gradients: Gradients, api: str):
    self.gradients, self.api = gradients, api
    self.layouts: dict[Any, dict[str, Layout]] = {}

  def arrays(self, params, batch, projection: Projector | None) -> dict[str, Any]:
    """Per block: Kronecker `(x, g)`, diagonal `(B, n)` per-example gradients, of
    the per-example losses."""
    out, layout = self.gradients.arrays(params, batch)
    if projection is not None:
      out, layout = project(self.api, projection, out, layout)
    self.layouts[shapes(params, batch, projection)] = layout
    return out


def shapes(*args) -> tuple:
  """The structure, shapes and dtypes of `args` (arrays or tracers), hashable."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple((tuple(np.shape(v)), str(jnp.result_type(v))) for v in leaves)


class Programs(NamedTuple):
  """A loss's jitted programs of one batch (internal), kept across calls."""

  passes: Pass
  arrays: Callable  # (params, batch, projection) -> {block: Pass.arrays}
  covariances: Callable  # (params, batch, projection) -> {block: factor_sums}
  corrections: Callable  # (bases, params, batch, projection) -> {block: [squares, examples]}


@functools.lru_cache(maxsize=16)
def passes_of(api: str, fun: Callable, argnums: int, positions) -> Programs:
  """The `Pass` of a loss and its jitted programs, kept across calls (`fit_influence`
  of the same loss and shapes compiles them once). The covariances and EK-FAC's
  corrections are summed inside the pass's program: the records never leave it."""
  passes = Pass(Gradients(api, fun, argnums, positions), api)

  def covariances(params, batch, projection):
    out = passes.arrays(params, batch, projection)
    layouts = passes.layouts[shapes(params, batch, projection)]
    return {key: factor_sums(layouts[key], value) for key, value in out.items()}

  def corrections(bases, params, batch, projection):
    out = passes.arrays(params, batch, projection)
    layouts = passes.layouts[shapes(params, batch, projection)]
    return {key: [_rotated_squares(block, out[key], layouts[key]),
                  as_count(out[key][1].shape[1])] for key, block in bases.items()}

  return Programs(passes, jax.jit(passes.arrays), jax.jit(covariances), jax.jit(corrections))


def rotated(block: KroneckerBlock, layout: Layout, value, rotate: bool = True):
  """`(S, B, i, o)`: each example's gradient (`_blocks.per_example`) in the block's
  eigenbasis (as it is, with `rotate=False`; an embedding's inputs are one-hot, in
  the identity basis)."""
  x, g = value
  if rotate:
    g = _common.dot("sbto,sop->sbtp", g, block.q_s.astype(g.dtype))
    if layout.kind != EMBED:
      x = _common.dot("sbti,sij->sbtj", x, block.q_a.astype(x.dtype))
  return per_example(layout, (x, g))


@functools.partial(jax.jit, static_argnums=2)  # Module-level: compiled once a shape.
def _rotated_squares(block: KroneckerBlock, value, layout: Layout) -> jax.Array:
  """EK-FAC's correction of one batch: the squares of each example's gradient in the
  block's eigenbasis, summed over the examples."""
  return jnp.sum(rotated(block, layout, value) ** 2, axis=1)


def fit_factors(loss: Callable, params, batches: Iterable, options: dict) -> InfluenceFactors:
  """The `InfluenceFactors` of `fit_influence` (which see), whose keyword arguments
  are `options`; its checks."""
  strategy, damping, projection = options["strategy"], options["damping"], options["projection"]
  argnums, batch_argnums = options["argnums"], options["batch_argnums"]
  sampled_loss, key, progress = options["sampled_loss"], options["key"], options["progress"]
  api = "fit_influence"
  _batches.check_params(api, params)
  if strategy not in STRATEGIES:
    raise ValueError(f"{api}(strategy={strategy!r}): strategy must be one of "
                     f"{STRATEGIES} (plain gradient products, K-FAC, EK-FAC, each "
                     "block's full Fisher).")
  if projection is not None and not isinstance(projection, Projector):
    raise TypeError(f"{api}(projection={type(projection).__name__}): pass a "
                    "gl.Projector (from gl.fit_projector) or None.")
  if not isinstance(argnums, int):
    raise TypeError(f"{api}(argnums={argnums!r}): one positional argument holds the "
                    "parameters (an int); gather several into one tree.")
  if damping is not None and not (isinstance(damping, (int, float)) and damping >= 0):
    raise ValueError(f"{api}(damping={damping!r}): damping is a number >= 0 added to "
                     "the eigenvalues, or None for 0.1 x each block's mean eigenvalue.")
  if strategy == "ekfac" and iter(batches) is batches:
    raise TypeError(f"{api}: `batches` is an iterator, which EK-FAC would exhaust in "
                    "its first pass; pass a list (or another re-iterable) of batches.")
  if sampled_loss is not None and not callable(sampled_loss):
    raise TypeError(f"{api}(sampled_loss={type(sampled_loss).__name__}): pass the loss "
                    "on sampled labels, sampled_loss(params, *batch, key), or None.")
  if sampled_loss is None and key is not None:
    raise ValueError(f"{api}(key=...): the key is for sampled_loss's labels; pass "
                     "sampled_loss too, or no key.")
  label_key = jax.random.PRNGKey(0) if key is None else key
  # The fitted function and its jitted pass, made at the first batch: `sampled_loss`
  # takes one argument more than the batch, its key, which is not a batch argument.
  made: list = []  # The loss's `Programs`, made at the first batch.
  layouts: dict[str, Layout] = {}

  def each(check_first: bool, program: str, *first):
    """`Programs.<program>(*first, params, batch, projection)` of every batch."""
    number = 1 if check_first else 2
    shown = _batches.progress(batches, f"{api}: pass {number}/{passes_total}", progress)
    for i, batch in enumerate(shown):
      batch = _batches.as_args(api, batch, f"batches[{i}]")
      if check_first and i == 0:
        _check_loss_is_a_mean(api, loss, params, batch, argnums, batch_argnums)
      if not made:
        fun, positions = loss, batch_argnums
        if sampled_loss is not None:
          fun = sampled_loss
          positions = _batches.positions(argnums, positions, len(batch) + 1)
        made.append(_batches.kept_per_loss(passes_of, api, fun, argnums, positions))
      if sampled_loss is not None:
        batch = batch + (jax.random.fold_in(label_key, i),)
      out = getattr(made[0], program)(*first, params, batch, projection)
      layouts.update(made[0].passes.layouts[shapes(params, batch, projection)])
      yield out

  passes_total = 2 if strategy == "ekfac" else 1
  if strategy == "full":
    return InfluenceFactors(
        _full_blocks(api, each(True, "arrays"), layouts, damping), strategy, projection)

  # Pass 1: the Kronecker factors (sums over examples x positions) and the
  # diagonal blocks' sums of squares.
  sums = summed(each(True, "covariances"))
  if sums is None:
    raise ValueError(f"{api}: `batches` is empty; pass at least one batch.")

  blocks: dict[str, Any] = {}
  for key, parts in sums.items():
    layout = layouts[key]
    keys = (key,) if layout.bias is None else (key, layout.bias)
    if layout.kind != DIAGONAL:
      a, s, count = parts
      if strategy == "identity":  # No curvature: the bases are not used.
        q_a = q_s = None
        eig = np.zeros(a.shape[:2] + s.shape[-1:])
      else:  # Float64 eigenbases (float32 is not accurate enough for EK-FAC).
        e_s, q_s = np.linalg.eigh(s / count)
        if layout.kind == EMBED:  # One-hot inputs: A is diagonal, its basis the identity.
          e_a, q_a = a / count, None
        else:
          e_a, q_a = np.linalg.eigh(a / count)
        eig = e_a[:, :, None] * e_s[:, None, :]  # As Kronfluence: kron(eig A, eig S).
      blocks[key] = KroneckerBlock(q_a, q_s, eig, np.zeros(a.shape[0]), keys)
    else:
      square, count = parts
      eig = square / count if strategy != "identity" else np.zeros_like(square)
      blocks[key] = DiagonalBlock(eig, np.zeros(()), keys)

  if strategy == "ekfac":  # Pass 2: the eigenvalues corrected in the eigenbases.
    bases = {key: jax.tree.map(jnp.asarray, dataclasses.replace(
        block, eigenvalues=None, damping=None)) for key, block in blocks.items()
             if isinstance(block, KroneckerBlock)}
    corrected = summed(each(False, "corrections", bases))
    del bases
    for key, (total, count) in corrected.items():
      blocks[key] = dataclasses.replace(blocks[key], eigenvalues=total / count)

  finished = {}
  for key, block in blocks.items():
    eig = np.asarray(block.eigenvalues, np.float64)
    if strategy == "identity":
      damp = np.zeros(eig.shape[:1]) if isinstance(block, KroneckerBlock) else np.zeros(())
    elif damping is None:
      damp = (_DAMPING_FACTOR * eig.reshape(eig.shape[0], -1).mean(axis=1)
              if isinstance(block, KroneckerBlock) else _DAMPING_FACTOR * np.mean(eig))
    else:
      damp = np.full(eig.shape[:1] if isinstance(block, KroneckerBlock) else (), damping)
    # On the device in the default float (float64 with x64 on).
    device = lambda v: None if v is None else jnp.asarray(v)
    finished[key] = dataclasses.replace(
        block, eigenvalues=jnp.asarray(eig), damping=jnp.asarray(damp),
        **({"q_a": device(block.q_a), "q_s": device(block.q_s)}
           if isinstance(block, KroneckerBlock) else {}))
  return InfluenceFactors(finished, strategy, projection)


def flat_grads(layout: Layout, value) -> jax.Array:
  """`(S, B, D)`: a block's per-example gradients, flattened per layer."""
  grads = per_example(layout, value)
  if layout.kind == DIAGONAL:
    return grads[None]
  return grads.reshape(grads.shape[:2] + (-1,))


def _full_blocks(api: str, outs, layouts: dict[str, Layout], damping: float | None
                 ) -> dict:
  """`"full"`: each block's mean `vec(G_i) vec(G_i)^T`, its eigenbasis (float64, on
  the host) and damping."""
  sums: dict[str, list] = {}
  outer = jax.jit(lambda v: _common.dot("sbd,sbe->sde", v, v))
  for out in outs:
    for key, value in out.items():
      flat = flat_grads(layouts[key], value)
      if flat.shape[-1] > _FULL_MAX:
        raise ValueError(
            f"{api}(strategy='full'): block {key!r} has {flat.shape[-1]} gradient numbers "
            f"per example (per layer), more than the {_FULL_MAX} whose Fisher 'full' "
            "inverts. Project the gradients first (projection=gl.fit_projector(loss, "
            "params, batches, k=16)) or use strategy='ekfac'.")
      total = np.asarray(outer(flat), np.float64)
      part = [total, flat.shape[1], layouts[key]]
      sums[key] = part if key not in sums else [sums[key][0] + total,
                                                sums[key][1] + flat.shape[1], part[2]]
  if not sums:
    raise ValueError(f"{api}: `batches` is empty; pass at least one batch.")
  blocks = {}
  for key, (total, count, layout) in sums.items():
    q, eig, damp = fisher_eigenbasis(total / count, damping)
    keys = (key,) if layout.bias is None else (key, layout.bias)
    blocks[key] = FullBlock(jnp.asarray(q), jnp.asarray(eig), jnp.asarray(damp), keys)
  return blocks


def fisher_eigenbasis(fisher: np.ndarray, damping: float | None):
  """`(q, eigenvalues, damping)` of `(S, D, D)` Fisher matrices, in float64:
  eigenvalues below zero (round-off) are 0, and `damping=None` is 0.1 x the mean
  eigenvalue per layer."""
  eig, q = np.linalg.eigh(np.asarray(fisher, np.float64))
  eig = np.maximum(eig, 0.0)
  damp = (_DAMPING_FACTOR * eig.mean(axis=1) if damping is None
          else np.full(eig.shape[:1], damping))
  return q, eig, damp


def block_shape(value, layout: Layout | None = None, full: bool = False) -> tuple:
  """A block's `(S, d_in, d_out)` or `(size,)` (`(S, D)` for a `FullBlock`), from its
  factors or from one batch's arrays (with their `layout`)."""
  if isinstance(value, (KroneckerBlock, DiagonalBlock, FullBlock)):
    return tuple(value.eigenvalues.shape)
  if full:
    shape = block_shape(value, layout)
    return (shape[0], int(np.prod(shape[1:]))) if layout.kind != DIAGONAL else (1, shape[0])
  if layout.kind == DIAGONAL:
    return tuple(value.shape[1:])
  x, g = value
  d_in = layout.vocabulary if layout.kind == EMBED else x.shape[-1]
  return (g.shape[0], d_in, g.shape[-1])


def divide(factors: InfluenceFactors, name: str, g):
  """`g` (rotated) divided by block `name`'s damped eigenvalues (as it is for
  `"identity"`)."""
  block = factors.blocks[name]
  if factors.strategy == "identity":
    return g
  if isinstance(block, KroneckerBlock):
    return g / (block.eigenvalues + block.damping[:, None, None])[:, None]
  if isinstance(block, FullBlock):  # `g` as `(S, B, D, 1)`.
    return g / (block.eigenvalues + block.damping[:, None])[:, None, :, None]
  return g / (block.eigenvalues + block.damping)
