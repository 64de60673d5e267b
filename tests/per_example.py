"""The true computation for the tests of `gl.record_layers`: per-example gradients.

Every example's gradient comes from `jax.vmap(jax.grad(loss), in_axes=(None, 0, ...))`
of the batch loss applied to a batch of one example (for a mean or a sum of
per-example losses, that is the gradient of the example's own loss). From it, in
float64 NumPy: each parameter's per-example norms, the total norm over all
parameters, and the DP-SGD clipped gradient `sum_i min(1, C / |g_i|) g_i` (divided by
the batch size for a mean loss). `check_found` compares the library's
`per_example_norms` and `per_example_clip(...).params` from one reaped backward pass of
`gl.record_layers(loss)` with these, at a relative error of at most 1e-5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl
from oryx_gradlog.record.record_layers import path_name  # Names: tested literally elsewhere.

REL_ERR = 1e-5


def _positions(n_args: int, argnums, batch_argnums) -> tuple[tuple[int, ...], tuple[int, ...]]:
  argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if batch_argnums is None:
    batch_argnums = tuple(i for i in range(n_args) if i not in argnums)
  elif isinstance(batch_argnums, int):
    batch_argnums = (batch_argnums,)
  return argnums, tuple(batch_argnums)


def per_example_grads(loss: Callable, *args, argnums=0, batch_argnums=None,
                      has_aux: bool = False) -> Any:
  """`vmap(grad)` of `loss` on one-example batches: the gradients of argument(s)
  `argnums`, with the example axis in front of every leaf."""
  argnums, batch_argnums = _positions(len(args), argnums, batch_argnums)

  def one(*args):
    args = [jax.tree.map(lambda v: v[None], a) if i in batch_argnums else a
            for i, a in enumerate(args)]
    out = loss(*args)
    return out[0] if has_aux else out

  grad = jax.grad(one, argnums=argnums if len(argnums) > 1 else argnums[0])
  in_axes = tuple(0 if i in batch_argnums else None for i in range(len(args)))
  return jax.jit(jax.vmap(grad, in_axes=in_axes))(*args)


def _flat(grads) -> list[tuple[str, np.ndarray]]:
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  return [(path_name(p), np.asarray(g, np.float64)) for p, g in leaves]


def norms_of(grads) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Per parameter path its per-example norms `(B,)`, and the total norms `(B,)`."""
  flat = _flat(grads)
  batch = flat[0][1].shape[0]
  layers = {name: np.sqrt(np.sum(g.reshape(batch, -1) ** 2, axis=1)) for name, g in flat}
  total = np.sqrt(sum(n ** 2 for n in layers.values()))
  return layers, total


def clip(grads, l2_norm_clip: float, reduction: str):
  """`sum_i min(1, C / |g_i|) g_i` (divided by B for a mean), like the parameters."""
  _, total = norms_of(grads)
  factors = np.minimum(1.0, l2_norm_clip / np.maximum(total, 1e-30))
  divisor = len(total) if reduction == "mean" else 1
  return jax.tree.map(
      lambda g: np.tensordot(factors, np.asarray(g, np.float64), axes=1) / divisor, grads)


def median_clip(grads) -> float:
  """A clip norm that clips about half the examples (so both branches are tested)."""
  _, total = norms_of(grads)
  return float(np.median(total))


def assert_rel_err(actual, expected, tol: float = REL_ERR) -> None:
  """Per leaf, `|actual - expected| / |expected|` (Frobenius norms) at most `tol`.

  A leaf whose gradient vanishes (an attention key's bias: softmax ignores it) is
  float noise; its error is taken relative to a thousandth of the whole gradient's
  norm instead.
  """
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
      jax.tree.structure(actual), jax.tree.structure(expected))
  flat = _flat(expected)
  floor = 1e-3 * np.sqrt(sum(np.sum(e ** 2) for _, e in flat))
  for (path, a), (_, e) in zip(_flat(actual), flat):
    assert a.shape == e.shape, (path, a.shape, e.shape)
    err = np.linalg.norm(a - e) / max(np.linalg.norm(e), floor, 1e-30)
    assert err <= tol, f"{path}: relative error {err:.2e}"


