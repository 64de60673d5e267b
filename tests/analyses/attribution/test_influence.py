"""`gl.fit_influence` against plain JAX: identity scores are `vmap(grad)` inner
products; K-FAC and EK-FAC scores are their formulas computed densely in float64
NumPy from `vmap(grad)` per-example gradients, the layers' inputs and the output
cotangents of the zero-perturbation trick, and `np.linalg.eigh`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import oryx_gradlog as gl

N, Q, B = 12, 3, 4  # training examples, queries, batch size


def _normal(key, *shape, scale=0.5):
  return scale * jax.random.normal(jax.random.PRNGKey(key), shape)


def _batches(*arrays, size=B):
  n = arrays[0].shape[0]
  return [tuple(a[i:i + size] for a in arrays) for i in range(0, n, size)]


# ----------------------------------------------------------------------------------
# The dense formulas, from per-block per-example quantities (float64).


def _truncated(pre, rank):
  """Each query's `(i, o)` matrix at its best rank-`rank` approximation (NumPy's SVD);
  as it is for `rank=None`."""
  if rank is None:
    return pre
  u, s, vt = np.linalg.svd(pre, full_matrices=False)
  return np.einsum("qir,qr,qro->qio", u[..., :rank], s[..., :rank], vt[..., :rank, :])


def _reference(strategy, blocks, queries, damping=None, train=None, rank=None):
  """`blocks`: per block, `("kron", a (N, T, i), g (N, T, o), G (N, i, o))` or
  `("diag", G (N, n))` of the training examples; `queries`: per block its query
  gradients `(Q, i, o)` or `(Q, n)`; `train`: per block the training gradients
  scored (default: the blocks' `G`, which the curvature is fitted from); `rank`:
  each query's preconditioned gradient of a Kronecker block truncated to it.
  Returns `(Q, N)` scores."""
  total = 0.0
  train = [b[-1] for b in blocks] if train is None else train
  for block, gq, scored in zip(blocks, queries, train):
    scored = np.asarray(scored, np.float64)
    if strategy == "full":  # Each block's whole Fisher of its flattened gradients.
      grads = np.asarray(block[-1], np.float64).reshape(block[-1].shape[0], -1)
      fisher = grads.T @ grads / grads.shape[0]
      eig = np.maximum(np.linalg.eigvalsh(fisher), 0.0)
      damp = 0.1 * eig.mean() if damping is None else damping
      gq = np.asarray(gq, np.float64).reshape(gq.shape[0], -1)
      total = total + gq @ np.linalg.solve(fisher + damp * np.eye(len(fisher)),
                                           scored.reshape(scored.shape[0], -1).T)
      continue
    if block[0] == "kron":
      _, a, g, grads = (np.asarray(v, np.float64) if not isinstance(v, str) else v
                        for v in block)
      if strategy == "identity":
        total = total + np.einsum("qio,nio->qn", _truncated(gq, rank), scored)
        continue
      count = a.shape[0] * a.shape[1]
      e_a, q_a = np.linalg.eigh(np.einsum("nti,ntj->ij", a, a) / count)
      e_s, q_s = np.linalg.eigh(np.einsum("nto,ntp->op", g, g) / count)
      if strategy == "kfac":
        eig = np.outer(e_a, e_s)
      else:
        eig = np.mean(np.einsum("ij,nio,op->njp", q_a, grads, q_s) ** 2, axis=0)
      damp = 0.1 * eig.mean() if damping is None else damping
      rotated = np.einsum("ij,qio,op->qjp", q_a, gq, q_s) / (eig + damp)
      pre = _truncated(np.einsum("ij,qjp,op->qio", q_a, rotated, q_s), rank)
      total = total + np.einsum("qio,nio->qn", pre, scored)
    else:
      grads = np.asarray(block[1], np.float64)
      if strategy == "identity":
        total = total + gq @ scored.T
        continue
      eig = np.mean(grads ** 2, axis=0)
      damp = 0.1 * eig.mean() if damping is None else damping
      total = total + (gq / (eig + damp)) @ scored.T
  return total


def _assert_scores(actual, expected, tol=2e-4):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * np.abs(expected).max())


def _per_example(loss, params, *batch):
  """`vmap(grad)` of the loss of one-example batches."""
  one = lambda p, *ex: loss(p, *(v[None] for v in ex))
  return jax.vmap(jax.grad(one), in_axes=(None,) + (0,) * len(batch))(params, *batch)


# ----------------------------------------------------------------------------------
# An MLP: two dense layers with biases (each bias in its layer's block) and an
# element-wise output scale (a diagonal block).


def _mlp():
  params = {"w1": _normal(1, 5, 4), "b1": _normal(2, 4), "w2": _normal(3, 4, 3),
            "b2": _normal(4, 3), "s": 1 + _normal(5, 3, scale=0.2)}
  x, t = _normal(6, N + Q, 5, scale=1.0), _normal(7, N + Q, 3, scale=1.0)

  def forward(p, x, e1=0.0, e2=0.0):
    z1 = x @ p["w1"] + p["b1"] + e1
    h = jnp.tanh(z1)
    z2 = h @ p["w2"] + p["b2"] + e2
    return z2 * p["s"], h

  def loss(p, x, t):
    y, _ = forward(p, x)
    return jnp.mean(0.5 * jnp.sum((y - t) ** 2, axis=-1))

  return params, x, t, forward, loss


def _mlp_blocks(params, x, t, forward, loss):
  grads = _per_example(loss, params, x, t)
  _, h = forward(params, x)

  def pert(e1, e2, x, t):  # One example: the cotangents of z1 and z2.
    y, _ = forward(params, x[None], e1, e2)
    return 0.5 * jnp.sum((y[0] - t) ** 2)

  g1, g2 = jax.vmap(jax.grad(pert, argnums=(0, 1)), in_axes=(None, None, 0, 0))(
      jnp.zeros(4), jnp.zeros(3), x, t)
  ones = jnp.ones((x.shape[0], 1))
  a1, a2 = jnp.concatenate([x, ones], 1), jnp.concatenate([h, ones], 1)
  full1 = jnp.concatenate([grads["w1"], grads["b1"][:, None]], 1)
  full2 = jnp.concatenate([grads["w2"], grads["b2"][:, None]], 1)
  return [("kron", a1[:, None], g1[:, None], full1), ("kron", a2[:, None], g2[:, None], full2),
          ("diag", grads["s"])]


@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac", "full"])
def test_mlp_scores_match_the_dense_formulas(strategy):
  params, x, t, forward, loss = _mlp()
  train, query = (x[:N], t[:N]), (x[N:], t[N:])
  influence = gl.fit_influence(loss, params, _batches(*train), strategy=strategy)
  scores = influence.scores(_batches(*query, size=Q), _batches(*train))
  blocks = _mlp_blocks(params, *train, forward, loss)
  queries = [b[-1] for b in _mlp_blocks(params, *query, forward, loss)]
  _assert_scores(scores, _reference(strategy, blocks, queries))
  if strategy == "identity":  # Plain gradient products over every parameter.
    flat = lambda g: jnp.concatenate([v.reshape(v.shape[0], -1) for v in jax.tree.leaves(g)], 1)
    gq, gt = flat(_per_example(loss, params, *query)), flat(_per_example(loss, params, *train))
    _assert_scores(scores, gq @ gt.T)
  own = influence.self_influence(_batches(*train))
  diagonal = _reference(strategy, blocks, [b[-1] for b in blocks])
  np.testing.assert_allclose(own, np.diag(diagonal), rtol=5e-4)
  # Blocks: each dense layer with its bias, the scale alone.
  assert {k: b.keys for k, b in influence.factors.blocks.items()} == {
      "w1": ("w1", "b1"), "w2": ("w2", "b2"), "s": ("s",)}
  # Queries a block at a time (one batch of 2, then 1): the same scores.
  blocked = influence.scores(_batches(*query, size=2), _batches(*train), query_block=2)
  _assert_scores(blocked, scores, tol=1e-6)
  # Each query a batch of its own, all held at once (joined): the same scores.
  joined = influence.scores(_batches(*query, size=1), _batches(*train))
  _assert_scores(joined, scores, tol=1e-6)


def test_the_query_batches_are_joined_freeing_each_batch():
  from oryx_gradlog.analyses.attribution import _influence
  # Setup: three batches' parts, a stacked `(S, Q, ...)` block and a `(Q, ...)` one.
  parts = [{"stacked": jnp.full((2, i + 1, 3, 4), i), "flat": jnp.full((i + 1, 5), i)}
           for i in range(3)]
  given = [v for part in parts for v in jax.tree.leaves(part)]
  # True computation: NumPy's concatenation along the queries' axis.
  expected = {"stacked": np.concatenate([np.asarray(p["stacked"]) for p in parts], 1),
              "flat": np.concatenate([np.asarray(p["flat"]) for p in parts], 0)}
  got = _influence._joined(parts)
  # Expected: equal, and the device holds the whole once: each batch's array freed.
  np.testing.assert_array_equal(got["stacked"], expected["stacked"])
  np.testing.assert_array_equal(got["flat"], expected["flat"])
  assert parts == [] and all(v.is_deleted() for v in given)


@pytest.mark.parametrize("strategy", ["identity", "ekfac"])
def test_batches_of_any_size_one_example_included_and_dict_batches(strategy):
  params, x, t, forward, loss = _mlp()
  train, query = (x[:N], t[:N]), (x[N:], t[N:])
  blocks = _mlp_blocks(params, *train, forward, loss)
  queries = [b[-1] for b in _mlp_blocks(params, *query, forward, loss)]
  expected = _reference(strategy, blocks, queries)
  own = np.diag(_reference(strategy, blocks, [b[-1] for b in blocks]))
  # Training batches of 5, 4, 2 and 1 examples; each query a batch of its own.
  cuts = [0, 5, 9, 11, 12]
  ragged = [(x[a:b], t[a:b]) for a, b in zip(cuts, cuts[1:])]
  ones = [(x[N + i:N + i + 1], t[N + i:N + i + 1]) for i in range(Q)]
  influence = gl.fit_influence(loss, params, ragged, strategy=strategy)
  _assert_scores(influence.scores(ones, ragged), expected)
  np.testing.assert_allclose(influence.self_influence(ragged), own, rtol=5e-4)
  # The same batches as dicts, for a loss that takes the batch as one argument.
  as_dict = lambda batch: {"x": batch[0], "y": batch[1]}
  dict_loss = lambda p, batch: loss(p, batch["x"], batch["y"])
  influence = gl.fit_influence(dict_loss, params, [as_dict(b) for b in ragged],
                               strategy=strategy)
  _assert_scores(influence.scores([as_dict(b) for b in ones], [as_dict(b) for b in ragged]),
                 expected)


def test_one_example_of_an_optax_classification_loss_is_scored():
  optax = pytest.importorskip("optax")
  params = {"w": _normal(1, 5, 3), "b": _normal(2, 3)}
  x, labels = _normal(3, 8, 5, scale=1.0), jnp.arange(8) % 3

  def loss(p, x, labels):  # gathers the labels' logits: traced differently at one example
    logits = x @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  influence = gl.fit_influence(loss, params, _batches(x, labels), strategy="identity")
  scores = influence.scores([(x[:1], labels[:1])], _batches(x, labels))
  flat = lambda g: jnp.concatenate([v.reshape(v.shape[0], -1) for v in jax.tree.leaves(g)], 1)
  grads = flat(_per_example(loss, params, x, labels))
  _assert_scores(scores, grads[:1] @ grads.T)


@pytest.mark.parametrize("passes", ["one_forward", "forward_again_for_the_labels"])
@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_sampled_labels_fit_the_true_fisher(strategy, passes):
  """The curvature from the gradients at labels drawn from the model (a Gaussian
  likelihood: targets drawn around the prediction), batch i's with fold_in(key, i);
  the scores of the data's own labels."""
  params, x, t, forward, loss = _mlp()
  train, query = (x[:N], t[:N]), (x[N:], t[N:])
  key = jax.random.PRNGKey(7)

  def sampled_loss(p, x, t, key):  # Labels drawn from the model's output.
    y, _ = forward(p, x)
    mean = y if passes == "one_forward" else forward(p, x)[0]  # Under stop_gradient.
    drawn = lax.stop_gradient(mean) + jax.random.normal(key, t.shape)
    return jnp.mean(0.5 * jnp.sum((y - drawn) ** 2, axis=-1))

  influence = gl.fit_influence(loss, params, _batches(*train), strategy=strategy,
                               sampled_loss=sampled_loss, key=key)
  scores = influence.scores(_batches(*query), _batches(*train))
  drawn = jnp.concatenate([
      forward(params, xb)[0] + jax.random.normal(jax.random.fold_in(key, i), tb.shape)
      for i, (xb, tb) in enumerate(_batches(*train))])
  blocks = _mlp_blocks(params, train[0], drawn, forward, loss)
  scored = [b[-1] for b in _mlp_blocks(params, *train, forward, loss)]
  queries = [b[-1] for b in _mlp_blocks(params, *query, forward, loss)]
  _assert_scores(scores, _reference(strategy, blocks, queries, train=scored))
  # Not the empirical Fisher's scores.
  empirical = gl.fit_influence(loss, params, _batches(*train), strategy=strategy)
  assert not np.allclose(empirical.scores(_batches(*query), _batches(*train)), scores,
                         rtol=1e-2)


def test_damping_given_and_hand_marked_layers_give_the_same_scores():
  params, x, t, forward, loss = _mlp()

  def marked(p, x, t):  # The same MLP, its layers marked by hand.
    h = jnp.tanh(gl.dense(x, p["w1"], p["b1"], name="fc1"))
    y = gl.dense(h, p["w2"], p["b2"], name="fc2") * p["s"]
    return jnp.mean(0.5 * jnp.sum((y - t) ** 2, axis=-1))

  train, query = _batches(x[:N], t[:N]), _batches(x[N:], t[N:], size=Q)
  plain = gl.fit_influence(loss, params, train, damping=0.3).scores(query, train)
  hand = gl.fit_influence(marked, params, train, damping=0.3).scores(query, train)
  blocks = _mlp_blocks(params, x[:N], t[:N], forward, loss)
  queries = [b[-1] for b in _mlp_blocks(params, x[N:], t[N:], forward, loss)]
  _assert_scores(plain, _reference("ekfac", blocks, queries, damping=0.3))
  _assert_scores(hand, plain)


# ----------------------------------------------------------------------------------
# Positions: a dense layer over tokens, and a convolution over pixels.


def _conv_model():
  """A convolution with a bias, then a dense layer over its 20 pixels: the model, and
  `blocks(x)`, its per-block reference quantities (as `_mlp_blocks`)."""
  params = {"k": _normal(1, 3, 3, 2, 3), "kb": _normal(2, 3), "w": _normal(3, 3, 2)}
  x = _normal(4, N + Q, 5, 4, 2, scale=1.0)
  options = dict(window_strides=(1, 1), padding="SAME",
                 dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def forward(p, x, e1=0.0, e2=0.0):
    z1 = lax.conv_general_dilated(x, p["k"], **options) + p["kb"] + e1
    h = jnp.tanh(z1).reshape(x.shape[0], -1, 3)  # (B, T = 20 pixels, 3)
    return h @ p["w"] + e2, h

  def loss(p, x):
    y, _ = forward(p, x)
    return jnp.mean(0.5 * jnp.sum(jnp.tanh(y) ** 2, axis=(1, 2)))

  def blocks(x):
    grads = _per_example(loss, params, x)
    _, h = forward(params, x)

    def pert(e1, e2, x):
      y, _ = forward(params, x[None], e1, e2)
      return 0.5 * jnp.sum(jnp.tanh(y) ** 2)

    g1, g2 = jax.vmap(jax.grad(pert, argnums=(0, 1)), in_axes=(None, None, 0))(
        jnp.zeros((1, 5, 4, 3)), jnp.zeros((1, 20, 2)), x)
    patches = lax.conv_general_dilated_patches(
        x, (3, 3), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    n = x.shape[0]
    # Patches are (C, kh, kw)-major: the kernel's (kh, kw, C) rows, reordered.
    a1 = patches.reshape(n, 20, 2, 3, 3).transpose(0, 1, 3, 4, 2).reshape(n, 20, 18)
    a1 = jnp.concatenate([a1, jnp.ones((n, 20, 1))], -1)
    full1 = jnp.concatenate([grads["k"].reshape(n, 18, 3), grads["kb"][:, None]], 1)
    return [("kron", a1, g1.reshape(n, 20, 3), full1),
            ("kron", h, g2.reshape(n, 20, 2), grads["w"])]

  return params, x, loss, blocks


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_dense_over_positions_and_a_convolution(strategy):
  params, x, loss, blocks = _conv_model()
  train, query = _batches(x[:N]), _batches(x[N:], size=Q)
  influence = gl.fit_influence(loss, params, train, strategy=strategy)
  got = influence.scores(query, train)
  expected = _reference(strategy, blocks(x[:N]), [b[-1] for b in blocks(x[N:])])
  _assert_scores(got, expected, tol=5e-4)


@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac", "full"])
def test_low_rank_queries_are_the_truncated_svd_of_the_preconditioned_gradients(strategy):
  params, x, t, forward, loss = _mlp()
  train, query = (x[:N], t[:N]), (x[N:], t[N:])
  influence = gl.fit_influence(loss, params, _batches(*train), strategy=strategy)
  blocks = _mlp_blocks(params, *train, forward, loss)
  queries = [b[-1] for b in _mlp_blocks(params, *query, forward, loss)]
  for rank in (1, 2):  # (6 x 4 and 5 x 3 blocks: rank + 10 covers them, exact)
    got = influence.scores(_batches(*query, size=2), _batches(*train), query_rank=rank,
                           query_block=2)
    # "full" blocks keep their whole gradients.
    _assert_scores(got, _reference(strategy, blocks, queries,
                                   rank=None if strategy == "full" else rank))
  if strategy == "identity":  # One position: each query's gradient has rank 1.
    flat = lambda g: jnp.concatenate([v.reshape(v.shape[0], -1) for v in jax.tree.leaves(g)], 1)
    gq, gt = flat(_per_example(loss, params, *query)), flat(_per_example(loss, params, *train))
    _assert_scores(got, gq @ gt.T)


@pytest.mark.parametrize("rank", [1, 2])  # Scored factored (x a)(g b), and formed.
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # All queries' a b^T at once; one each.
def test_low_rank_queries_over_positions_and_a_convolution(rank, chunk_bytes, monkeypatch):
  from oryx_gradlog.analyses.attribution import _low_rank  # pylint: disable=g-import-not-at-top
  if chunk_bytes is not None:
    monkeypatch.setattr(_low_rank, "_CHUNK_BYTES", chunk_bytes)
  params, x, loss, blocks = _conv_model()
  train, query = _batches(x[:N]), _batches(x[N:], size=Q)
  influence = gl.fit_influence(loss, params, train, strategy="ekfac")
  got = influence.scores(query, train, query_rank=rank)
  expected = _reference("ekfac", blocks(x[:N]), [b[-1] for b in blocks(x[N:])], rank=rank)
  _assert_scores(got, expected, tol=5e-4)


def test_low_rank_queries_of_a_wide_layer_are_close_to_the_best_approximation():
  """A 40 x 32 layer over 24 positions at rank 4: the randomized SVD's sketch (14
  columns) is smaller than the layer, so the factors are near, not at, the best."""
  params = {"w": _normal(1, 40, 32, scale=0.2)}
  x = _normal(2, N + Q, 24, 40, scale=1.0)

  def loss(p, x):
    return jnp.mean(jnp.sum(jnp.tanh(x @ p["w"]) ** 2, axis=(1, 2)))

  def pert(e, x):  # One example: the cotangent of its layer output.
    return jnp.sum(jnp.tanh(x @ params["w"] + e) ** 2)

  g = jax.vmap(jax.grad(pert))(jnp.zeros((N + Q, 24, 32)), x)
  grads = jnp.einsum("nti,nto->nio", x, g)
  train, query = _batches(x[:N]), _batches(x[N:], size=Q)
  influence = gl.fit_influence(loss, params, train, strategy="ekfac")
  blocks = [("kron", x[:N], g[:N], grads[:N])]
  got = influence.scores(query, train, query_rank=4)
  _assert_scores(got, _reference("ekfac", blocks, [grads[N:]], rank=4), tol=2e-3)
  whole = _reference("ekfac", blocks, [grads[N:]])
  assert np.abs(got - whole).max() > 1e-2 * np.abs(whole).max()  # Rank 4 is not all.


# ----------------------------------------------------------------------------------
# Embeddings (a Kronecker block of one-hot inputs), factors saved and loaded, top_k,
# bad input.


def _embedding_model():
  params = {"table": _normal(1, 7, 3), "w": _normal(2, 3, 2)}  # 4 ids per example
  ids = jax.random.randint(jax.random.PRNGKey(3), (N + Q, 4), 0, 7)
  target = _normal(4, N + Q, 2, scale=1.0)

  def loss(p, ids, target):
    y = jnp.mean(p["table"][ids], axis=1) @ p["w"]
    return jnp.mean(0.5 * jnp.sum((y - target) ** 2, axis=-1))

  return params, ids, target, loss


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_embedding_and_saved_factors(strategy):
  params, ids, target, loss = _embedding_model()
  train, query = _batches(ids[:N], target[:N]), _batches(ids[N:], target[N:], size=Q)
  influence = gl.fit_influence(loss, params, train, strategy=strategy)
  assert influence.factors.blocks["table"].q_a is None  # One-hot inputs: A is diagonal.
  scores = influence.scores(query, train)
  # The embedding: a Kronecker block whose inputs are the ids' one-hots.
  grads = _per_example(loss, params, ids[:N], target[:N])
  grads_q = _per_example(loss, params, ids[N:], target[N:])
  rows = lambda ids: params["table"][ids]  # (n, T, 3)

  def pert(e_rows, e_out, ids, target):  # One example: cotangents of rows and output.
    y = jnp.mean(rows(ids) + e_rows, axis=0) @ params["w"] + e_out
    return 0.5 * jnp.sum((y - target) ** 2)

  def cotangents(ids, t):
    return jax.vmap(jax.grad(pert, argnums=(0, 1)), in_axes=(None, None, 0, 0))(
        jnp.zeros((4, 3)), jnp.zeros(2), ids, t)

  g_rows, g_out = cotangents(ids[:N], target[:N])
  blocks = [("kron", jax.nn.one_hot(ids[:N], 7), g_rows, grads["table"]),
            ("kron", jnp.mean(rows(ids[:N]), axis=1)[:, None], g_out[:, None], grads["w"])]
  queries = [grads_q["table"], grads_q["w"]]
  _assert_scores(scores, _reference(strategy, blocks, queries))
  # Saved as arrays, loaded into the same structure: the same scores.
  leaves, treedef = jax.tree.flatten(influence.factors)
  loaded = jax.tree.unflatten(treedef, [np.asarray(v) for v in leaves])
  again = gl.Influence(loss, params, loaded).scores(query, train)
  np.testing.assert_allclose(again, scores, rtol=1e-6)
  helpful, harmful = gl.Influence.top_k(scores, 2)
  np.testing.assert_array_equal(helpful, np.argsort(-scores, axis=1)[:, :2])
  np.testing.assert_array_equal(harmful, np.argsort(scores, axis=1)[:, :2])


def test_bad_input_is_a_clear_error():
  params, x, t, _, loss = _mlp()
  train = _batches(x[:N], t[:N])
  summed = lambda p, x, t: loss(p, x, t) * x.shape[0]
  with pytest.raises(ValueError, match=r"fit_influence: loss\(params, \*batch\) is .* mean "
                     r"over the batch of per-example losses"):
    gl.fit_influence(summed, params, train)
  with pytest.raises(ValueError, match=r"fit_influence: the arrays of batches\[1\] hold "
                     r"different numbers of examples \(batches\[1\]\[0\] has 4, "
                     r"batches\[1\]\[1\] has 3\)"):
    gl.fit_influence(loss, params, [train[0], (x[4:8], t[4:7])], strategy="kfac")
  with pytest.raises(ValueError, match=r"fit_influence: batches\[0\]\[1\] has no leading "
                     r"\(batch\) axis"):
    gl.fit_influence(loss, params, [(x[:4], jnp.float32(1.0))], strategy="kfac")
  with pytest.raises(TypeError, match="is an iterator"):
    gl.fit_influence(loss, params, iter(train))
  per_example = lambda p, x, t: 0.5 * jnp.sum((x @ p["w1"] - t[:, :1]) ** 2, axis=-1)
  with pytest.raises(ValueError, match=r"fit_influence: loss\(params, \*batch\) returns an "
                     r"array of shape \(4,\) on the first batch, not a number"):
    gl.fit_influence(per_example, params, train)
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
  leaves = jax.tree.leaves(model)
  if not leaves or not all(isinstance(v, jax.Array) for v in leaves):  # Not arrays.
    with pytest.raises(TypeError, match=r"fit_influence: params.* is a .*, not an array.*"
                       r"nnx.split\(model, nnx.Param, ...\)"):
      gl.fit_influence(lambda m, x, t: jnp.mean((m(x) - t) ** 2), model, train)
  with pytest.raises(ValueError, match="strategy must be one of"):
    gl.fit_influence(loss, params, train, strategy="lissa")
  with pytest.raises(ValueError, match=r"fit_influence\(key=...\): the key is for "
                     "sampled_loss"):
    gl.fit_influence(loss, params, train, key=jax.random.PRNGKey(1))
  influence = gl.fit_influence(loss, params, train, strategy="kfac")
  twice = lambda p, x, t: loss(p, x, t) + jnp.mean(x @ p["w1"])  # w1 used twice
  with pytest.raises(TypeError, match="`train_batches` is an iterator"):
    influence.scores(train, iter(train), query_block=2)
  with pytest.raises(ValueError, match=r"query_block=0\): give a positive number"):
    influence.scores(train, train, query_block=0)
  with pytest.raises(ValueError, match=r"query_rank=0\): give a positive rank"):
    influence.scores(train, train, query_rank=0)
  with pytest.raises(TypeError, match=r"Influence.scores: the loss cannot take the "
                     r"parameters and a batch of 1 argument\(s\) .* not the arrays of one "
                     r"batch \(x, y\)"):
    influence.scores(train[0], train)  # One batch (x, y) where a list of them belongs.
  with pytest.raises(ValueError, match=r"parameters 'b1', 'w1' are not covered by the "
                     r"fitted factors as they are used here"):
    influence.scores(train, train, measurement=twice)
  wider = dict(params, w1=jnp.ones((5, 6)), b1=jnp.ones(6), w2=jnp.ones((6, 3)))
  with pytest.raises(ValueError, match=r"'w1' \(fitted with \(1, 6, 4\), here \(1, 6, 6\)\)"):
    gl.Influence(loss, wider, influence.factors).scores(train, train)
  big = {"w": jnp.ones((5, 1000))}  # 5,000 gradient numbers per example.
  big_loss = lambda p, x, t: jnp.mean(jnp.sum(jnp.tanh(x @ p["w"]) ** 2, axis=-1))
  with pytest.raises(ValueError, match=r"fit_influence\(strategy='full'\): block 'w' has "
                     r"5000 gradient numbers per example .*\(projection=gl.fit_projector"):
    gl.fit_influence(big_loss, big, train, strategy="full")


def test_layer_coverage_names_each_parameters_block():
  params, x, t, _, loss = _mlp()
  coverage = gl.layer_coverage(loss, params, x[:B], t[:B])
  assert {p: c.influence for p, c in coverage.params.items()} == {
      "b1": "kronecker (bias of w1)", "b2": "kronecker (bias of w2)", "s": "diagonal",
      "w1": "kronecker", "w2": "kronecker"}
  # A bias must vary along the layer's output features only: one broadcast along
  # the positions (a learned position offset of the same size) is not a bias.
  w, offset = _normal(1, 3, 4), _normal(2, 4)
  xs = _normal(3, B, 4, 3, scale=1.0)  # 4 positions = 4 features
  positional = lambda p, x: jnp.mean((x @ p["w"] + p["offset"][:, None]) ** 2)
  coverage = gl.layer_coverage(positional, {"w": w, "offset": offset}, xs)
  assert coverage.params["offset"].influence == "diagonal"


def test_lds_is_the_mean_spearman_correlation_of_subset_sums():
  from scipy import stats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(5, 30))
  subsets = rng.random((40, 30)) < 0.5
  measurements = -(subsets @ scores.T) + rng.normal(scale=2.0, size=(40, 5))
  measurements[:, 0] = np.round(measurements[:, 0])  # ties
  expected = np.mean([stats.spearmanr(-(subsets @ scores[q]), measurements[:, q]).statistic
                      for q in range(5)])
  np.testing.assert_allclose(gl.lds(scores, subsets, measurements), expected, rtol=1e-12)
  indices = np.stack([np.flatnonzero(rng.permutation(30) < 15) for _ in range(40)])
  masks = np.zeros((40, 30), bool)
  np.put_along_axis(masks, indices, True, 1)
  np.testing.assert_allclose(gl.lds(scores, indices, measurements),
                             gl.lds(scores, masks, measurements))
  with pytest.raises(ValueError, match=r"measurements have shape \(5, 40\); expected"):
    gl.lds(scores, subsets, measurements.T)


def test_passes_show_progress_and_results_print_in_a_line(capsys):
  pytest.importorskip("tqdm")
  params, x, t, _, loss = _mlp()
  train = _batches(x[:N], t[:N])
  influence = gl.fit_influence(loss, params, train)  # EK-FAC: two passes.
  shown = capsys.readouterr().err
  assert "fit_influence: pass 1/2" in shown and "fit_influence: pass 2/2" in shown
  influence.scores(train[:1], train, progress=False)
  assert capsys.readouterr().err == ""
  projector = gl.fit_projector(loss, params, train, k=2)
  for value in (influence, influence.factors, projector):
    text = repr(value)
    assert "\n" not in text and len(text) < 600, text
  assert repr(projector) == ("Projector(blocks={'s': (None, None), 'w1': (float32[1, 6, 2], "
                             "float32[1, 4, 2]), 'w2': (float32[1, 5, 2], float32[1, 3, 2])}, "
                             "k=2, init='random')")
  assert "KroneckerBlock(q_a=float32[1, 6, 6]," in repr(influence.factors)  # w1 and b1
  assert repr(influence) == "Influence(strategy='ekfac', blocks=['s', 'w1', 'w2'])"


def test_a_second_fit_and_scores_of_the_same_loss_and_shapes_compile_nothing(caplog):
  params, x, t, _, loss = _mlp()
  train, query = _batches(x[:N], t[:N]), _batches(x[N:], t[N:])
  first = gl.fit_influence(loss, params, train, progress=False)
  expected = first.scores(query, train, progress=False)
  low_rank = first.scores(query, train, query_rank=2, progress=False)
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level("DEBUG", logger="jax"):
      jax.jit(lambda v: v + 1)(1.0)  # A compile the log must show.
      again = gl.fit_influence(loss, params, train, progress=False)
      scores = again.scores(query, train, progress=False)
      np.testing.assert_array_equal(
          again.scores(query, train, query_rank=2, progress=False), low_rank)
  finally:
    jax.config.update("jax_log_compiles", False)
  compiled = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("Finished XLA compilation of")]
  assert len(compiled) == 1 and "<lambda>" in compiled[0], compiled
  np.testing.assert_array_equal(scores, expected)  # The same programs, the same scores.
  # Other shapes compile anew and are right: the queries one at a time.
  ones = [(x[N + i:N + i + 1], t[N + i:N + i + 1]) for i in range(Q)]
  _assert_scores(again.scores(ones, train, progress=False), expected, tol=1e-5)


@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
def test_fitting_reads_back_to_the_host_once_a_pass_not_once_a_batch(strategy, monkeypatch):
  # The covariances and EK-FAC's corrections are summed on the device: reading every
  # batch's back (an earlier version) took 5 s a batch at GPT-2's size on a TPU.
  from oryx_gradlog.analyses.attribution import _blocks, _factors
  params, x, t, _, loss = _mlp()
  reads = []

  class Counted:  # NumPy, counting the device arrays read back by np.asarray.
    def __getattr__(self, name):
      return getattr(np, name)

    def asarray(self, value, *args, **kwargs):
      if isinstance(value, jax.Array):
        reads.append(value.shape)
      return np.asarray(value, *args, **kwargs)

  for module in (_blocks, _factors):
    monkeypatch.setattr(module, "np", Counted())
  fitted = {}
  for size in (6, 2):  # 2 batches, then 6.
    reads.clear()
    fitted[size] = gl.fit_influence(loss, params, _batches(x[:N], t[:N], size=size),
                                    strategy=strategy, progress=False)
    fitted[size, "reads"] = len(reads)
  assert fitted[6, "reads"] == fitted[2, "reads"] > 0
  monkeypatch.undo()
  for key, block in fitted[6].factors.blocks.items():  # The same sums, however batched.
    np.testing.assert_allclose(block.eigenvalues, fitted[2].factors.blocks[key].eigenvalues,
                               rtol=1e-5, atol=1e-8)


def test_a_pass_waits_for_each_batch_once_the_next_is_dispatched(monkeypatch):
  # JAX dispatches asynchronously: without a wait, every batch's program (and its
  # outputs, 1.1 GiB of sums a batch at GPT-2's size) could be in flight at once, and
  # a progress bar would run ahead of the device.
  from oryx_gradlog.analyses.attribution import _batches
  events = []
  monkeypatch.setattr(_batches.jax, "block_until_ready",
                      lambda v: events.append(("waited for", int(v))))

  def dispatched():
    for i in range(3):
      events.append(("dispatched", i))
      yield {"sums": jnp.full((2, 2), i), "count": jnp.asarray(i)}

  for result in _batches.one_ahead(dispatched()):
    events.append(("passed on", int(result["count"])))
  assert events == [("dispatched", 0), ("passed on", 0),
                    ("dispatched", 1), ("waited for", 0), ("passed on", 1),
                    ("dispatched", 2), ("waited for", 1), ("passed on", 2)]


def test_a_loss_that_is_not_hashable_scores_as_the_same_function_does():
  params, x, t, _, loss = _mlp()

  class Loss:  # A callable object that is not hashable (as an Equinox module's).
    __hash__ = None

    def __call__(self, *args):
      return loss(*args)

  train, query = _batches(x[:N], t[:N]), _batches(x[N:], t[N:])
  expected = gl.fit_influence(loss, params, train, progress=False).scores(
      query, train, progress=False)
  influence = gl.fit_influence(Loss(), params, train, progress=False)
  np.testing.assert_allclose(influence.scores(query, train, progress=False), expected,
                             rtol=1e-5, atol=1e-7 * np.abs(expected).max())
  # Its self-influence and a projector of it, too.
  np.testing.assert_allclose(
      influence.self_influence(train, progress=False),
      gl.fit_influence(loss, params, train, progress=False).self_influence(
          train, progress=False), rtol=1e-5)
  projector = gl.fit_projector(Loss(), params, train, k=2, init="pca")
  assert set(projector.blocks) == set(gl.fit_projector(loss, params, train, k=2).blocks)
