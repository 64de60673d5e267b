"""The convolution kind: a `conv_general_dilated` of a batched input with a kernel.

A dense layer over the patches of its input (`jax.lax.conv_general_dilated_patches`),
one position per output pixel; feature groups are independent dense layers. The
batch is the input's N axis (possibly merged with other axes, examples outer).
Example i's gradient is the vjp of the convolution of example i's slice alone.
"""

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record._canonical import LayerView, conv_patches, finish, fold_tied
from oryx_gradlog.record._canonical import moveaxis_batch
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
    """The vjp of each example's own slice of the batch."""

    def sliced(operands, g, _):
      axis, factor = use.spec.batch[0]
      x = moveaxis_batch(operands[0], 0, axis, factor)  # (B, k, ...)
      out_axis, _ = use.spec.out_batch
      gg = moveaxis_batch(g, 0, out_axis, factor)
      w = operands[1]

      def one(x_i, g_i):
        x_i = jnp.moveaxis(x_i, 0, axis)
        g_i = jnp.moveaxis(g_i, 0, out_axis)
        _, vjp = jax.vjp(lambda w: use.spec.apply([x_i, w]), w)
        return vjp(g_i)[0]

      return jax.vmap(one)(x, gg)

    return (use.per_call(sliced),)

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


KIND = register(Conv())
