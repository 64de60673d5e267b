"""Which training text did this: a GPT trained on the Python standard library's source.

The reference problem of attribution at the size people train (issue 52), with
nothing to download: example 11's GPT (stock Flax NNX, nothing marked) learns the
bytes of the standard library's own Python files (`sysconfig.get_paths()["stdlib"]`,
files in sorted order; tests, `idlelib`, `lib2to3`, `site-packages` and caches left
out: about 11 MB on Python 3.11, near WikiText-2's size). The bytes are the tokens (a
vocabulary of 256, reproducible with no tokenizer), cut into sequences of `SEQ + 1`;
every `QUERY_EVERY`-th sequence is held out as a query, as in Kronfluence's GPT-2 /
WikiText-2 case (about 4,600 training sequences of 512 tokens and 481 queries).

1. Training: Adam, a Python loop of jitted steps.
2. `gl.fit_influence`: EK-FAC of every layer, from the training sequences.
3. `Influence.scores`: every query against every training sequence, each query's
   preconditioned gradient kept as rank-r factors per layer (`query_rank`), so all
   the queries are held at once and the training sequences are read once.
4. For a few queries, the most helpful training sequences shown as what they are:
   the file and line each starts at, and its first line of text.

Each phase's time is printed apart, and of it the seconds JAX spent tracing and
compiling (its monitoring events).

Sizes (`--size`): `quick`, 2 blocks of width 64 on the first files (seconds: the test
suite runs it); `small` (the default), 2 blocks of width 128, 512 training
sequences, a CPU's minute; `medium`, 4 blocks of width 256, sequence 128, 2,048
training sequences, a CPU's quarter hour; `gpt2`, GPT-2-small's shape (12 blocks,
width 768, 12 heads, sequence 512) on the whole corpus, for an accelerator (a TPU
v5e trains it at 26.6 ms a step; `benchmarks/tpu_example13.sh` runs it there, and
benchmarks/RESULTS.md has the figures). `--progress` shows how far along fitting
and scoring are.

The checks at the end: the low-rank scores of a few queries against their whole
gradients' (Spearman per query); with `strategy="identity"`, the scores of a few
queries and training sequences equal `vmap(grad)`'s gradient inner products.

`--params FILE` keeps the trained parameters between runs (an accelerator's calls of
ten minutes: `--train-only` in one, the rest in the next). At `--size gpt2` the 481
queries' rank-32 factors take 10.7 GiB, and the scoring step compiled for a TPU v5e
peaks at 14.3 GiB of its 15.7 (`Influence.scores`' sharp edges); `--query-block 241`
halves the queries held (8.9 GiB) for a second read of the training sequences.

`--save-scores` and `--compare-scores` compare two runs' scores, query by query (the
TPU's default precision against `JAX_DEFAULT_MATMUL_PRECISION=highest`).

`--log-run DIR` is LoGra during training itself: every step also logs its batch's
projected per-example gradients (`gl.projected_grads`, `k x k` per layer), ids,
per-sequence losses and learning rate into a `gl.RunLog`, with every sequence
described by its file, line and text; `--log-self` also each sequence's gradient
against its own Adam step direction (`gl.per_example_self_products` with
`gl.adam_preconditioner`; it forms every layer's per-example gradients). After
training: the sequences of the highest self-influence (under Adam with
`--log-self`), the log's size against the whole per-example gradients, `gl.report`'s
attribution page (loss spikes and self-influence, as text), and the check of the last
step's logged ids, losses (and self-products) against `vmap`'s of its rows. With the
scores, a pass at the final parameters logs every training sequence's projected
gradients beside a batch of queries' (`DIR/final_pass`): `gl.influence_from_run`'s
LoGra scores, compared with EK-FAC's (Spearman per query). `--tracin N` also logs,
at every step, the first N queries' projected gradients (a second backward pass, of
N sequences) and, with `--log-self`, the products of their Adam step directions with
the batch's gradients: their TracIn scores over the run (`gl.tracin`), compared with
EK-FAC's at the end; the products of the last step are checked against `vmap`'s.

Run: python examples/13_stdlib_attribution.py [--quick | --size small|medium|gpt2]
     [--query-rank R] [--steps N] [--params FILE [--train-only]] [--queries N]
     [--query-block N] [--save-scores FILE] [--compare-scores FILE] [--no-checks]
     [--log-run DIR [--log-self] [--tracin N]] [--progress]
"""

