"""Kronfluence's counterfactual check of influence scores on example 13's problem
(issue 52), for RESULTS.md.

A one-off, not part of `make bench`. Example 13's GPT learns the bytes of the
Python standard library; EK-FAC scores (`gl.fit_influence`, `Influence.scores`)
rank, for each of 20 queries, the training sequences that helped it most. Then
for each query two models are retrained: without its 10 most helpful sequences,
and without 10 sequences drawn at random. Scores that mean something make the
query's loss rise more in the first (the issue's target: for at least 80% of the
queries).

Retraining is controlled: every model sees the same batches in the same order as
the model the scores were computed on, with the removed sequences weighted 0 in
each batch's mean (so only the removal differs); the 40 retrained models are
trained `--models-at-once` at a time under `jax.vmap`, each with its own Adam
state, and only their query losses are kept.

`--retrain-from S` retrains only the steps from `S` on, from the base run's
parameters and Adam state at step `S` (as Kronfluence's GPT-2 case fine-tunes a
pretrained model): the removed sequences still shaped the first `S` steps. It is
what makes GPT-2's size fit an accelerator's session: 40 retrainings of all 2,000
steps are 80,000 steps.

Sharp edges:
  * Each model in a vmapped group holds its parameters, Adam's two moments and its
    gradient (16 bytes a parameter in float32) besides its batch's activations.
    Compiled for a TPU v5e (`tpu_compile.py`'s compile-only device) at GPT-2's size
    (86 M parameters, batch 8 x 512), a step of 1 / 2 / 4 models peaks at 4.0 / 8.2
    / 15.4 GiB undonated; donated (as here), 4 models still peak at 13.9 GiB (XLA
    keeps more temporaries), too near the chip's 15.7 beside the base's state: the
    size's default is 2.
  * The base is trained alone (one model), the removals in groups: they differ
    from it by the removal and by float32 rounding (about 1e-6 of a loss).

Run: .venv-jax-0.10.2/bin/python benchmarks/counterfactual.py [--size quick|small|
     medium|gpt2] [--query-rank R] [--queries 20] [--k 10] [--retrain-from S]
     [--models-at-once M]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import oryx_gradlog as gl

_EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "13_stdlib_attribution.py"
MODELS_AT_ONCE = {"quick": 40, "small": 40, "medium": 8, "gpt2": 2}


def _example():
  spec = importlib.util.spec_from_file_location("_stdlib_attribution", _EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def draws(n_train: int, steps: int, batch: int, seed: int = 0) -> np.ndarray:
  """`(steps, batch)`: the training sequences of each step, example 13's `train`'s."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.choice(n_train, batch, replace=False) for _ in range(steps)])


def masked_step(loss, optimizer):
  """A jitted Adam step of `M` models at once, `(params, state, rows (B, T + 1),
  weights (M, B)) -> (params, state)`: each model's loss is the batch's
  per-sequence losses weighted by its row (`loss(..., per_sequence=True)`, example
  13's), over the row's sum. The parameters and state are donated."""
  def weighted(p, rows, w):
    losses = loss(p, rows[:, :-1], rows[:, 1:], per_sequence=True)
    return jnp.sum(w * losses) / jnp.maximum(jnp.sum(w), 1.0)

  def one(p, state, rows, w):
    updates, state = optimizer.update(jax.grad(weighted)(p, rows, w), state)
    return optax.apply_updates(p, updates), state

  return jax.jit(jax.vmap(one, in_axes=(0, 0, None, 0)), donate_argnums=(0, 1))


def masked_training(loss, optimizer, params, state, windows, weights, batches):
  """Trains one model per row of `weights` `(M, n_train)` at once from the same
  `params` and Adam `state`, over the steps' `batches` (`(steps, B)` indices into
  `windows`), each sequence's loss weighted by the row. Returns the models'
  parameters and states, stacked on a leading axis of `M`."""
  step = masked_step(loss, optimizer)
  stack = lambda tree: jax.tree.map(
      lambda v: jnp.broadcast_to(v, (len(weights),) + jnp.shape(v)), tree)
  params, state = stack(params), stack(state)
  for rows in batches:
    params, state = step(params, state, jnp.asarray(windows[rows]),
                         jnp.asarray(weights[:, rows]))
  return params, state


