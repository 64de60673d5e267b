"""The canonical form of a layer, which the analyses compute with.

Every layer use that is dense over positions (a hand-marked layer; a found dense,
convolution or embedding use) has a canonical `LayerView` `(S, B, T, d)`: S stacked
calls (and feature groups), B examples, T positions (tokens, output pixels of a
convolution, whose input becomes its patches, and calls that share one weight), d
features. Per-example gradient norms (Gram form or materialised, chosen here by
cost), K-FAC factors and the Gram forms of the batch-size tests are computed from it.
Results per parameter come back as `LayerParams`.

Layouts. A hand-marked record is `(*calls, batch, *positions, features)`; a found
use's operands are `(*calls, *operand)` with the batch axis where its `UseSpec`
says. Calls are the stacked iterations of enclosing scans (and repeated calls of one
name); calls that reuse one weight ("tied") are folded into positions here.

Sharp edges:
  * Views are read from records as the reap returns them, inside any vmap or scan
    that made them; a vmap outside the reap adds axes that would be taken for calls.
  * The view casts to at least float32 (ids of an embedding stay integers). Its
    products (`dot`) run at JAX's default matmul precision, which on a TPU is one
    bfloat16 pass (about 1e-3 relative): the precision the model's own cotangents
    were computed at. `jax.default_matmul_precision("highest")` around the traced
    call gives both more.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._kinds import EMBED, LAYER_NORM

GRAM, MATERIALIZED = "gram", "materialized"


def dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """`jnp.einsum` at the precision of the model's own products, summed in float32.

  The analyses' sums of products: at JAX's default matmul precision (one bfloat16
  pass on a TPU, as the model's float32 products take; exact on a CPU), with
  bfloat16 operands accumulated in float32 (`preferred_element_type`). Ask for more
  as for the model's products, with `jax.default_matmul_precision("highest")` around
  the call that traces the step (or `JAX_DEFAULT_MATMUL_PRECISION=highest`).
  """
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.result_type(a, b, jnp.float32))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class LayerParams:
  """A per-parameter quantity of one layer, shaped like its parameters.

  Attributes:
    w: like the weight, `(*calls, d_in, d_out)` for a dense layer (the kernel, table
      or layer-norm scale for the other layer kinds; the parameter itself for a
      parameter path of `gl.record_layers`).
    b: like the bias (or layer-norm offset), or `None` for a layer without one (and
      for a parameter path).
  """

  w: jax.Array
  b: jax.Array | None

  def __add__(self, other: LayerParams) -> LayerParams:
    b = (self.b if other.b is None else other.b if self.b is None
         else self.b + other.b)
    return LayerParams(self.w + other.w, b)


@dataclasses.dataclass(frozen=True)
class LayerView:
  """A layer record as `(S, B, T, d)` arrays (internal; not a pytree).

  Attributes:
    kind: the layer kind (`"dense"` for convolutions and found dense uses too, once
      they are in this form; `"embed"`, `"layer_norm"`, `"conv2d"`).
    x: `(S, B, T, d_in)` inputs per position (patches for a convolution, the
      normalised input for a layer norm); token ids `(S, B, T)` for an embedding.
    g: `(S, B, T, d_out)` output cotangents per position.
    bias_g: `(S, B, d_out)` sums of `g` over positions if the layer has a bias.
    stack_shape: the call axes `S` was flattened from (`()` when tied).
    groups: feature groups (convolutions; batch dimensions of a `dot_general`),
      folded into `S` after `stack_shape`.
    vocabulary: the embedding table's number of rows.
  """

  kind: str
  x: jax.Array
  g: jax.Array
  bias_g: jax.Array | None
  stack_shape: tuple
  groups: int = 1
  vocabulary: int = 0

  @property
  def batch_size(self) -> int:
    return self.g.shape[1]


def as_float(x: jax.Array) -> jax.Array:
  """`x` in at least float32."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def finish(kind, x, g, stack, groups, vocabulary, has_bias) -> LayerView:
  """Casts to float, adds the bias sums and folds feature groups into S."""
  g = as_float(g)
  if kind != EMBED:
    x = as_float(x)
  bias_g = jnp.sum(g, axis=2) if has_bias else None
  if groups > 1:  # Groups are independent dense layers: fold them into S.
    s, b, t = g.shape[:3]
    x = jnp.moveaxis(x.reshape(s, b, t, groups, -1), 3, 1).reshape(s * groups, b, t, -1)
    g = jnp.moveaxis(g.reshape(s, b, t, groups, -1), 3, 1).reshape(s * groups, b, t, -1)
  return LayerView(kind, x, g, bias_g, tuple(stack), groups, vocabulary)


def fold_tied(x, g, stack, tied_calls):
  """Moves the calls that share one weight into positions: `(S, B, T, d)` arrays
  whose S was flattened from `stack`, to S over the stacked calls only."""
  if not any(tied_calls):
    return x, g, stack
  keep = tuple(n for n, t in zip(stack, tied_calls) if not t)
  fold = tuple(n for n, t in zip(stack, tied_calls) if t)
  order = [i for i, t in enumerate(tied_calls) if not t] + [
      i for i, t in enumerate(tied_calls) if t]

  def fold_one(a):
    a = a.reshape(stack + a.shape[1:])
    a = jnp.transpose(a, order + list(range(len(stack), a.ndim)))
    k, f = len(keep), len(fold)
    a = a.reshape((math.prod(keep),) + (math.prod(fold),) + a.shape[k + f:])
    a = jnp.moveaxis(a, 1, 2)  # (S, B, calls, T, ...)
    return a.reshape(a.shape[:2] + (-1,) + a.shape[4:])

  return fold_one(x), fold_one(g), keep


def conv_windows(x, filter_shape, options):
  """Per kernel offset (row-major), the input's window that meets it, `(N, *positions, C)`.

  `x` is a convolution's input laid out channels last, `(N, *spatial, C)`; `options`
  its `window_strides`, `padding` (pairs or a string) and `lhs_dilation`,
  `rhs_dilation` (`None` for none). Input dilation is interior padding of `x`, kernel
  dilation spaces the offsets; each window is a strided slice, a copy of the input's
  channels at the output's positions.
  """
  rank = len(filter_shape)
  lhs = options.get("lhs_dilation") or (1,) * rank
  rhs = options.get("rhs_dilation") or (1,) * rank
  strides, padding = options["window_strides"], options["padding"]
  window = [(k - 1) * d + 1 for k, d in zip(filter_shape, rhs)]
  if isinstance(padding, str):
    dilated = [(s - 1) * d + 1 for s, d in zip(x.shape[1:-1], lhs)]
    padding = lax.padtype_to_pads(dilated, window, strides, padding)
  x = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), *(
      (lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs)), (0, 0, 0)])
  positions = [(s - w) // st + 1 for s, w, st in zip(x.shape[1:-1], window, strides)]
  for offset in itertools.product(*map(range, filter_shape)):
    start = [o * d for o, d in zip(offset, rhs)]
    limit = [s + (t - 1) * st + 1 for s, t, st in zip(start, positions, strides)]
    yield lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]), (1, *strides, 1))