import argparse
import importlib.util
import os
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import oryx_gradlog as gl

SIZES = {  # depth, width, heads, sequence, training sequences, steps, batch, query rank,
    # and k, the logged projected gradients' size per side of each layer (--log-run)
    "quick": dict(depth=2, width=64, heads=2, seq=64, n_train=192, steps=60, batch=16,
                  rank=8, k=8),
    "small": dict(depth=2, width=128, heads=4, seq=64, n_train=512, steps=200, batch=32,
                  rank=16, k=16),
    "medium": dict(depth=4, width=256, heads=4, seq=128, n_train=2048, steps=300,
                   batch=32, rank=32, k=32),
    "gpt2": dict(depth=12, width=768, heads=12, seq=512, n_train=4600, steps=2000,
                 batch=8, rank=32, k=64),
}
LEARNING_RATE = 3e-3
QUERY_EVERY = 10  # One sequence in ten is a query: 4,600 / 10 ~ 481 at GPT-2's size.
SKIPPED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


def corpus(size: int):
  """The standard library's Python files in sorted order, up to `size` bytes:
  `(bytes as uint8, [(start byte, file name)])`."""
  root = sysconfig.get_paths()["stdlib"]
  chunks, starts, total = [], [], 0
  for folder, folders, files in os.walk(root):
    folders[:] = sorted(f for f in folders if f not in SKIPPED)
    for name in sorted(files):
      if not name.endswith(".py") or total >= size:
        continue
      data = pathlib.Path(folder, name).read_bytes()
      starts.append((total, os.path.relpath(os.path.join(folder, name), root)))
      chunks.append(data)
      total += len(data)
  return np.frombuffer(b"".join(chunks)[:size], np.uint8), starts


def sequences(text: np.ndarray, starts, seq: int, n: int):
  """`n` sequences of `seq + 1` bytes, cut one after another, and where each starts
  (file name, line)."""
  windows = text[: n * (seq + 1)].reshape(n, seq + 1).astype(np.int32)
  offsets = np.arange(n) * (seq + 1)
  file_starts = np.array([s for s, _ in starts])
  where = []
  for offset in offsets:
    f = int(np.searchsorted(file_starts, offset, side="right")) - 1
    line = 1 + int(np.count_nonzero(text[file_starts[f]:offset] == ord("\n")))
    where.append((starts[f][1], line))
  return windows, where


def problem(size: dict):
  """One size's sequences: `((training windows, where each starts), (query windows,
  where each starts), (files, bytes) of the corpus read)`; every `QUERY_EVERY`-th
  sequence is a query."""
  seq, n_train = size["seq"], size["n_train"]
  n_all = n_train + n_train // (QUERY_EVERY - 1) + 1
  text, starts = corpus(n_all * (seq + 1))
  windows, where = sequences(text, starts, seq, n_all)
  is_query = np.arange(n_all) % QUERY_EVERY == QUERY_EVERY - 1
  train_where = [w for w, q in zip(where, is_query) if not q][:n_train]
  query_where = [w for w, q in zip(where, is_query) if q]
  return ((windows[~is_query][:n_train], train_where), (windows[is_query], query_where),
          (len(starts), text.size))


def model(size: dict):
  """Example 11's GPT at one size, untrained: `nnx.split(model, nnx.Param, ...)`."""
  gpt = gpt_class()(256, size["seq"], size["width"], size["heads"], size["depth"],
                    rngs=nnx.Rngs(0))
  return nnx.split(gpt, nnx.Param, ...)


