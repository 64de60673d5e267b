"""Queries' preconditioned gradients as low-rank factors, scored straight from the
training examples' layer records (`Influence.scores(query_rank=r)`).

A query's preconditioned gradient of a dense or convolution block is a `d_in x
d_out` matrix `P` per layer; `factorize` keeps its best rank-`r` approximation `a
b^T` (`a` `(d_in, r)` with the singular values in it, `b` `(d_out, r)`), in the
parameters' own basis, as Kronfluence's `query_gradient_low_rank` does. A
training example's score is then `<P, G> = sum_t (x_t a) . (g_t b)` over its
positions `t` (its layer inputs `x_t` and output cotangents `g_t`), and
`scores` takes the cheaper of two exact forms per block, by their flops:

* factored: `(x a)` and `(g b)` of every position and query, `B T Q r (d_in +
  d_out)` (few positions: a classifier's examples);
* formed: each example's gradient `G = sum_t x_t g_t^T` once (`B T d_in d_out`)
  and `P = a b^T` of a chunk of queries at a time (`Q d_in d_out r`, at most
  `_CHUNK_BYTES` of them at once), `B Q d_in d_out` for the products (long
  sequences: a language model's).

So the training gradients are never rotated into the curvature's eigenbasis, and
every query is held, as `r (d_in + d_out)` numbers a layer instead of `d_in
d_out`: one pass over the training batches scores them all.

The factors are a randomized SVD (Halko, Martinsson & Tropp 2011, algorithm 4.4):
a sketch of `r + 10` columns refined by two power iterations, then the exact SVD
of the small projected matrix. Only matrix products, QRs of thin matrices and one
small SVD, all batched over the queries: what an accelerator does well.

Sharp edges:
  * Exact (the plain SVD's truncation) where `r + 10 >= min(d_in, d_out)`;
    otherwise within the sketch's error of the best rank-`r` approximation, which
    two power iterations make small where the singular values decay.
  * A batch of queries is preconditioned whole before it is factorized: its
    batch size bounds that memory (8 queries of GPT-2 small: 2.7 GB).
  * Embeddings, diagonal blocks and `"full"` blocks keep their whole
    preconditioned gradients (and are scored as without `query_rank`).
  * The sketch's random matrix is fixed (`PRNGKey(0)`): the same queries give the
    same factors.
  * `factorized` runs one block's factorization at a time, each its own program
    awaited before the next: jaxlib 0.10's CPU decompositions of a batch of
    matrices wait on the thread pool they run in, so as many running at once as
    the pool has threads (2 on a 2-core machine) wait for each other forever.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from oryx_gradlog.analyses import _common

_OVERSAMPLE = 10  # Sketch columns beyond the rank (Halko et al.'s p).
_POWER_ITERATIONS = 2
_CHUNK_BYTES = 1 << 28  # The reconstructed `P` of one chunk of queries (256 MiB).


class LowRank(NamedTuple):
  """A block's queries' preconditioned gradients as `a b^T` per layer and query.

  Attributes:
    a: `(S, Q, d_in(+1), r)`, the left singular vectors times the singular values.
    b: `(S, Q, d_out, r)`, the right singular vectors.
  """

  a: jax.Array
  b: jax.Array


class Whole(NamedTuple):
  """A dense or convolution block's queries' preconditioned gradients `(S, Q, d_in,
  d_out)` in its eigenbasis, to be factorized."""

  pre: jax.Array


def factorized(part: dict, blocks: dict, rank: int) -> dict:
  """`part` (per block, as `Influence`'s preconditioned queries) with each `Whole`
  block as its `LowRank` factors, one block after another (see the sharp edges)."""
  out = {}
  for name, value in part.items():
    if isinstance(value, Whole):
      block = blocks[name]
      value = jax.block_until_ready(_factorize(value.pre, rank, block.q_a, block.q_s))
    out[name] = value
  return out


def _orthonormal(y: jax.Array) -> jax.Array:
  return jnp.linalg.qr(y)[0]


def factorize(pre: jax.Array, rank: int, q_a: jax.Array | None,
              q_s: jax.Array | None) -> LowRank:
  """`pre` `(S, Q, d_in, d_out)`, the queries' preconditioned gradients in a block's
  eigenbasis (`q_a`, `q_s`; `None` for the identity), as rank-`rank` factors in the
  parameters' own basis."""
  d_in, d_out = pre.shape[-2:]
  k = min(rank + _OVERSAMPLE, d_in, d_out)
  omega = jax.random.normal(jax.random.PRNGKey(0), (d_out, k), pre.dtype)
  y = _common.dot("sqio,ok->sqik", pre, omega)
  for _ in range(_POWER_ITERATIONS):  # Each pass sharpens the sketch's range.
    z = _common.dot("sqio,sqik->sqok", pre, _orthonormal(y))
    y = _common.dot("sqio,sqok->sqik", pre, _orthonormal(z))
  basis = _orthonormal(y)  # (S, Q, d_in, k): contains P's leading range.
  u, s, vt = jnp.linalg.svd(_common.dot("sqik,sqio->sqko", basis, pre),
                            full_matrices=False)
  r = min(rank, k)
  a = _common.dot("sqik,sqkr->sqir", basis, u[..., :r] * s[..., None, :r])
  b = jnp.swapaxes(vt[..., :r, :], -1, -2)
  if q_a is not None:  # Back from the eigenbasis: P = Q_A P_rot Q_S^T.
    a = _common.dot("sij,sqjr->sqir", q_a.astype(a.dtype), a)
  if q_s is not None:
    b = _common.dot("sop,sqpr->sqor", q_s.astype(b.dtype), b)
  return LowRank(a, b)


def scores(query: LowRank, x: jax.Array, g: jax.Array) -> jax.Array:
  """`(Q, B)`: `<a b^T, sum_t x_t g_t^T>` per query and training example, from the
  training batch's layer inputs `x` `(S, B, T, d_in(+1))` and output cotangents `g`
  `(S, B, T, d_out)`, summed over the layers `S`; the cheaper form by flops."""
  a, b = query
  (_, n_query, d_in, r), (_, batch, positions, d_out) = a.shape, g.shape
  factored = batch * positions * n_query * r * (d_in + d_out)
  formed = batch * positions * d_in * d_out + n_query * d_in * d_out * (r + batch)
  if factored <= formed:
    xa = _common.dot("sbti,sqir->sbtqr", x, a)
    gb = _common.dot("sbto,sqor->sbtqr", g, b)
    return _common.dot("sbtqr,sbtqr->qb", xa, gb)
  grads = _common.dot("sbti,sbto->sbio", x, g)
  per_query = a.shape[0] * d_in * d_out * jnp.dtype(jnp.float32).itemsize
  chunk = max(1, min(n_query, _CHUNK_BYTES // per_query))
  pad = -n_query % chunk

  def chunked(v):  # (S, Q, ., r) -> (Q / chunk, S, chunk, ., r), zero-padded.
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(v.reshape(v.shape[0], -1, chunk, *v.shape[2:]), 1, 0)

  def products(ab):
    p = _common.dot("sqir,sqor->sqio", *ab)
    return _common.dot("sqio,sbio->qb", p, grads)

  out = jax.lax.map(products, (chunked(a), chunked(b)))
  return out.reshape(-1, batch)[:n_query]


_factorize = jax.jit(factorize, static_argnums=1)  # Compiled once a shape and rank.
