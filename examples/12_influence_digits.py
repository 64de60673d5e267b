"""Which training examples did this: influence functions on scikit-learn's digits.

A plain JAX MLP (64 -> 64 tanh -> 10, no layer marked) learns the digits with
optax's Adam; 10% of its training labels are flipped. `gl.fit_influence` fits
EK-FAC (Kronfluence's eigenvalue-corrected K-FAC) from the records of the
training loss; then:

1. Self-influence ranks the training examples: the flipped ones are the model's
   surprises, most of them in the top 10%.
2. For a few test queries, the most helpful and most harmful training examples:
   helpful ones mostly share the query's digit.
3. How good the scores are on this problem: the linear datamodeling score (LDS).
   The model is retrained on random halves of the (clean) training set, vmapped
   over the subsets, and `gl.lds` asks how well each attribution's subset sums rank
   the retrained models' query losses; EK-FAC beside plain gradient products
   (`strategy="identity"`) and LoGra (`gl.fit_projector(k=16, init="pca")`: each
   layer's gradient projected to 16 x 16, with the full Fisher of the projected
   gradients, `strategy="full"`), whose per-example gradients are small enough to
   log at every training step (`gl.projected_grads`).

The factors are saved and loaded (`InfluenceFactors` is a pytree of arrays), as a
user keeps them beside a checkpoint. The check at the end compares the identity
scores with `vmap(grad)`'s gradient inner products.

Run: python examples/12_influence_digits.py [--quick] [--run-dir runs/influence]
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import oryx_gradlog as gl

N_TRAIN, N_QUERY, BATCH, STEPS = 1000, 200, 100, 300


def data(flip: float, seed: int = 0):
  """Standardised digits: (train x, train y, flipped mask), (query x, query y)."""
  x, y = load_digits(return_X_y=True)
  x = ((x - x.mean(0)) / (x.std(0) + 1e-6)).astype(np.float32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order].astype(np.int32)
  train_y = y[:N_TRAIN].copy()
  flipped = np.zeros(N_TRAIN, bool)
  if flip:
    rng = np.random.default_rng(seed + 1)
    flipped[rng.choice(N_TRAIN, int(flip * N_TRAIN), replace=False)] = True
    train_y[flipped] = (train_y[flipped] + rng.integers(1, 10, flipped.sum())) % 10
  return (x[:N_TRAIN], train_y, flipped), (x[N_TRAIN:N_TRAIN + N_QUERY],
                                          y[N_TRAIN:N_TRAIN + N_QUERY])


def forward(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def losses(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y)


def loss(p, x, y):
  """The batch loss: the mean of the per-example losses, as fit_influence takes it."""
  return jnp.mean(losses(p, x, y))


def init(key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return {"w1": 0.1 * jax.random.normal(k1, (64, 64)), "b1": jnp.zeros(64),
          "w2": 0.1 * jax.random.normal(k2, (64, 10)), "b2": jnp.zeros(10)}


def train(x, y, mask, steps=STEPS):
  """Adam on the mean loss of the examples in `mask` (full batch), from one init."""
  optimizer = optax.adam(1e-2)

  def objective(p):
    return jnp.sum(mask * losses(p, x, y)) / jnp.sum(mask)

  def step(carry, _):
    p, state = carry
    updates, state = optimizer.update(jax.grad(objective)(p), state)
    return (optax.apply_updates(p, updates), state), None

  p = init()
  (p, _), _ = jax.lax.scan(step, (p, optimizer.init(p)), None, length=steps)
  return p


def batches(x, y):
  return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def retrained_losses(x, y, query_x, query_y, subsets, steps=STEPS):
  """`(n_subsets, n_query)`: the query losses of the model retrained on each subset."""
  fit = jax.jit(jax.vmap(lambda mask: train(x, y, mask, steps)))
  return np.asarray(jax.vmap(lambda p: losses(p, query_x, query_y))(fit(subsets)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer retrained models")
  parser.add_argument("--run-dir", default="runs/influence")
  args = parser.parse_args()
  n_subsets = 16 if args.quick else 64

  # 1. Mislabelled examples by self-influence.
  (x, y, flipped), (query_x, query_y) = data(flip=0.1)
  params = jax.jit(train)(x, y, jnp.ones(N_TRAIN))
  influence = gl.fit_influence(loss, params, batches(x, y))  # EK-FAC
  print(gl.layer_coverage(loss, params, x[:BATCH], y[:BATCH]))
  own = influence.self_influence(batches(x, y))
  top = np.argsort(-own)[:N_TRAIN // 10]
  caught = int(flipped[top].sum())
  print(f"flipped labels in the top 10% by self-influence: {caught} of "
        f"{int(flipped.sum())} (a random 10% holds {int(flipped.sum()) // 10})")

  # 2. Helpful and harmful training examples for a few queries.
  scores = influence.scores([(query_x, query_y)], batches(x, y))
  helpful, harmful = gl.Influence.top_k(scores, 5)
  for q in range(3):
    print(f"query {q} (a {query_y[q]}): helpful labels {y[helpful[q]].tolist()}, "
          f"harmful {y[harmful[q]].tolist()} (flipped: {flipped[harmful[q]].tolist()})")
  same = float(np.mean(y[helpful] == query_y[:, None]))
  print(f"top-5 helpful examples with the query's label: {same:.0%}")

  # Saved beside a checkpoint and loaded: the same scores.
  os.makedirs(args.run_dir, exist_ok=True)
  leaves, treedef = jax.tree.flatten(influence.factors)
  path = os.path.join(args.run_dir, "factors.npz")
  np.savez(path, *[np.asarray(v) for v in leaves])
  with np.load(path) as saved:
    loaded = jax.tree.unflatten(treedef, [saved[f"arr_{i}"] for i in range(len(leaves))])
  again = gl.Influence(loss, params, loaded).scores([(query_x[:8], query_y[:8])],
                                                    batches(x, y))
  np.testing.assert_allclose(again, scores[:8], rtol=1e-5, atol=1e-6 * np.abs(scores).max())

  # 3. The LDS on the clean data: retrain on random halves, vmapped over subsets.
  (x, y, _), _ = data(flip=0.0)
  params = jax.jit(train)(x, y, jnp.ones(N_TRAIN))
  subsets = np.random.default_rng(2).random((n_subsets, N_TRAIN)) < 0.5
  measured = retrained_losses(x, y, query_x, query_y, subsets)
  results = {}
  projector = gl.fit_projector(loss, params, batches(x, y), k=16, init="pca")
  for name, strategy, projection in (("identity", "identity", None),
                                     ("ekfac", "ekfac", None),
                                     ("logra", "full", projector)):
    fitted = gl.fit_influence(loss, params, batches(x, y), strategy=strategy,
                              projection=projection)
    results[name] = fitted.scores([(query_x, query_y)], batches(x, y))
    print(f"LDS over {n_subsets} half-data retrainings, {name}: "
          f"{gl.lds(results[name], subsets, measured):.3f}")
  sizes = {n: int(np.prod(p.shape)) for n, p in params.items()}
  kept = 16 * 16 + 16 * 10  # w1 with b1: 16 x 16; w2 with b2: 16 x 10 (10 kept whole).
  lds = {name: gl.lds(scores, subsets, measured) for name, scores in results.items()}
  print(f"LoGra keeps {kept} numbers per example of {sum(sizes.values())} "
        f"({kept / sum(sizes.values()):.0%}); its LDS is {lds['logra'] / lds['ekfac']:.2f} "
        "of EK-FAC's")

  # The check: identity scores are vmap(grad)'s gradient inner products.
  def per_example(x, y):
    grads = jax.vmap(jax.grad(lambda p, x, y: loss(p, x[None], y[None])),
                     in_axes=(None, 0, 0))(params, x, y)
    return jnp.concatenate([g.reshape(g.shape[0], -1) for g in jax.tree.leaves(grads)], 1)

  expected = np.asarray(per_example(query_x, query_y) @ per_example(x, y).T)
  np.testing.assert_allclose(results["identity"], expected, rtol=1e-4,
                             atol=1e-4 * np.abs(expected).max())
  assert caught > 3 * int(flipped.sum()) // 10, caught  # Far above chance.
  assert gl.lds(results["ekfac"], subsets, measured) > gl.lds(results["identity"], subsets,
                                                              measured)
  print("check: identity scores equal vmap(grad) inner products; EK-FAC finds the flipped "
        "labels and ranks retrained losses better than plain gradient products")


if __name__ == "__main__":
  main()
