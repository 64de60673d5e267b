"""The element-wise kind: biases, norm scales and offsets, learned position embeddings.

An element-wise operation (or a broadcast) of a parameter whose operands broadcast
by size-1 axes (or rank 0). Example i's gradient is the vjp with respect to the
parameter broadcast to the output's shape, summed over example i's rows and the
axes it was broadcast along: no per-example vjp.
"""

import jax
import jax.numpy as jnp
from jax import lax

from oryx_gradlog.record import _internals
from oryx_gradlog.record._canonical import MATERIALIZED, moveaxis_batch
from oryx_gradlog.record._kinds import ELEMENTWISE
from oryx_gradlog.record.kinds import Kind, _sizes, register


class Elementwise(Kind):
  name = ELEMENTWISE
  primitives = (
      lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.max_p, lax.min_p, lax.pow_p,
      lax.atan2_p, lax.rem_p, lax.nextafter_p, lax.select_n_p, lax.clamp_p,
      _internals.add_any_p, lax.broadcast_in_dim_p)
  sliceable = True

  def per_example(self, use) -> tuple:
    def one_call(operands, g, _):
      w = operands[use.w_arg]
      if use.spec.primitive is lax.broadcast_in_dim_p:
        shape = [1] * g.ndim  # The parameter with the output's rank.
        for axis, size in zip(use.spec.params["broadcast_dimensions"], jnp.shape(w)):
          shape[axis] = size
        ct = g
      else:  # Operands of the same rank, or a scalar.
        shape = list(jnp.shape(w)) or [1] * g.ndim
        _, vjp = jax.vjp(use.of_w(operands), jnp.broadcast_to(w, g.shape))
        (ct,) = vjp(g)
      axis, factor = use.spec.out_batch
      broadcast = [a for a in range(g.ndim)
                   if a != axis and shape[a] == 1 and g.shape[a] != 1]
      ct = jnp.sum(ct, axis=tuple(broadcast), keepdims=True)
      ct = moveaxis_batch(ct, 0, axis, factor).sum(1)  # (B, rest with 1 at axis...)
      return ct.reshape((ct.shape[0],) + tuple(jnp.shape(w)))

    return (use.per_call(one_call),)

  def cost(self, use, method: str) -> tuple[str, int, int]:
    del method
    batch, w_size, out = _sizes(use)
    return MATERIALIZED, out, batch * w_size


KIND = register(Elementwise())
