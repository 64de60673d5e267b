"""Any JAX model, unchanged: a stock Flax NNX GPT trained with one-pass DP-SGD.

A small GPT-style decoder built only from stock Flax NNX modules (`nnx.Embed`, a
learned position embedding, `nnx.MultiHeadAttention` with a causal mask,
`nnx.LayerNorm`, an `nnx.Linear` MLP) learns character-level text generated here
from a tiny grammar. Not one model line is written for oryx_gradlog: no layer is
marked, and there is no `where` map from layers to parameters.

1. `gl.layer_coverage` prints, before training, how every parameter's per-example
   gradient will be formed: the layers are found in the model's jaxpr (dense
   layers, attention's 3-D kernels, the embedding lookup, the element-wise scales
   and shifts of biases, layer norms and the position embedding).
2. `gl.clipped_grad(loss, l2_norm_clip=C)`, used like `jax.grad`, gives the DP-SGD
   clipped mean gradient, shaped like the parameters, from one backward pass, and
   the per-example gradient norms.
3. Batches are Poisson-sampled and padded to a fixed size (`gl.poisson_batch`);
   padding examples weigh 0 in the loss. `gl.dp_noise` adds the Gaussian noise in
   an optax chain before SGD with momentum; `gl.dp_noise_multiplier` picks sigma
   for a target epsilon and `gl.dp_epsilon` reports the epsilon spent
   (dp-accounting's RDP).
4. Every step's per-example norms go to a `gl.RunLog` (zarr, written off the
   training thread).
5. After training, which training windows did this: `gl.fit_influence` (EK-FAC)
   on the same loss, the most helpful and most harmful windows for a few held-out
   ones, and the windows the model finds most surprising (self-influence).

The jitted step donates its parameters and optimizer state
(`jax.jit(..., donate_argnums=(0, 1))`): XLA may write the new ones into the old
buffers, so the arrays passed in are invalid afterwards (the check keeps copies of
the initial parameters and of the first step's).

The check at the end is against plain JAX, on the first step: per-example gradients
by `jax.vmap(jax.grad(...))`, clipped one by one and averaged, then the same noise
and SGD update, give the parameters the first jitted step gave, and their norms
equal the norms the `RunLog` stored.

Run: python examples/11_any_model_dp.py [--quick] [--steps 400] [--run-dir runs/any_model_dp]
"""

import argparse
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import oryx_gradlog as gl

SEQ, WIDTH, HEADS, DEPTH = 32, 64, 4, 2
EXPECTED_BATCH, PADDED_BATCH = 64, 96
CLIP, TARGET_EPSILON, DELTA, LR, MOMENTUM = 1.0, 8.0, 1e-5, 0.5, 0.9


# ----------------------------------------------------------------------------------
# The model: stock Flax NNX modules, nothing of oryx_gradlog.


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

  def __init__(self, width, heads, *, dtype=None, rngs):
    self.ln1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False,
                                       dtype=dtype, rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(x[..., 0])
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
  """Token and learned position embeddings, `depth` blocks, a final norm and a head.

  `dtype` is the computation's (NNX's `dtype`: `jnp.bfloat16` for mixed precision);
  parameters stay float32 and the logits come out in float32.
  """

  def __init__(self, vocab, seq, width, heads, depth, *, dtype=None, rngs):
    self.embed = nnx.Embed(vocab, width, dtype=dtype, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, width)))
    self.blocks = nnx.Sequential(*[Block(width, heads, dtype=dtype, rngs=rngs)
                                   for _ in range(depth)])
    self.ln_f = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(width, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.pos[: ids.shape[-1]].astype(x.dtype)
    return self.head(self.ln_f(self.blocks(x))).astype(jnp.float32)


# ----------------------------------------------------------------------------------
# The data: sentences from a tiny grammar, cut into windows of SEQ + 1 characters.
# Each window is one example (the unit DP-SGD protects).

SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "the bird", "a child",
            "the farmer", "our teacher")
VERBS = ("sees", "likes", "finds", "follows", "draws", "hears", "carries", "paints")
OBJECTS = ("the moon", "a red ball", "the river", "a small house", "the garden",
           "an apple", "the boat", "a yellow kite")
ENDINGS = ("at night", "in the rain", "by the sea", "after school", "every day", "")


def corpus(num_examples, seed=0):
  """Returns `(windows, alphabet)`: int32 `(num_examples, SEQ + 1)` and the characters."""
  rng = np.random.default_rng(seed)
  sentences, length = [], 0
  while length < num_examples * (SEQ + 1):
    words = [rng.choice(part) for part in (SUBJECTS, VERBS, OBJECTS, ENDINGS)]
    sentences.append(" ".join(w for w in words if w) + ". ")
    length += len(sentences[-1])
  text = "".join(sentences)[: num_examples * (SEQ + 1)]
  alphabet = sorted(set(text))
  ids = np.array([alphabet.index(c) for c in text], np.int32)
  return ids.reshape(num_examples, SEQ + 1), "".join(alphabet)


