"""Curvature of the loss from Hessian-vector products: top eigenvalue and trace.

A Hessian-vector product `H v` is `jax.jvp` of `jax.grad` of the loss (forward over
reverse), about the cost of two or three gradients and never the Hessian itself:

* `hessian_max_eigenvalue`: power iteration (as Cockpit's HessMaxEV and PyHessian):
  `v <- H v / |H v|`, and the Rayleigh quotient `<v, H v>` of the last iterate;
* `hessian_trace`: Hutchinson's estimator `tr(H) ~ (1/n) sum_k z_k^T H z_k` with
  Rademacher vectors `z_k`, unbiased with variance `(2/n) sum_{i != j} H_ij^2`;
* `hessian_diagonal`: the same products element-wise, `diag(H) ~ (1/n) sum_k z_k *
  H z_k`, whose sums per parameter are the per-parameter traces and whose total is
  `hessian_trace`'s estimate.

Cockpit's HessTrace (and TICDiag's curvature) is BackPACK's exact Hessian diagonal,
which backpropagates a matrix square root of the loss's Hessian through every
layer: not something one ordinary backward pass (or a few Hessian-vector products)
gives. These estimates converge to it as `num_products` grows; on a Hessian that is
diagonal they are exact with any `num_products`. `exact=True` gives the diagonal
(and trace) itself: one product per parameter, `H e_j` for every unit vector `e_j`,
a chunk of them at a time, which is what a small model compared with Cockpit needs.

They take `num_products`, the number of Hessian-vector products, and run them in a
`lax.fori_loop`, so they are jit-safe and their cost is `num_products` products.
Run them every k steps inside the training step with `gl.training_instruments`.

Sharp edges:
  * Power iteration finds the eigenvalue of largest magnitude; when that one is
    negative the result is negative. It converges at the rate `|l2 / l1|`: with
    close top eigenvalues, give it more products.
  * `fun` is differentiated twice (forward over reverse), outside any reap: layers
    marked inside it (`gl.dense`, ...) record nothing there, and cost nothing.
  * `exact=True` costs one Hessian-vector product per parameter (and `chunk` of them
    in memory at once): thousands of parameters, not millions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
from jax import lax


def _float(params: Any):
  """The dtype the estimates accumulate in: float32, or float64 for float64 params."""
  return jnp.result_type(jnp.float32, *jax.tree.leaves(params))


def _vdot(a: Any, b: Any) -> jax.Array:
  """`<a, b>` over the leaves, in `_float(a)`."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return sum(jnp.vdot(x, y).astype(_float(a)) for x, y in pairs)


def _check(api: str, num_products: int) -> None:
  if not isinstance(num_products, int) or num_products < 1:
    raise ValueError(f"{api}(num_products={num_products!r}): num_products must be a "
                     "positive integer, the number of Hessian-vector products to spend.")


def _check_key(api: str, key: Any, exact: bool) -> None:
  if key is None and not exact:
    raise ValueError(f"{api}: give key=, a PRNG key for the random vectors (or "
                     "exact=True for the exact diagonal, one product per parameter).")


def hessian_vector_product(fun: Callable[..., jax.Array], params: Any, *args: Any):
  """Returns `v -> H v`, `H` the Hessian of `fun(params, *args)` w.r.t. `params`."""
  grad = lambda p: jax.grad(fun)(p, *args)
  return lambda v: jax.jvp(grad, (params,), (v,))[1]


def _random_tree(key, params, sample):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(
      treedef, [sample(k, jnp.shape(v), jnp.result_type(v)) for k, v in zip(keys, leaves)])


def hessian_max_eigenvalue(fun: Callable[..., jax.Array], params: Any, *args: Any,
                           key: jax.Array, num_products: int = 20) -> jax.Array:
  """Returns the Hessian's eigenvalue of largest magnitude, by power iteration.

  Args:
    fun: the scalar loss, `fun(params, *args)`.
    params: the parameters (a pytree) at which the Hessian is taken.
    *args: the other arguments of `fun` (the batch).
    key: a PRNG key for the starting vector.
    num_products: the number of Hessian-vector products (iterations).

  Returns:
    A scalar: the Rayleigh quotient `<v, H v>` of the last iterate.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> fun = lambda w: 0.5 * (3 * w[0] ** 2 + w[1] ** 2)  # Hessian diag(3, 1)
    >>> value = gl.hessian_max_eigenvalue(fun, jnp.ones(2), key=jax.random.PRNGKey(0))
    >>> round(float(value), 4)
    3.0
  """
  _check("hessian_max_eigenvalue", num_products)
  hvp = hessian_vector_product(fun, params, *args)
  v = _random_tree(key, params, jax.random.normal)

  def normalise(v):
    norm = jnp.sqrt(_vdot(v, v))
    return jax.tree.map(lambda x: (x / norm).astype(x.dtype), v)

  def step(_, carry):
    v, _ = carry
    hv = hvp(v)
    return normalise(hv), _vdot(v, hv)

  _, value = lax.fori_loop(0, num_products, step, (normalise(v), jnp.zeros((), _float(params))))
  return value