def gpt_class():
  """Example 11's GPT (stock Flax NNX modules), imported from its file."""
  path = pathlib.Path(__file__).with_name("11_any_model_dp.py")
  spec = importlib.util.spec_from_file_location("_any_model_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.GPT


def make_loss(graphdef, rest):
  def loss(params, inputs, targets, per_sequence=False):
    """The mean over the batch of each sequence's mean next-byte loss (or, with
    `per_sequence`, the `(B,)` losses of the sequences)."""
    logits = nnx.merge(graphdef, params, rest)(inputs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
    return losses if per_sequence else losses.mean()
  return loss


def training_steps(loss, projector=None, log_self: bool = False, queries=None):
  """Adam's jitted steps of `(params, state, rows)`: `(optimizer, step, logged_step)`.

  `step` returns `(params, state, loss)`; `logged_step` also a dict to log: LoGra's
  projected per-example gradients of the batch (`"train"`, with `projector`), its
  loss and per-sequence losses; with `log_self`, each sequence's gradient against
  its own Adam step direction (`"self"`, for `gl.tracin_self_influence`); with
  `queries` (rows of sequences), their projected gradients at the step's parameters
  (`"query"`, for `gl.tracin`) and, with `log_self`, their Adam step directions'
  products with the batch's gradients (`"products"`)."""
  optimizer = optax.adam(LEARNING_RATE)

  @jax.jit
  def step(params, state, rows):
    value, grads = jax.value_and_grad(loss)(params, rows[:, :-1], rows[:, 1:])
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, value

  def sequence_losses(params, inputs, targets):
    per_sequence = loss(params, inputs, targets, per_sequence=True)
    return per_sequence.mean(), per_sequence

  @jax.jit
  def logged_step(params, state, rows):
    ((value, losses), grads), records = gl.call_and_reap(jax.value_and_grad(
        gl.record_layers(sequence_losses), has_aux=True))(params, rows[:, :-1], rows[:, 1:])
    updates, state = optimizer.update(grads, state)
    logged = {"train": gl.projected_grads(records, projector), "loss": value,
              "losses": losses}
    if log_self:  # Forms each layer's per-example gradients: a costly extra.
      logged["self"] = gl.per_example_self_products(records, gl.adam_preconditioner(state))
    if queries is not None:  # A second backward pass, of the queries.
      logged["query"] = gl.projected_grads(gl.reap(jax.grad(gl.record_layers(loss)))(
          params, queries[:, :-1], queries[:, 1:]), projector)
    if queries is not None and log_self:  # Each query's whole gradient, Adam's step.
      directions = jax.tree.map(jnp.multiply, gl.adam_preconditioner(state),
                                per_sequence_grads(loss, params, queries))
      logged["products"] = jax.vmap(gl.per_example_products, in_axes=(None, 0))(
          records, directions)
    return optax.apply_updates(params, updates), state, value, logged

  return optimizer, step, logged_step


def train(loss, params, windows, steps: int, batch: int, seed: int = 0, log=None,
          projector=None, log_self: bool = False, queries=None):
  """Adam on random batches; with a `gl.RunLog` `log`, every step also logs
  `training_steps`' dict, the batch's ids and the learning rate. Returns the
  parameters, the last loss, and the last logged step's `(params before, state
  after, ids)` (for the checks)."""
  optimizer, step, logged_step = training_steps(loss, projector, log_self, queries)
  rng = np.random.default_rng(seed)
  state, value, last = optimizer.init(params), None, None
  for t in range(steps):
    chosen = rng.choice(len(windows), batch, replace=False)
    rows = jnp.asarray(windows[chosen])
    if log is None:
      params, state, value = step(params, state, rows)
      continue
    before = params
    params, state, value, logged = logged_step(params, state, rows)
    log.append(t, {**logged, "ids": chosen, "lr": np.float32(LEARNING_RATE)})
    last = (before, state, chosen)
  return params, float(value), last


def per_sequence_grads(loss, params, rows):
  """`vmap(grad)`: each sequence's own gradient, stacked on a leading axis."""
  one = lambda p, r: loss(p, r[None, :-1], r[None, 1:])
  return jax.vmap(jax.grad(one), in_axes=(None, 0))(params, rows)


def compile_clock():
  """A function that returns the seconds JAX has spent tracing, lowering and
  compiling since this call (its `/jax/core/compile/` duration events)."""
  total = [0.0]

  def on_duration(event: str, seconds: float, **_):
    if event.startswith("/jax/core/compile/"):
      total[0] += seconds

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  return lambda: total[0]


def load_params(path: str, like):
  """Parameters saved by `--params` (`np.savez` of the leaves, in order), checked
  against the model's own shapes."""
  with np.load(path) as saved:
    leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  expected = [v.shape for v in jax.tree.leaves(like)]
  if [v.shape for v in leaves] != expected:
    raise ValueError(
        f"--params: {path} holds parameters of other shapes ({len(leaves)} arrays, "
        f"not this --size's {len(expected)} of shapes {expected[:3]}...); give this "
        "size's file, or a path that does not exist to train and save there.")
  return jax.tree.unflatten(jax.tree.structure(like), [jnp.asarray(v) for v in leaves])


def batches(windows, batch: int):
  return [(windows[i:i + batch, :-1], windows[i:i + batch, 1:])
          for i in range(0, len(windows), batch)]


def _spearman(a, b) -> float:
  rank = lambda v: np.argsort(np.argsort(v))
  return float(np.corrcoef(rank(a), rank(b))[0, 1])


def first_line(window) -> str:
  text = bytes(np.asarray(window, np.uint8)).decode("utf-8", "replace")
  return text.strip().splitlines()[0][:60] if text.strip() else ""


def print_times(times: dict) -> None:
  print("times (s, of them compiling): " + ", ".join(
      f"{phase} {seconds:.1f} ({compile_s:.1f})"
      for phase, (seconds, compile_s) in times.items()))


def logged_pass(run_dir, loss, params, projector, train_windows, query_windows,
                batch: int) -> np.ndarray:
  """LoGra's influence scores `(queries, training sequences)`: one pass over the
  training sequences at `params`, their projected gradients logged with learning rate
  0 beside the queries', then `gl.influence_from_run`."""
  def projected(params, rows):
    records = gl.reap(jax.grad(gl.record_layers(loss)))(params, rows[:, :-1], rows[:, 1:])
    return gl.projected_grads(records, projector)

  projected = jax.jit(projected)
  queries = projected(params, jnp.asarray(query_windows))
  with gl.RunLog(run_dir) as log:
    for step, start in enumerate(range(0, len(train_windows), batch)):
      rows = train_windows[start:start + batch]
      log.append(step, {"train": projected(params, jnp.asarray(rows)), "query": queries,
                        "ids": np.arange(start, start + len(rows)),
                        "lr": np.float32(0.0)})
  return gl.influence_from_run(run_dir, num_examples=len(train_windows))


def logged_run(run_dir, loss, train_where, train_windows, last_logged, queries=None):
  """Self-influence from the training run's log, its size, its report; with
  `queries` (the logged ones' rows), their TracIn scores, returned; and the checks
  of its last step against plain JAX."""
  run = gl.open_run(run_dir)
  adam = "self" in run
  own = gl.tracin_self_influence(run, self_products="self" if adam else None,
                                 num_examples=len(train_windows))
  print(f"self-influence {'under Adam' if adam else 'as for SGD (no --log-self)'}, from "
        f"the {run.sizes['step']} logged steps (the sequences training pushed against "
        "most):")
  for i in np.argsort(-own)[:3]:
    name, line = train_where[i]
    print(f"  {own[i]:.3g}  {name}:{line}  {first_line(train_windows[i])!r}")
  before, state, chosen = last_logged
  projected = sum(run[v].values[0].size for v in run.data_vars
                  if str(v).startswith("train.grads."))
  whole = sum(np.size(v) for v in jax.tree.leaves(before))
  print(f"logged per step: {projected:,} projected numbers for {len(chosen)} sequences, "
        f"{projected / (len(chosen) * whole):.3%} of their whole per-example gradients "
        f"({whole:,} parameters each)")
  print(f"report: {gl.report(run_dir)}")
  tracin = None
  if queries is not None:
    tracin = gl.tracin(run, products="products" if adam else None,
                       num_examples=len(train_windows))
    print(f"TracIn {'under Adam' if adam else 'as for SGD (no --log-self)'} of "
          f"{len(queries)} queries over the {run.sizes['step']} logged steps; query 0, "
          f"{first_line(queries[0])!r}, was helped most by:")
    for i in np.argsort(-tracin[0])[:3]:
      name, line = train_where[i]
      print(f"  {tracin[0, i]:+.3g}  {name}:{line}  {first_line(train_windows[i])!r}")
  # The checks: the last step's logged ids and per-sequence losses are those of its
  # rows at that step's parameters; its self-products are <g_i, P g_i> of vmap(grad)'s
  # per-sequence gradients there, P Adam's after its update.
  rows = jnp.asarray(train_windows[chosen])
  one = lambda p, r: loss(p, r[None, :-1], r[None, 1:])
  np.testing.assert_array_equal(run["ids"].values[-1], chosen)
  np.testing.assert_allclose(run["losses"].values[-1],
                             jax.vmap(one, in_axes=(None, 0))(before, rows), rtol=1e-4)
  if adam:
    flat = lambda tree, n: jnp.concatenate(
        [v.reshape(n, -1) for v in jax.tree.leaves(tree)], axis=1)
    grads = flat(per_sequence_grads(loss, before, rows), len(chosen))
    weights = flat(jax.tree.map(lambda w: w[None], gl.adam_preconditioner(state)), 1)
    np.testing.assert_allclose(run["self"].values[-1],
                               jnp.sum(grads ** 2 * weights, axis=1), rtol=2e-3)
  if adam and queries is not None:
    directions = flat(per_sequence_grads(loss, before, jnp.asarray(queries)),
                      len(queries)) * weights
    expected = directions @ grads.T
    np.testing.assert_allclose(run["products"].values[-1], expected, rtol=2e-3,
                               atol=1e-4 * np.abs(expected).max())
  print("check: the last logged step's ids and losses" + (
      " and self-products" if adam else "") + (
          " and the queries' Adam products" if adam and queries is not None else "")
        + " are vmap's of its rows")
  return tracin


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="small")
  parser.add_argument("--quick", action="store_true", help="--size quick")
  parser.add_argument("--query-rank", type=int, default=None,
                      help="the queries' rank per layer (default: the size's)")
  parser.add_argument("--params", default=None, metavar="FILE",
                      help="the trained parameters (.npz): loaded where FILE exists "
                      "(training skipped), else trained and saved there")
  parser.add_argument("--steps", type=int, default=None, metavar="N",
                      help="training steps (default: the size's)")
  parser.add_argument("--train-only", action="store_true",
                      help="stop after training (with --params: save them for a later run)")
  parser.add_argument("--queries", type=int, default=None, metavar="N",
                      help="score only the first N query sequences")
  parser.add_argument("--query-block", type=int, default=None, metavar="N",
                      help="score N queries at a time, each block reading the training "
                      "sequences again (default: all at once; at --size gpt2 they take "
                      "10.7 GiB of the device)")
  parser.add_argument("--save-scores", default=None, metavar="FILE",
                      help="save the scores (queries x training sequences, .npy)")
  parser.add_argument("--compare-scores", default=None, metavar="FILE",
                      help="per-query Spearman of the scores against FILE's first rows "
                      "(another run's --save-scores: e.g. at "
                      "JAX_DEFAULT_MATMUL_PRECISION=highest)")
  parser.add_argument("--no-checks", action="store_true",
                      help="skip the checks at the end (low rank against whole query "
                      "gradients; identity scores against vmap(grad))")
  parser.add_argument("--log-run", default=None, metavar="DIR",
                      help="log LoGra's projected per-example gradients (the size's k "
                      "per side) at every training step into a gl.RunLog in DIR; then "
                      "self-influence as text and gl.report's attribution page")
  parser.add_argument("--log-self", action="store_true",
                      help="with --log-run, also each sequence's gradient against its own "
                      "Adam step (self-influence under Adam; forms every layer's "
                      "per-example gradients, about 1.5x a step on a CPU)")
  parser.add_argument("--tracin", type=int, default=None, metavar="N",
                      help="with --log-run, also log the first N queries' projected "
                      "gradients at every step (a second backward pass, of N sequences) "
                      "and, with --log-self, their Adam products with the batch's; then "
                      "their TracIn scores")
  parser.add_argument("--progress", action="store_true",
                      help="progress bars for fitting and scoring (tqdm)")
  parser.add_argument("--run-dir", default=None, help="unused (the tests pass it)")
  args = parser.parse_args()
  size = SIZES["quick" if args.quick else args.size]
  rank = args.query_rank or size["rank"]
  steps = size["steps"] if args.steps is None else args.steps
  if steps < 1:
    raise ValueError(f"--steps {steps}: give at least 1 training step.")
  seq, n_train = size["seq"], size["n_train"]
  (train_windows, train_where), (query_windows, query_where), (files, text_bytes) = (
      problem(size))
  query_windows, query_where = query_windows[:args.queries], query_where[:args.queries]
  print(f"corpus: {files} files, {text_bytes / 1e6:.2f} MB; {len(train_windows)} "
        f"training and {len(query_windows)} query sequences of {seq} bytes")

  if args.compare_scores:  # Checked before the work, not after.
    other = np.load(args.compare_scores)
    if other.ndim != 2 or other.shape[1] != len(train_windows) or len(other) < len(
        query_windows):
      raise ValueError(
          f"--compare-scores: {args.compare_scores} holds {other.shape} scores, this "
          f"run makes {(len(query_windows), len(train_windows))}; give the same --size "
          "as the run that saved them, and at most its --queries.")

  graphdef, params, rest = model(size)
  loss = make_loss(graphdef, rest)
  for flag, given in (("--log-self", args.log_self), ("--tracin", args.tracin)):
    if given and not args.log_run:
      raise ValueError(f"{flag} adds to the training run's log: give --log-run DIR too.")
  if args.tracin is not None and not 0 < args.tracin <= len(query_windows):
    raise ValueError(f"--tracin {args.tracin}: give 1 to {len(query_windows)}, the "
                     "query sequences there are.")
  tracin_queries = None if args.tracin is None else query_windows[:args.tracin]
  if args.log_run and args.params and os.path.exists(args.params):
    raise ValueError(f"--log-run logs the training run, but --params {args.params} "
                     "exists, so nothing would be trained: give a --params file that "
                     "does not exist yet, or leave --params out.")
  log = projector = tracin = None
  if args.log_run:  # Random projections: the first batch's shapes are all they read.
    projector = gl.fit_projector(loss, params, batches(train_windows[:size["batch"]],
                                                       size["batch"]), k=size["k"])
    log = gl.RunLog(args.log_run)
    log.describe_examples(text=[f"{name}:{line} {first_line(w)}" for (name, line), w
                                in zip(train_where, train_windows)])

  compiling = compile_clock()
  started, compiled = time.perf_counter(), compiling()
  if args.params and os.path.exists(args.params):
    params, phase = load_params(args.params, params), "load"
    print(f"loaded the trained parameters from {args.params}")
  else:
    (params, last, last_logged), phase = train(
        loss, params, train_windows, steps, size["batch"], log=log,
        projector=projector, log_self=args.log_self,
        queries=None if tracin_queries is None else jnp.asarray(tracin_queries)), (
            "train" + (" (logged)" if log else ""))
    seconds, compile_s = time.perf_counter() - started, compiling() - compiled
    print(f"trained {steps} steps: loss {last:.3f} nats a byte; "
          f"{1e3 * (seconds - compile_s) / steps:.1f} ms a step besides compiling")
    if args.params:
      with open(args.params, "wb") as f:  # The name as given (savez adds no ".npz").
        np.savez(f, *(np.asarray(v) for v in jax.tree.leaves(params)))
  times = {phase: (time.perf_counter() - started, compiling() - compiled)}
  if log is not None:
    log.close()
    tracin = logged_run(args.log_run, loss, train_where, train_windows, last_logged,
                        tracin_queries)
    last_logged = None  # A copy of the parameters and Adam's state: freed for scoring.
  if args.train_only:
    print_times(times)
    return

  started, compiled = time.perf_counter(), compiling()
  influence = gl.fit_influence(loss, params, batches(train_windows, size["batch"]),
                               progress=args.progress)
  times["fit EK-FAC"] = (time.perf_counter() - started, compiling() - compiled)
  started, compiled = time.perf_counter(), compiling()
  scores = influence.scores(batches(query_windows, size["batch"]),
                            batches(train_windows, size["batch"]), query_rank=rank,
                            query_block=args.query_block, progress=args.progress)
  times[f"scores (rank {rank})"] = (time.perf_counter() - started, compiling() - compiled)
  print_times(times)

  if args.save_scores:
    np.save(args.save_scores, np.asarray(scores))
  if args.compare_scores:
    rho = [_spearman(a, b) for a, b in zip(np.asarray(scores), other)]
    print(f"against {args.compare_scores}, {len(rho)} queries: Spearman per query mean "
          f"{np.mean(rho):.3f}, min {min(rho):.3f}")

  if args.log_run:  # LoGra's influence, from a logged pass at the final parameters.
    few = min(size["batch"], len(query_windows))
    started, compiled = time.perf_counter(), compiling()
    logra = logged_pass(os.path.join(args.log_run, "final_pass"), loss, params, projector,
                        train_windows, query_windows[:few], size["batch"])
    print_times({"LoGra pass": (time.perf_counter() - started, compiling() - compiled)})
    rho = [_spearman(a, b) for a, b in zip(logra, np.asarray(scores))]
    print(f"LoGra (k = {size['k']}) against EK-FAC, {few} queries: Spearman per query "
          f"mean {np.mean(rho):.3f}, min {min(rho):.3f}")
    if tracin is not None:
      rho = [_spearman(a, b) for a, b in zip(tracin, np.asarray(scores))]
      print(f"TracIn from the run against EK-FAC at the end, {len(rho)} queries: "
            f"Spearman per query mean {np.mean(rho):.3f}, min {min(rho):.3f}")

  helpful, _ = gl.Influence.top_k(scores, 3)
  for q in range(min(3, len(query_windows))):
    name, line = query_where[q]
    print(f"query {q} ({name}:{line}): {first_line(query_windows[q])!r}")
    for i in helpful[q]:
      name, line = train_where[i]
      print(f"  {scores[q, i]:+.3g}  {name}:{line}  {first_line(train_windows[i])!r}")

  if args.no_checks:
    return
  # The low rank against the whole gradients, for a few queries.
  few = min(8, len(query_windows))
  whole = influence.scores(batches(query_windows[:few], few),
                           batches(train_windows, size["batch"]), progress=False)
  rho = [_spearman(a, b) for a, b in zip(scores[:few], whole)]
  print(f"rank {rank} against whole query gradients, {few} queries: Spearman per query "
        f"min {min(rho):.3f}, median {np.median(rho):.3f}")

  # The check: the identity strategy's scores are vmap(grad)'s gradient inner products.
  few_q, few_t = query_windows[:2], train_windows[:4]
  identity = gl.fit_influence(loss, params, batches(few_t, 4), strategy="identity",
                              progress=False)
  got = identity.scores(batches(few_q, 2), batches(few_t, 4), progress=False)

  def per_example(rows):
    grads = per_sequence_grads(loss, params, jnp.asarray(rows))
    return jnp.concatenate([g.reshape(len(rows), -1) for g in jax.tree.leaves(grads)], 1)

  expected = np.asarray(per_example(few_q) @ per_example(few_t).T)
  np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-4 * np.abs(expected).max())
  assert np.all(np.isfinite(scores)) and scores.shape == (len(query_windows), n_train)
  print("check: identity scores equal vmap(grad) inner products; every query scored "
        "against every training sequence")


if __name__ == "__main__":
  main()