# ----------------------------------------------------------------------------------
# Training.


def make_loss(graphdef, rest):
  def loss(params, inputs, targets, weights):
    """The mean over the padded batch of each example's weighted mean token loss."""
    logits = nnx.merge(graphdef, params, rest)(inputs)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
    return jnp.mean(weights * per_example)
  return loss


def make_step(loss, optimizer, sampling_rate):
  grad = gl.clipped_grad(loss, l2_norm_clip=CLIP, reduction="mean", return_norms=True)

  def step(params, opt_state, data, key):
    batch = gl.poisson_batch(key, len(data), sampling_rate=sampling_rate,
                             batch_size=PADDED_BATCH)
    windows = data[batch.indices]
    grads, norms = grad(params, windows[:, :-1], windows[:, 1:], batch.weights)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"norms": norms, "weights": batch.weights, "count": batch.count}

  # Donation: the new parameters and optimizer state may reuse the old buffers.
  return jax.jit(step, donate_argnums=(0, 1))


def reference(loss, params, inputs, targets, weights):
  """Plain JAX: per-example gradients by vmap(grad), clipped one by one, averaged."""
  one = lambda p, i, t, w: loss(p, i[None], t[None], w[None])
  per_example = jax.vmap(jax.grad(one), in_axes=(None, 0, 0, 0))(params, inputs, targets,
                                                                 weights)
  leaves = jax.tree.leaves(per_example)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(weights), -1) ** 2, axis=1) for g in leaves))
  factors = jnp.minimum(1.0, CLIP / jnp.maximum(norms, 1e-12))
  # loss(p, one example) is that example's loss / 1: the batch mean divides by B.
  clipped = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1) / len(weights),
                         per_example)
  return clipped, norms


