"""The convolution kind: a `conv_general_dilated` of a batched input with a kernel.

A dense layer over the patches of its input (strided slices, in the feature order of
`jax.lax.conv_general_dilated_patches`), one position per output pixel; feature
groups are independent dense layers. The batch is the input's N axis (possibly
merged with other axes, examples outer).
Example i's kernel gradient is formed as one batched product per kernel offset,
`sum_t x_i[t * stride + offset] g_i[t]` over the output positions `t`: the input's
strided window at that offset against the cotangent. `vmap` of the convolution's
vjp (what `jax.vmap(jax.grad(...))` forms) is a convolution grouped by example,
which XLA's CPU backend runs 1.3-3x slower than these products (3x3 kernels on
32 x 32 to 8 x 8 images, JAX 0.5.0 and 0.10.2; `benchmarks/RESULTS.md`, workload 14).

Sharp edges:
  * The windows are copies: `prod(kernel)` of them, each the input's channels at the
    output's positions, as many floats as the patches; XLA may hold them all at once
    (workload 14's conv net, JAX 0.5.0: 25 MiB of temporaries against the `vmap`
    clip's 19; 0.10.2: 35 against 27).
  * Measured on CPU only; on an accelerator the grouped convolution may be the
    faster form.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._canonical import LayerView, conv_patches, conv_windows, finish
from oryx_gradlog.record._canonical import fold_tied
from oryx_gradlog.record._kinds import CONV, DENSE
from oryx_gradlog.record.kinds import Kind, register, view_cost


class Conv(Kind):
  name = CONV
  primitives = (lax.conv_general_dilated_p,)
  sliceable = True

  def recognise(self, eqn, ins, w) -> bool:
    """A convolution of a batched input (batch on its N axis) with a parameter kernel."""
    spec = eqn.params["dimension_numbers"]
    axis = ins[0].batch
    return (w == 1 and eqn.params["batch_group_count"] == 1 and axis is not None
            and axis[0] == spec.lhs_spec[0])

  def data_arg(self, use) -> int:
    return 0

  def feature_axes(self, eqn, w: int) -> tuple[int, ...]:
    """The output's channel axis."""
    return (eqn.params["dimension_numbers"].out_spec[1],)

  def per_example(self, use) -> tuple:
    """Each example's kernel gradient, one batched product per kernel offset."""
    _, factor = use.spec.batch[0]
    params = use.spec.params
    return (use.per_call(
        lambda operands, g, _: by_offsets(operands[0], g, operands[1], factor, params)),)

  def view(self, use) -> LayerView:
    """Patches `(S, B, T, d_in)` and cotangents `(S, B, T, d_out)`, T output pixels."""
    spec, n = use.spec, use.n_calls
    params = spec.params
    _, factor = spec.batch[0]
    options = {
        "window_strides": params["window_strides"], "padding": params["padding"],
        "lhs_dilation": params["lhs_dilation"], "rhs_dilation": params["rhs_dilation"],
        "merged": factor,  # N = B * factor, examples outer.
    }
    x, g = conv_patches(use.operands[0], spec.avals[1].shape, use.g,
                        params["dimension_numbers"], options, n, 1)
    x, g, stack = fold_tied(x, g, tuple(use.g.shape[:n]), use.tied_calls)
    return finish(DENSE, x, g, stack, params["feature_group_count"], 0, False)

  def cost(self, use, method: str) -> tuple[str, int, int]:
    return view_cost(use.view(), method) or super().cost(use, method)


def by_offsets(x, g, w, factor, params):
  """`(B, *w.shape)`: per example, the kernel gradient `sum_t x[t * s + o] g[t]` of a
  `conv_general_dilated` of `x` with `w` and these `params`, one product per kernel
  offset `o`.

  `x` is the input and `g` the output's cotangent in the convolution's layouts, their
  batch axes of size `B * factor` (examples outer). Feature groups are independent
  products; input dilation is interior padding of the input; kernel dilation spaces
  the offsets.
  """
  dn = params["dimension_numbers"]
  lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  x = jnp.transpose(x, (lhs[0], *lhs[2:], lhs[1]))  # (N, *spatial, C_in)
  g = jnp.transpose(g, (out[0], *out[2:], out[1]))  # (N, *positions, C_out)
  n, positions, c_in, c_out = x.shape[0], g.shape[1:-1], x.shape[-1], g.shape[-1]
  groups = params["feature_group_count"]
  batch, count = n // factor, math.prod(positions) * factor  # Examples outer in N.
  g = g.reshape(batch, count, groups, c_out // groups)
  kernel = tuple(w.shape[a] for a in rhs[2:])
  products = [
      jnp.einsum("btgc,btgo->bgco", window.reshape(batch, count, groups, c_in // groups), g,
                 precision=params["precision"])
      for window in conv_windows(x, kernel, params)]
  # (B, *kernel, groups, C_in / groups, C_out / groups) -> (B, *kernel, C_in / groups, C_out)
  grads = jnp.stack(products, 1).reshape(batch, *kernel, groups, c_in // groups, -1)
  grads = jnp.moveaxis(grads, 1 + len(kernel), -2).reshape(batch, *kernel, -1, c_out)
  axis = {rhs[1]: len(kernel), rhs[0]: len(kernel) + 1, **{a: i for i, a in enumerate(rhs[2:])}}
  return jnp.transpose(grads, (0, *(1 + axis[a] for a in range(w.ndim)))).astype(w.dtype)


KIND = register(Conv())
