"""LoGra's projected per-example gradients against plain JAX: `P_in^T G_i P_out` of
the `vmap(grad)` gradients `G_i` (a bias as its layer's last row), for dense layers,
a convolution over pixels, a dense layer over positions and an embedding; influence
in the projected space against the dense float64 formulas of `test_influence` applied
to the projected layer inputs and cotangents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_influence import (
    N, Q, _assert_scores, _batches, _conv_model, _embedding_model, _mlp, _mlp_blocks,
    _per_example, _reference)

import oryx_gradlog as gl


def _projected(loss, params, projector, *batch):
  """`gl.projected_grads` inside a jitted step, as a training loop calls it."""
  @jax.jit
  def step(params, *batch):
    records = gl.reap(jax.grad(gl.record_layers(loss)))(params, *batch)
    return gl.projected_grads(records, projector)
  return step(params, *batch)


def _expected(projector, name, grads):
  """`P_in^T G_i P_out` per example (`G_i` `(n, d_in, d_out)`); a diagonal block's
  `v_i` whole, at a mask's coordinates, or `P_1^T V_i P_2` of `v_i` zero-padded into
  a grid of `P_1`'s by `P_2`'s rows."""
  p_in, p_out = (None if p is None else np.asarray(p, np.float64)[0] if p.ndim == 3
                 else np.asarray(p, np.float64) for p in projector.blocks[name])
  grads = np.asarray(grads, np.float64)
  if grads.ndim == 2 and (p_in is None or p_out is None):  # Diagonal: whole, or a mask.
    return grads if p_in is None else grads[:, np.flatnonzero(p_in)]
  if grads.ndim == 2:  # Diagonal, random: the grid's two sides.
    (n1, _), n2 = p_in.shape, p_out.shape[0]
    grid = np.pad(grads, ((0, 0), (0, n1 * n2 - grads.shape[1]))).reshape(-1, n1, n2)
    return np.einsum("nij,ik,jl->nkl", grid, p_in, p_out).reshape(len(grads), -1)
  if p_in is not None:
    grads = np.einsum("ik,nio->nko", p_in, grads)
  if p_out is not None:
    grads = np.einsum("nko,ol->nkl", grads, p_out)
  return grads


def _assert_close(actual, expected, tol=2e-4):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * np.abs(expected).max())


@pytest.mark.parametrize("k", [1, 2])
def test_dense_layers_with_biases_and_a_scale(k):
  params, x, t, forward, loss = _mlp()
  projector = gl.fit_projector(loss, params, _batches(x, t), k=k, seed=3)
  got = _projected(loss, params, projector, x, t).grads
  blocks = _mlp_blocks(params, x, t, forward, loss)
  for name, block in zip(("w1", "w2", "s"), blocks):
    expected = _expected(projector, name, block[-1])
    _assert_close(got[name][:, 0] if got[name].ndim == 4 else got[name], expected)
  # A side of at most k dimensions is kept whole (the scale's 3 entries with k = 2);
  # with k = 1 they are laid out as a 2 x 2 grid, each side projected to 1.
  assert (projector.blocks["s"][0] is None) == (k == 2)
  if k == 1:
    assert [p.shape for p in projector.blocks["s"]] == [(2, 1), (2, 1)]
  assert projector.blocks["w2"][0].shape == (1, 5, k)  # 4 inputs and the bias's 1.


def test_a_convolution_and_a_dense_layer_over_positions():
  params, x, loss, blocks = _conv_model()
  projector = gl.fit_projector(loss, params, _batches(x), k=2)
  got = _projected(loss, params, projector, x).grads
  (_, _, _, kernel), (_, _, _, dense) = blocks(x)
  # P_in's rows follow lax.conv_general_dilated_patches: channel-major, then the
  # kernel's positions (the reference's rows are the kernel's (kh, kw, C)), bias last.
  n = x.shape[0]
  patch_order = jnp.concatenate([
      kernel[:, :18].reshape(n, 3, 3, 2, 3).transpose(0, 3, 1, 2, 4).reshape(n, 18, 3),
      kernel[:, 18:]], axis=1)
  _assert_close(got["k"][:, 0], _expected(projector, "k", patch_order))
  _assert_close(got["w"][:, 0], _expected(projector, "w", dense))


def test_an_embedding():
  params, ids, target, loss = _embedding_model()
  projector = gl.fit_projector(loss, params, _batches(ids, target), k=2)
  assert projector.blocks["table"][0].shape == (1, 7, 2)  # The vocabulary, projected.
  got = _projected(loss, params, projector, ids, target).grads
  grads = _per_example(loss, params, ids, target)
  _assert_close(got["table"][:, 0], _expected(projector, "table", grads["table"]))
  # With k >= the vocabulary, the ids stay one-hot: the table's whole rows.
  whole = gl.fit_projector(loss, params, _batches(ids, target), k=8)
  assert whole.blocks["table"] == (None, None)
  _assert_close(_projected(loss, params, whole, ids, target).grads["table"][:, 0],
                grads["table"])


def test_pca_keeps_the_top_eigenvectors_of_each_covariance():
  params, x, t, forward, loss = _mlp()
  projector = gl.fit_projector(loss, params, _batches(x, t), k=2, init="pca")
  (_, a, g, _), *_ = _mlp_blocks(params, x, t, forward, loss)
  for side, acts in ((0, a), (1, g)):
    acts = np.asarray(acts, np.float64).reshape(-1, acts.shape[-1])
    values, vectors = np.linalg.eigh(acts.T @ acts / acts.shape[0])
    top = vectors[:, ::-1][:, :2]
    p = np.asarray(projector.blocks["w1"][side], np.float64)[0]
    np.testing.assert_allclose(np.abs(top.T @ p), np.eye(2), atol=1e-5)  # Up to sign.
    assert values[-2] > values[-3]  # A top-2 subspace that is well defined.
  # A diagonal block larger than k * k (the scale's 3 entries, k = 1) keeps the
  # coordinate whose per-example gradients have the largest mean square.
  one = gl.fit_projector(loss, params, _batches(x, t), k=1, init="pca")
  (_, _, _, _), _, (_, scale_grads) = _mlp_blocks(params, x, t, forward, loss)
  square = np.mean(np.asarray(scale_grads, np.float64) ** 2, axis=0)
  np.testing.assert_array_equal(one.blocks["s"][0], square == square.max())
  _assert_close(_projected(loss, params, one, x, t).grads["s"],
                np.asarray(scale_grads)[:, [np.argmax(square)]])


@pytest.mark.parametrize("strategy", ["identity", "ekfac", "full"])
def test_influence_in_the_projected_space(strategy):
  params, x, t, forward, loss = _mlp()
  train, query = (x[:N], t[:N]), (x[N:], t[N:])
  projector = gl.fit_projector(loss, params, _batches(*train), k=2, seed=1)
  influence = gl.fit_influence(loss, params, _batches(*train), strategy=strategy,
                               projection=projector)
  scores = influence.scores(_batches(*query, size=Q), _batches(*train))

  def projected_blocks(examples):  # The formulas' inputs, projected by hand.
    out = []
    for name, block in zip(("w1", "w2", "s"), _mlp_blocks(params, *examples, forward, loss)):
      p_in, p_out = projector.blocks[name]
      if block[0] == "diag":
        out.append(("diag", _expected(projector, name, block[1])))
        continue
      _, a, g, grads = block
      out.append(("kron", np.einsum("nti,ik->ntk", a, p_in[0]),
                  np.einsum("nto,ol->ntl", g, p_out[0]), _expected(projector, name, grads)))
    return out

  blocks = projected_blocks(train)
  queries = [b[-1] for b in projected_blocks(query)]
  _assert_scores(scores, _reference(strategy, blocks, queries))
  # The projection travels with the factors: saved and loaded, the same scores.
  leaves, treedef = jax.tree.flatten(influence.factors)
  loaded = jax.tree.unflatten(treedef, [np.asarray(v) for v in leaves])
  again = gl.Influence(loss, params, loaded).scores(_batches(*query, size=Q),
                                                     _batches(*train))
  np.testing.assert_allclose(again, scores, rtol=1e-6)


def test_bad_input_is_a_clear_error():
  params, x, t, _, loss = _mlp()
  with pytest.raises(ValueError, match=r"fit_projector\(init='svd'\): init must be "
                     r"'random'.*or 'pca'"):
    gl.fit_projector(loss, params, _batches(x, t), init="svd")
  with pytest.raises(ValueError, match=r"fit_projector\(k=0\): k is the projected size"):
    gl.fit_projector(loss, params, _batches(x, t), k=0)
  with pytest.raises(ValueError, match=r"fit_projector: `batches` is empty"):
    gl.fit_projector(loss, params, [])
  other, ids, target, other_loss = _embedding_model()
  projector = gl.fit_projector(other_loss, other, _batches(ids, target), k=2)
  with pytest.raises(ValueError, match=r"projected_grads: the projector was fitted for "
                     r"other blocks \(here without a projection: \['s', 'w1', 'w2'\]; "
                     r"fitted but not here: \['table', 'w'\]; of other sizes: none\)"):
    _projected(loss, params, projector, x, t)
  # The same blocks at other sizes: a wider first layer.
  wide = dict(params, w1=jnp.ones((5, 6)), b1=jnp.ones(6), w2=jnp.ones((6, 3)))
  projector = gl.fit_projector(loss, wide, _batches(x, t), k=2)
  with pytest.raises(ValueError, match=r"projected_grads: .*of other sizes: \[\"'w1' "
                     r"\(fitted for \(1, 6, 6\), here \(1, 6, 4\)\)\", \"'w2' \(fitted for "
                     r"\(1, 7, 3\), here \(1, 5, 3\)\)\"\]"):
    _projected(loss, params, projector, x, t)
  # A diagonal block's dense projection of before stop 59 (now a grid's two sides).
  projector = gl.fit_projector(loss, params, _batches(x, t), k=1)
  old = dict(projector.blocks, s=(jnp.ones((3, 1)), None))
  with pytest.raises(ValueError, match=r"of other sizes: \[\"'s' \(fitted for a dense "
                     r"projection, from an older oryx_gradlog, here \(3,\)\)\"\]\). Fit the "
                     r"projector"):
    _projected(loss, params, gl.Projector(old, 1, "random"), x, t)
  other = dict(projector.blocks, s=(jnp.ones((3, 1)), jnp.ones((1, 1))))  # Not 2 x 2.
  with pytest.raises(ValueError, match=r"\[\"'s' \(fitted for a 3 x 1 grid, here \(3,\)\)"):
    _projected(loss, params, gl.Projector(other, 1, "random"), x, t)
  with pytest.raises(TypeError, match=r"fit_influence\(projection=dict\): pass a "
                     r"gl.Projector"):
    gl.fit_influence(loss, params, _batches(x, t), projection={})