def sample(graphdef, params, rest, alphabet, prompt="the ", length=SEQ - 1):
  """Greedy continuation of `prompt`, one character at a time."""
  model = nnx.merge(graphdef, params, rest)
  logits_at = jax.jit(lambda ids, i: model(ids[None])[0, i])
  ids = np.zeros(SEQ, np.int32)
  ids[: len(prompt)] = [alphabet.index(c) for c in prompt]
  for i in range(len(prompt) - 1, length):
    ids[i + 1] = int(jnp.argmax(logits_at(jnp.asarray(ids), i)))
  return "".join(alphabet[i] for i in ids[: length + 1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--run-dir", default=os.path.join("runs", "any_model_dp"))
  parser.add_argument("--quick", action="store_true",
                      help="only the first 10 steps of the schedule, for the tests")
  args, _ = parser.parse_known_args(argv)
  steps = 10 if args.quick else args.steps

  windows, alphabet = corpus(4096 + 256)
  train, held_out = jnp.asarray(windows[:4096]), jnp.asarray(windows[4096:])
  rate = EXPECTED_BATCH / len(train)
  # Sigma for the whole schedule (`--steps`); the epsilon spent is for the steps run.
  sigma = gl.dp_noise_multiplier(target_epsilon=TARGET_EPSILON, sampling_rate=rate,
                                 steps=args.steps, delta=DELTA)
  epsilon = gl.dp_epsilon(noise_multiplier=sigma, sampling_rate=rate, steps=steps,
                          delta=DELTA)

  model = GPT(len(alphabet), SEQ, WIDTH, HEADS, DEPTH, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = make_loss(graphdef, rest)
  ones = jnp.ones(len(held_out))
  held_out_loss = jax.jit(lambda p: loss(p, held_out[:, :-1], held_out[:, 1:], ones))

  # 1. Before training: how is every parameter covered?
  print(gl.layer_coverage(loss, params, train[:PADDED_BATCH, :-1], train[:PADDED_BATCH, 1:],
                          jnp.ones(PADDED_BATCH)))

  optimizer = optax.chain(
      gl.dp_noise(l2_norm_clip=CLIP, noise_multiplier=sigma, reduction="mean",
                  batch_size=PADDED_BATCH, seed=1),
      optax.sgd(LR, momentum=MOMENTUM))
  opt_state = optimizer.init(params)
  step = make_step(loss, optimizer, rate)
  initial = jax.tree.map(jnp.copy, params)  # `step` donates `params`: keep a copy.
  keys = jax.random.split(jax.random.PRNGKey(2), steps)
  before = float(held_out_loss(params))

  shutil.rmtree(args.run_dir, ignore_errors=True)
  config = {"seq": SEQ, "width": WIDTH, "heads": HEADS, "depth": DEPTH, "clip": CLIP,
            "noise_multiplier": sigma, "sampling_rate": rate, "steps": steps}
  start = time.perf_counter()
  counts = []
  with gl.RunLog(args.run_dir, config=config,
                 dims={"norms": ("example",), "weights": ("example",)}) as log:
    for i in range(steps):
      params, opt_state, logged = step(params, opt_state, train, keys[i])
      log.append(i, logged)
      counts.append(logged["count"])
      if i == 0:  # The next step donates `params`: keep a copy for the check.
        first = jax.tree.map(jnp.copy, params)
      if i % 100 == 0 or i == steps - 1:
        sampled = logged["norms"][logged["weights"] > 0]
        print(f"step {i:4d}  median per-example norm {float(jnp.median(sampled)):.3f}  "
              f"clipped {100 * float(jnp.mean(sampled > CLIP)):.0f}%")
    log.flush()
  counts = np.asarray(counts)
  print(f"{steps} DP-SGD steps in {time.perf_counter() - start:.1f} s: Poisson q = {rate:.4f} "
        f"(batches of {counts.min()} to {counts.max()}, padded to {PADDED_BATCH}), C = {CLIP}, "
        f"sigma = {sigma:.3f}")
  print(f"privacy: epsilon = {epsilon:.2f} at delta = {DELTA} after {steps} steps (target "
        f"{TARGET_EPSILON} for {args.steps}; RDP accountant, dp-accounting)")
  after = float(held_out_loss(params))
  print(f"held-out loss: {before / np.log(2):.2f} -> {after / np.log(2):.2f} bits per character")
  print(f"greedy sample: {sample(graphdef, params, rest, alphabet)!r}")

  # 5. Which training windows did this (influence functions, no model line changed).
  pool = [(train[i:i + 128, :-1], train[i:i + 128, 1:], jnp.ones(128))
          for i in range(0, 512, 128)]
  queries = [(held_out[:4, :-1], held_out[:4, 1:], jnp.ones(4))]
  influence = gl.fit_influence(loss, params, pool)
  scores = influence.scores(queries, pool)
  helpful, harmful = gl.Influence.top_k(scores, 2)
  text = lambda window: "".join(alphabet[int(c)] for c in window)
  for q in range(2):
    print(f"held-out {text(held_out[q])!r}: helped most by {text(train[helpful[q, 0]])!r}, "
          f"hurt most by {text(train[harmful[q, 0]])!r}")
  surprising = np.argsort(-influence.self_influence(pool))[:2]
  print(f"most surprising training windows: {[text(train[i]) for i in surprising]}")

  # Check: step 0 against plain JAX (vmap(grad) + clipping, the same noise and SGD).
  assert counts.max() <= PADDED_BATCH, "a batch overflowed its padding"
  assert epsilon <= TARGET_EPSILON * (1 + 1e-6)
  batch = gl.poisson_batch(keys[0], len(train), sampling_rate=rate, batch_size=PADDED_BATCH)
  expected, expected_norms = jax.jit(reference, static_argnums=0)(
      loss, initial, train[batch.indices, :-1], train[batch.indices, 1:], batch.weights)
  updates, _ = optimizer.update(expected, optimizer.init(initial), initial)
  for got, update in zip(jax.tree.leaves(jax.tree.map(jnp.subtract, first, initial)),
                         jax.tree.leaves(updates)):
    np.testing.assert_allclose(got, update, rtol=1e-3, atol=1e-6)
  run = gl.open_run(args.run_dir)
  assert run.sizes["step"] == steps
  np.testing.assert_allclose(run["norms"].values[0], expected_norms, rtol=1e-4, atol=1e-6)
  assert after < before
  # Influence: identity scores of the last parameters are vmap(grad) inner products.
  plain = gl.fit_influence(loss, params, pool[:1], strategy="identity")
  flat = lambda g: jnp.concatenate([v.reshape(v.shape[0], -1) for v in jax.tree.leaves(g)], 1)
  one = jax.grad(lambda p, *example: loss(p, *(v[None] for v in example)))
  grads = jax.jit(lambda p, *b: flat(jax.vmap(one, in_axes=(None, 0, 0, 0))(p, *b)))
  num_queries = len(queries[0][0])
  both = grads(params, *(jnp.concatenate(pair) for pair in zip(queries[0], pool[0])))
  expected = np.asarray(both[:num_queries] @ both[num_queries:].T)
  np.testing.assert_allclose(plain.scores(queries, pool[:1]), expected, rtol=1e-3,
                             atol=1e-4 * np.abs(expected).max())
  assert np.all(np.isfinite(scores))
  print(f"check: step 0's update and per-example norms (as the RunLog stored them) equal "
        f"the vmap(grad) + clipping reference's, and the influence scores' gradient "
        f"products vmap(grad)'s; {len(jax.tree.leaves(params))} parameters, no model line "
        "changed")


if __name__ == "__main__":
  main()