def unstack(tree, i: int = 0):
  return jax.tree.map(lambda v: v[i], tree)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(MODELS_AT_ONCE), default="quick")
  parser.add_argument("--query-rank", type=int, default=None)
  parser.add_argument("--queries", type=int, default=20)
  parser.add_argument("--k", type=int, default=10)
  parser.add_argument("--retrain-from", type=int, default=0, metavar="S",
                      help="retrain only the steps from S on, from the base run's state "
                      "at S (default 0: the whole run)")
  parser.add_argument("--models-at-once", type=int, default=None, metavar="M",
                      help="models retrained at once under vmap (default: the size's, "
                      f"{MODELS_AT_ONCE})")
  args = parser.parse_args()
  ex = _example()
  size = ex.SIZES[args.size]
  seq, n_train, batch, steps = size["seq"], size["n_train"], size["batch"], size["steps"]
  if not 0 <= args.retrain_from < steps:
    raise SystemExit(f"counterfactual.py: --retrain-from {args.retrain_from} is not a "
                     f"step of --size {args.size}'s run; give 0 to {steps - 1}.")
  at_once = args.models_at_once or MODELS_AT_ONCE[args.size]
  (train_windows, _), (query_windows, _), _ = ex.problem(size)
  query_windows = query_windows[:args.queries]
  graphdef, init, rest = ex.model(size)
  loss = ex.make_loss(graphdef, rest)
  optimizer = optax.adam(ex.LEARNING_RATE)
  batches, start = draws(n_train, steps, batch), args.retrain_from
  ones = np.ones((1, n_train))
  times, started = {}, time.perf_counter()

  # The base model: trained to the retraining's start, then on to the end.
  early = masked_training(loss, optimizer, init, optimizer.init(init), train_windows,
                          ones, batches[:start])
  early = unstack(early[0]), unstack(early[1])
  params = unstack(masked_training(loss, optimizer, *early, train_windows, ones,
                                   batches[start:])[0])
  times["base training"], started = time.perf_counter() - started, time.perf_counter()

  influence = gl.fit_influence(loss, params, ex.batches(train_windows, batch),
                               progress=False)
  scores = influence.scores(ex.batches(query_windows, batch),
                            ex.batches(train_windows, batch),
                            query_rank=args.query_rank, progress=False)
  helpful, _ = gl.Influence.top_k(scores, args.k)
  times["EK-FAC fit and scores"], started = time.perf_counter() - started, time.perf_counter()
  rng = np.random.default_rng(1)
  drawn = np.stack([rng.choice(n_train, args.k, replace=False) for _ in query_windows])

  n = len(query_windows)
  weights = np.ones((2 * n, n_train))  # Without each query's top k, then random k.
  for q in range(n):
    weights[q, helpful[q]] = 0.0
    weights[n + q, drawn[q]] = 0.0

  queries = jnp.asarray(query_windows)
  query_losses = jax.jit(jax.vmap(  # (models, n_query): each query's loss, each model.
      lambda p: loss(p, queries[:, :-1], queries[:, 1:], per_sequence=True)))
  base = np.asarray(query_losses(jax.tree.map(lambda v: v[None], params)))[0]
  losses = []
  for first in range(0, len(weights), at_once):  # The last group padded with ones.
    group = np.concatenate([weights[first:first + at_once],
                            np.ones((max(0, first + at_once - len(weights)), n_train))])
    models, _ = masked_training(loss, optimizer, *early, train_windows, group,
                                batches[start:])
    losses.append(np.asarray(query_losses(models))[:len(weights) - first])
  losses = np.concatenate(losses)  # (2n, n_query)
  times[f"retraining {len(weights)} x {steps - start} steps"] = time.perf_counter() - started

  own = np.arange(n)
  rise_top = losses[own, own] - base
  rise_random = losses[n + own, own] - base
  wins = int(np.sum(rise_top > rise_random))
  print(f"{args.size}: {n_train} training sequences of {seq} bytes, {steps} Adam steps, "
        f"retrained from step {start}, {at_once} models at once; EK-FAC, query rank "
        f"{args.query_rank}; JAX {jax.__version__} on {jax.devices()[0].device_kind}")
  print("times (s, compiling included): " + ", ".join(
      f"{phase} {seconds:.0f}" for phase, seconds in times.items()))
  print("| queries | removed | query loss rise, top-k helpful (mean / median) | "
        "random k (mean / median) | top-k rise > random's |")
  print("|---|---|---|---|---|")
  print(f"| {n} | {args.k} of {n_train} | {rise_top.mean():+.4f} / {np.median(rise_top):+.4f} "
        f"| {rise_random.mean():+.4f} / {np.median(rise_random):+.4f} | {wins} of {n} "
        f"({100 * wins / n:.0f}%; target 80%) |")


if __name__ == "__main__":
  main()