def assert_norms_close(actual, expected, tol: float = REL_ERR, what: str = "",
                       scale: float | None = None) -> None:
  """Element-wise relative error of per-example norms at most `tol`; norms below a
  thousandth of `scale` (default: the largest expected norm) are float noise, checked
  to `tol` times that."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  scale = float(np.max(np.abs(expected))) if scale is None else scale
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * 1e-3 * scale,
                             err_msg=what)


@dataclasses.dataclass
class Found:
  """What the library computed from one reaped backward pass."""

  norms: gl.PerExampleNorms
  clipped: Any  # ClippedGrads.params


def found(loss: Callable, *args, reduction: str = "mean", method: str = "auto",
          l2_norm_clip: float = 1.0, argnums=0, batch_argnums=None,
          wrap: Callable = jax.jit) -> Found:
  """Library computation: `per_example_norms` and `per_example_clip(...).params` of the
  records of `jax.grad(gl.record_layers(loss))`, under `wrap` (default `jit`)."""
  recorded = gl.record_layers(loss, argnums=argnums, batch_argnums=batch_argnums)
  grad_argnums = argnums if isinstance(argnums, int) else tuple(argnums)

  def run(*args):
    records = gl.reap(jax.grad(recorded, argnums=grad_argnums))(*args)
    norms = gl.per_example_norms(records, reduction=reduction, method=method)
    clipped = gl.per_example_clip(records, l2_norm_clip=l2_norm_clip, reduction=reduction,
                               method=method)
    return Found(norms, clipped.params)

  return wrap(run)(*args)


jax.tree_util.register_dataclass(Found, data_fields=["norms", "clipped"], meta_fields=[])


def check_found(loss: Callable, *args, reduction: str = "mean", method: str = "auto",
                argnums=0, batch_argnums=None, names: Sequence[str] | None = None,
                tol: float = REL_ERR, wrap: Callable = jax.jit,
                reference_args: tuple | None = None, grads: Any = None) -> Found:
  """Checks per-example norms (per parameter path and total) and the clipped
  gradient of `gl.record_layers(loss)` against `vmap(grad)`.

  Args:
    loss: the batch loss (a mean or sum of per-example losses, as `reduction` says).
    *args: its arguments (parameters and batch).
    names: the parameter paths the norms must have (default: every leaf's path,
      but a leaf whose gradient is zero may be missing: it has no use).
    reference_args: other arguments for the true computation (e.g. parameters cast
      to float32 where the library gets a lower precision).
    grads: the per-example gradients, where the caller has them already.

  Returns:
    The library's results, for further checks.
  """
  if grads is None:
    grads = per_example_grads(loss, *(reference_args or args), argnums=argnums,
                              batch_argnums=batch_argnums)
  expected_layers, expected_total = norms_of(grads)
  l2_norm_clip = median_clip(grads)
  result = found(loss, *args, reduction=reduction, method=method, argnums=argnums,
                 batch_argnums=batch_argnums, l2_norm_clip=l2_norm_clip, wrap=wrap)
  if names is None:  # A parameter with no use (zero gradients) may have no norms.
    names = [n for n in expected_layers if np.any(expected_layers[n]) or n in
             result.norms.layers]
  assert sorted(result.norms.layers) == sorted(names), (sorted(result.norms.layers), names)
  for name in names:
    assert_norms_close(result.norms.layers[name], expected_layers[name], tol, name,
                       scale=float(np.max(expected_total)))
  assert_norms_close(result.norms.norms, expected_total, tol, "total")
  expected_clipped = clip(grads, l2_norm_clip, reduction)
  assert_rel_err(result.clipped, expected_clipped, tol)
  return result


def check_clipped_grad(loss: Callable, *args, reduction: str = "mean", argnums=0,
                       batch_argnums=None, tol: float = REL_ERR, grads: Any = None) -> None:
  """Checks `gl.clipped_grad(loss)` (under `jit`, with its norms) against `vmap(grad)`
  and clipping (`grads`: the per-example gradients, where the caller has them)."""
  if grads is None:
    grads = per_example_grads(loss, *args, argnums=argnums, batch_argnums=batch_argnums)
  l2_norm_clip = median_clip(grads)
  clipped, norms = jax.jit(gl.clipped_grad(
      loss, l2_norm_clip=l2_norm_clip, reduction=reduction, argnums=argnums,
      batch_argnums=batch_argnums, return_norms=True))(*args)
  assert_norms_close(norms, norms_of(grads)[1], tol, "total")
  assert_rel_err(clipped, clip(grads, l2_norm_clip, reduction), tol)