def conv_patches(x, w_shape, g, spec, options, n, lead):
  """Patches of the input and cotangents per output pixel, `(S, B, T, d)`.

  `x` is `(*calls, *lead axes, C and spatial axes...)` laid out by `spec` over its
  last axes; the first lead axis is the example axis (the rest, and the conv's own N
  axis, count as positions). For a found convolution `lead` is 1 and N holds the
  batch (of size `B * k` where k examples... are merged). A patch's features are
  channel-major, as `lax.conv_general_dilated_patches`' (formed here by slices,
  `conv_windows`: that function's convolution with a one-hot kernel multiplies by
  each of the `C x prod(kernel)` features).
  """
  m = n + lead - 1  # Axes before the conv's own N axis.
  lhs = spec.lhs_spec
  x = jnp.transpose(x, tuple(range(m)) + tuple(m + a for a in (lhs[0], *lhs[2:], lhs[1])))
  g = jnp.transpose(g, tuple(range(m)) + tuple(m + a for a in spec.out_spec))
  filter_shape = tuple(w_shape[a] for a in spec.rhs_spec[2:])
  # (N, *positions, C, prod(kernel)): channel-major features.
  patches = jnp.stack(list(conv_windows(x.reshape((-1,) + x.shape[m + 1:]), filter_shape,
                                        options)), -1)
  if patches.shape[1:-2] != g.shape[m + 2:]:
    raise ValueError(
        f"the patches of a convolution's input have spatial shape {patches.shape[1:-2]} "
        f"but its output cotangent has {g.shape[m + 2:]}.")
  size = math.prod(x.shape[:n])
  batch = x.shape[n] if lead > 1 else x.shape[n] // options.get("merged", 1)
  patches = patches.reshape(size, batch, -1, patches.shape[-2] * patches.shape[-1])
  g = g.reshape(g.shape[:m + 2] + (-1,))
  g = jnp.swapaxes(g, -1, -2).reshape(size, batch, -1, g.shape[m + 1])
  return patches, g