def hessian_trace(fun: Callable[..., jax.Array], params: Any, *args: Any,
                  key: jax.Array | None = None, num_products: int = 20,
                  exact: bool = False) -> jax.Array:
  """Returns Hutchinson's estimate of the Hessian's trace (or the trace itself).

  Args:
    fun: the scalar loss, `fun(params, *args)`.
    params: the parameters (a pytree) at which the Hessian is taken.
    *args: the other arguments of `fun` (the batch).
    key: a PRNG key for the Rademacher vectors (not used when `exact`).
    num_products: the number of Hessian-vector products (samples).
    exact: the sum of `hessian_diagonal(..., exact=True)` instead: one product per
      parameter.

  Returns:
    A scalar: the mean of `z^T H z` over `num_products` Rademacher vectors `z`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> fun = lambda w: 0.5 * (3 * w[0] ** 2 + w[1] ** 2)  # diagonal: z^T H z = tr H
    >>> gl.hessian_trace(fun, jnp.ones(2), key=jax.random.PRNGKey(0), num_products=2)
    Array(4., dtype=float32)
  """
  _check("hessian_trace", num_products)
  _check_key("hessian_trace", key, exact)
  if exact:
    diagonal = hessian_diagonal(fun, params, *args, exact=True)
    return sum(jnp.sum(v, dtype=_float(params)) for v in jax.tree.leaves(diagonal))
  hvp = hessian_vector_product(fun, params, *args)

  def step(i, total):
    z = _rademacher(jax.random.fold_in(key, i), params)
    return total + _vdot(z, hvp(z))

  return lax.fori_loop(0, num_products, step, jnp.zeros((), _float(params))) / num_products


def hessian_diagonal(fun: Callable[..., jax.Array], params: Any, *args: Any,
                     key: jax.Array | None = None, num_products: int = 20,
                     exact: bool = False, chunk: int = 64) -> Any:
  """Returns Hutchinson's estimate of the Hessian's diagonal (or the diagonal itself).

  `diag(H) ~ (1/n) sum_k z_k * (H z_k)` with the Rademacher vectors of
  `hessian_trace` (same `key`, same vectors: the sum of this estimate is that
  trace), unbiased with variance `(1/n) sum_{j != i} H_ij^2` per element.
  `exact=True`: `H_jj = (H e_j)_j` for every parameter element `j`, `chunk`
  products at a time (Cockpit's exact diagonal, at one product per parameter).

  Args:
    fun: the scalar loss, `fun(params, *args)`.
    params: the parameters (a pytree) at which the Hessian is taken.
    *args: the other arguments of `fun` (the batch).
    key: a PRNG key for the Rademacher vectors (not used when `exact`).
    num_products: the number of Hessian-vector products (samples).
    exact: the exact diagonal, from one product per parameter element.
    chunk: with `exact`, how many products are formed at once (vmapped).

  Returns:
    A pytree like `params`.

  Example:
    >>> import jax, jax.numpy as jnp, oryx_gradlog as gl
    >>> fun = lambda w: w[0] ** 2 * w[1] + w[1] ** 2  # H = [[2 w1, 2 w0], [2 w0, 2]]
    >>> gl.hessian_diagonal(fun, jnp.array([1.0, 3.0]), exact=True)
    Array([6., 2.], dtype=float32)
  """
  _check("hessian_diagonal", num_products)
  _check_key("hessian_diagonal", key, exact)
  hvp = hessian_vector_product(fun, params, *args)
  if exact:
    if not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f"hessian_diagonal(chunk={chunk!r}): give a positive integer, the "
                       "number of Hessian-vector products formed at once.")
    return _exact_diagonal(hvp, params, chunk)

  def step(i, total):
    z = _rademacher(jax.random.fold_in(key, i), params)
    return jax.tree.map(lambda t, a, b: t + a * b, total, z, hvp(z))

  zeros = jax.tree.map(jnp.zeros_like, params)
  total = lax.fori_loop(0, num_products, step, zeros)
  return jax.tree.map(lambda t: t / num_products, total)


def _exact_diagonal(hvp, params, chunk):
  """`(H e_j)_j` for every element `j` of the flattened `params`, `chunk` at a time."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  size = flat.size

  def element(j):
    basis = unravel(jax.nn.one_hot(j, size, dtype=flat.dtype))
    product, _ = jax.flatten_util.ravel_pytree(hvp(basis))
    return product[j]

  diagonal = lax.map(element, jnp.arange(size), batch_size=min(chunk, size))
  return unravel(diagonal)


def _rademacher(key, params):
  return _random_tree(key, params, lambda k, shape, dtype: jax.random.rademacher(k, shape, dtype))