def moveaxis_batch(a, n, axis, factor):
  """`a` `(*calls, ...)` with its batch axis (of size B * factor, examples outer) at
  `n + axis`: returns `(*calls, B, factor, rest...)`."""
  a = jnp.moveaxis(a, n + axis, n)
  size = a.shape[n]
  return a.reshape(a.shape[:n] + (size // factor, factor) + a.shape[n + 1:])


def costs(kind: str, batch: int, positions: int, d_in: int, d_out: int,
          vocabulary: int = 0) -> dict[str, tuple[int, int]]:
  """Per method, `(multiply-adds, floats held)` of a layer's per-example squared norms.

  Gram: `B T^2 (d_in + d_out)` multiply-adds and two `(B, T, T)` Gram matrices;
  materialised: `B T d_in d_out` and the `(B, d_in, d_out)` per-example gradients.
  An embedding's Gram form sorts each example's ids and sums the rows of each run of
  equal ids (`B T (d + log T)`, two `(B, T, d)` arrays); materialised, it scatters
  `B T d` rows into `B` tables of `V d`. With `T = 1` the Gram form is
  `|x_i|^2 |g_i|^2`.
  """
  b, t = batch, positions
  if kind == EMBED:  # Sorted ids, one sum per run of equal ids (no (T, T) Gram).
    gram = (b * t * (d_out + max(t.bit_length(), 1)), 2 * b * t * d_out)
    materialized = (b * (t + vocabulary) * d_out, b * vocabulary * d_out)
  else:
    gram = (b * t * t * (d_in + d_out), 2 * b * t * t)
    materialized = (b * t * d_in * d_out, b * d_in * d_out)
  return {GRAM: gram, MATERIALIZED: materialized}


def cheaper(kind: str, batch: int, positions: int, d_in: int, d_out: int,
            vocabulary: int = 0, weighted: bool = False) -> str:
  """The method `"auto"` chooses: materialised only where it takes fewer
  multiply-adds *and* holds no more than the Gram form or the layer's activations.

  `weighted`: the caller also forms `sum_i c_i grad_i` (clipping). The Gram form
  then pays a vjp of the layer (`B T d_in d_out`, an embedding's scatter `B T d`),
  while materialised per-example gradients are summed (`B d_in d_out`, `B V d`).
  """
  cost = costs(kind, batch, positions, d_in, d_out, vocabulary)
  activations = batch * positions * (d_out if kind == EMBED else d_in + d_out)
  (gram_macs, gram_floats), (mat_macs, mat_floats) = cost[GRAM], cost[MATERIALIZED]
  if weighted:
    gram_macs += batch * positions * (d_out if kind == EMBED else d_in * d_out)
    mat_macs += batch * (vocabulary if kind == EMBED else d_in) * d_out
  if mat_macs < gram_macs and mat_floats <= max(gram_floats, activations):
    return MATERIALIZED
  return GRAM


def choose_method(view: LayerView, method: str, weighted: bool = False) -> str:
  """Gram form or materialised per-example gradients, whichever costs less
  (`weighted`: see `cheaper`)."""
  if view.kind == LAYER_NORM:  # Its per-example gradient is one (d,) vector.
    return MATERIALIZED
  if method != "auto":
    return method
  b, t, d_out = view.g.shape[1:]
  d_in = 1 if view.kind == EMBED else view.x.shape[3]
  return cheaper(view.kind, b, t, d_in, d_out, view.vocabulary, weighted)
