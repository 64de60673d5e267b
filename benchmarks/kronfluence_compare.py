"""`gl.fit_influence` beside Kronfluence 1.0.1 on identical weights, for RESULTS.md.

A one-off, not part of `make bench`: Kronfluence needs PyTorch, which does not
belong in our environments. Make a throwaway environment for it, then run this file
with one of ours (it trains the models, runs the PyTorch side in the other
environment, and compares):

  python -m venv /tmp/kron && /tmp/kron/bin/pip install torch numpy scikit-learn \
      accelerate einops einconv opt_einsum safetensors
  /tmp/kron/bin/pip install --no-deps kronfluence==1.0.1 dattri==0.3.0
  .venv-jax-0.10.2/bin/python benchmarks/kronfluence_compare.py --torch-python /tmp/kron/bin/python

The data: scikit-learn's digits (shipped with it), standardised; 1,000 training
examples, 200 queries from the rest, as `examples/12_influence_digits.py` has
them. The models, trained here with optax (Adam, full batch) and handed to
PyTorch: the example's MLP `64 -> 64 (tanh) -> 10` (its weights transposed into
`nn.Linear`'s `(out, in)`), and a CNN `conv 3x3 (8 channels, SAME) -> tanh ->
dense 512 -> 10` written in PyTorch's layouts (`nn.Conv2d` OIHW, NCHW images,
`nn.Linear` weights used transposed), all with biases.
Cross-entropy with the true labels (Kronfluence `use_empirical_fisher=True`),
EK-FAC, `damping_factor=None` on both sides. Then, with 10% of the training labels
flipped and the MLP retrained, how many flipped examples are in the top 10% of
self-influence, ours and Kronfluence's on the same weights. The LDS of each set of
scores, by `gl.lds` and by dattri 0.3.0's `dattri.metric.lds` on the same scores,
subsets and retrained losses.

Timing: both sides on this CPU with two threads, one after the other; ours is one
call of `fit_influence` + `scores` (the ratio's), and the same less the seconds JAX
reports tracing, lowering and compiling (`jax.monitoring`); Kronfluence's are its
`fit_all_factors` and `compute_pairwise_scores` wall times. Then the best of
`REPEATS` calls on each side, everything counted (a repeated call of ours compiles
nothing: issue 52's "compiled once").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

N_TRAIN, N_QUERY, BATCH, N_SUBSETS = 1000, 200, 100, 64
REPEATS = 3  # Calls of fit + scores on each side; the best is compared (everything counted).


def _example():
  """`examples/12_influence_digits.py`: its data, MLP, training and retraining."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(__file__), "..", "examples", "12_influence_digits.py")
  spec = importlib.util.spec_from_file_location("influence_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _data(flip: float = 0.0):
  (x, y, flipped), query = _example().data(flip)
  return (x, y), query, flipped


# ----------------------------------------------------------------------------------
# The PyTorch side: run in the throwaway environment as `--side torch DIR`.


def dattri_side(directory: str) -> None:
  """dattri's LDS of each saved set of scores: per query, the Spearman correlation
  over subsets of the subset's summed scores with the measurement (here minus the
  retrained loss, so that a helpful example, positive, lowers it)."""
  import torch  # pylint: disable=g-import-not-at-top
  from dattri.metric import lds  # pylint: disable=g-import-not-at-top

  arrays = np.load(os.path.join(directory, "lds.npz"))
  subsets = torch.from_numpy(arrays["subsets"])
  truth = torch.from_numpy(-arrays["measured"])
  out = {}
  for name in arrays["names"]:
    scores = torch.from_numpy(arrays[f"scores.{name}"]).T  # (n_train, n_test)
    per_query, _ = lds(scores, (truth, subsets))
    out[str(name)] = per_query.numpy().tolist()
  json.dump(out, open(os.path.join(directory, "dattri.json"), "w"))


def torch_side(directory: str) -> None:
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  from kronfluence.analyzer import Analyzer, prepare_model  # pylint: disable=g-import-not-at-top
  from kronfluence.arguments import FactorArguments, ScoreArguments  # pylint: disable=g-import-not-at-top
  from kronfluence.task import Task  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(2)
  spec = json.load(open(os.path.join(directory, "spec.json")))
  arrays = np.load(os.path.join(directory, "inputs.npz"))

  class Classification(Task):
    def compute_train_loss(self, batch, model, sample=False):
      inputs, labels = batch
      return F.cross_entropy(model(inputs), labels, reduction="sum")

    def compute_measurement(self, batch, model):
      return self.compute_train_loss(batch, model)

  def model_of(kind):
    if kind == "mlp":
      model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
      names = {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
    else:
      model = torch.nn.Sequential(
          torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.Tanh(),
          torch.nn.Flatten(), torch.nn.Linear(512, 10))
      names = {"1.weight": "k", "1.bias": "kb", "4.weight": "w", "4.bias": "b"}
    state = {k: torch.from_numpy(arrays[f"{kind}.{v}"].copy()) for k, v in names.items()}
    model.load_state_dict(state)
    return model.eval()

  results = {}
  for run in spec["runs"]:
    kind, name = run["model"], run["name"]
    task = Classification()
    model = prepare_model(model_of(kind), task)
    train = torch.utils.data.TensorDataset(torch.from_numpy(arrays[f"{name}.train_x"]),
                                           torch.from_numpy(arrays[f"{name}.train_y"]).long())
    query = torch.utils.data.TensorDataset(torch.from_numpy(arrays["query_x"]),
                                           torch.from_numpy(arrays["query_y"]).long())
    analyzer = Analyzer(analysis_name=name, model=model, task=task, cpu=True,
                        disable_tqdm=True, output_dir=os.path.join(directory, "kron"))
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
    score_args = ScoreArguments(damping_factor=None)
    totals, first = [], None
    for _ in range(REPEATS if run["pairwise"] else 1):
      start = time.perf_counter()
      analyzer.fit_all_factors(factors_name=name, dataset=train,
                               per_device_batch_size=BATCH, factor_args=factor_args,
                               overwrite_output_dir=True)
      fit_s = time.perf_counter() - start
      start = time.perf_counter()
      if run["pairwise"]:
        analyzer.compute_pairwise_scores(
            scores_name=name, factors_name=name, query_dataset=query, train_dataset=train,
            per_device_query_batch_size=N_QUERY, per_device_train_batch_size=BATCH,
            score_args=score_args, overwrite_output_dir=True)
        scores = analyzer.load_pairwise_scores(name)["all_modules"].numpy()
      else:
        analyzer.compute_self_scores(scores_name=name, factors_name=name,
                                     train_dataset=train, per_device_train_batch_size=BATCH,
                                     score_args=score_args, overwrite_output_dir=True)
        scores = analyzer.load_self_scores(name)["all_modules"].numpy()
      score_s = time.perf_counter() - start
      first = first or (fit_s, score_s)
      totals.append(fit_s + score_s)
    np.save(os.path.join(directory, f"{name}.scores.npy"), scores)
    results[name] = {"fit_s": first[0], "score_s": first[1], "best_s": min(totals),
                     "torch": torch.__version__}
  json.dump(results, open(os.path.join(directory, "torch.json"), "w"))


# ----------------------------------------------------------------------------------
# Our side.


def _models():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top

  def cnn(p, x):
    image = x.reshape(-1, 1, 8, 8)
    h = lax.conv_general_dilated(image, p["k"], (1, 1), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    h = jnp.tanh(h + p["kb"][:, None, None])
    return h.reshape(h.shape[0], -1) @ p["w"].T + p["b"]

  def init(key):
    keys = jax.random.split(jax.random.PRNGKey(key), 2)
    return {"k": 0.3 * jax.random.normal(keys[0], (8, 1, 3, 3)), "kb": jnp.zeros(8),
            "w": 0.05 * jax.random.normal(keys[1], (10, 512)), "b": jnp.zeros(10)}

  example = _example()

  def loss_of(kind):
    if kind == "mlp":
      return example.loss

    def loss(p, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(cnn(p, x), y).mean()
    return loss

  def train(kind, x, y, steps=300):
    if kind == "mlp":  # The example's MLP (`x @ w`; PyTorch gets `w.T`).
      return jax.jit(example.train)(x, y, jnp.ones(len(x)))
    loss = loss_of(kind)
    params = init(0)
    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
      grads = jax.grad(loss)(params, x, y)
      updates, state = optimizer.update(grads, state)
      return optax.apply_updates(params, updates), state

    for _ in range(steps):
      params, state = step(params, state)
    return params

  return loss_of, train


def _torch_layout(kind, params):
  """PyTorch's layouts: `nn.Linear` weights `(out, in)` (the example's MLP has `x @ w`)."""
  flip = ("w1", "w2") if kind == "mlp" else ()
  return {f"{kind}.{k}": np.asarray(v.T if k in flip else v) for k, v in params.items()}


def _batches(x, y):
  return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def _spearman(a, b):
  from scipy.stats import spearmanr  # pylint: disable=g-import-not-at-top
  return np.array([spearmanr(u, v).statistic for u, v in zip(a, b)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--torch-python", required=True)
  parser.add_argument("--side", default="jax")
  parser.add_argument("--float64", action="store_true",
                      help="also compute ours in float64, to judge the worst query")
  parser.add_argument("directory", nargs="?")
  args = parser.parse_args()
  if args.side == "torch":
    torch_side(args.directory)
    return
  if args.side == "dattri":
    dattri_side(args.directory)
    return

  import jax  # pylint: disable=g-import-not-at-top
  import oryx_gradlog as gl  # pylint: disable=g-import-not-at-top
  compiling: list[float] = []  # Seconds of tracing, lowering and compiling.
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **_: compiling.append(seconds)
      if event.startswith("/jax/core/compile/") else None)
  loss_of, train = _models()
  (train_x, train_y), (query_x, query_y), _ = _data()
  (noisy_x, noisy_y), _, flipped = _data(flip=0.1)
  runs = [{"name": "mlp", "model": "mlp", "pairwise": True, "x": train_x, "y": train_y},
          {"name": "cnn", "model": "cnn", "pairwise": True, "x": train_x, "y": train_y},
          {"name": "mlp_flipped", "model": "mlp", "pairwise": False, "x": noisy_x,
           "y": noisy_y}]
  directory = tempfile.mkdtemp(prefix="kronfluence_compare_")
  arrays = {"query_x": query_x, "query_y": query_y}
  params = {}
  for run in runs:
    params[run["name"]] = train(run["model"], run["x"], run["y"])
    arrays[f"{run['name']}.train_x"], arrays[f"{run['name']}.train_y"] = run["x"], run["y"]
    if run["name"] == run["model"]:
      arrays.update(_torch_layout(run["model"], params[run["name"]]))
  # The flipped run has its own MLP weights: hand PyTorch those for that run.
  np.savez(os.path.join(directory, "inputs.npz"), **arrays)
  json.dump({"runs": [{k: r[k] for k in ("name", "model", "pairwise")} for r in runs
                      if r["name"] != "mlp_flipped"]},
            open(os.path.join(directory, "spec.json"), "w"))
  env = dict(os.environ, OMP_NUM_THREADS="2")
  subprocess.run([args.torch_python, __file__, "--torch-python", args.torch_python,
                  "--side", "torch", directory], check=True, env=env)
  theirs = json.load(open(os.path.join(directory, "torch.json")))
  # The flipped MLP: its weights under the MLP's names, in a second call.
  flipped_dir = tempfile.mkdtemp(prefix="kronfluence_flipped_")
  arrays.update(_torch_layout("mlp", params["mlp_flipped"]))
  np.savez(os.path.join(flipped_dir, "inputs.npz"), **arrays)
  json.dump({"runs": [{"name": "mlp_flipped", "model": "mlp", "pairwise": False}]},
            open(os.path.join(flipped_dir, "spec.json"), "w"))
  subprocess.run([args.torch_python, __file__, "--torch-python", args.torch_python,
                  "--side", "torch", flipped_dir], check=True, env=env)
  theirs.update(json.load(open(os.path.join(flipped_dir, "torch.json"))))

  print(f"JAX {jax.__version__}, PyTorch {theirs['mlp']['torch']}, Kronfluence 1.0.1; "
        f"{N_TRAIN} training examples, {N_QUERY} queries, batch {BATCH}, EK-FAC, "
        "damping 0.1 x mean eigenvalue, empirical Fisher")
  print(f"{'model':<6} {'Spearman min':>12} {'median':>7} {'rel. error':>10} "
        f"{'ours s':>7} {'less compile':>12} {'Kronfluence s':>13} {'ratio':>6} "
        f"{'best of ' + str(REPEATS) + ': ours':>17} {'Kronfluence':>11} {'ratio':>6}")
  for run in runs[:2]:
    name, loss = run["name"], loss_of(run["model"])
    batches = _batches(run["x"], run["y"])
    compiling.clear()
    start = time.perf_counter()
    influence = gl.fit_influence(loss, params[name], batches, strategy="ekfac")
    ours = influence.scores([(query_x, query_y)], batches)
    total = time.perf_counter() - start
    times = [total, total - sum(compiling)]
    best = total
    for _ in range(REPEATS - 1):  # Everything counted: a call compiles what it needs.
      start = time.perf_counter()
      gl.fit_influence(loss, params[name], batches, strategy="ekfac").scores(
          [(query_x, query_y)], batches)
      best = min(best, time.perf_counter() - start)
    reference = np.load(os.path.join(directory, f"{name}.scores.npy"))
    rho = _spearman(ours, reference)
    rel = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    worst = int(np.argmin(rho))
    scale = np.abs(reference).max(1)
    print(f"  worst query {worst}: Spearman {rho[worst]:.5f}, its largest |score| "
          f"{scale[worst]:.3g} (median over queries {np.median(scale):.3g}), relative error "
          f"{np.linalg.norm(ours[worst] - reference[worst]) / np.linalg.norm(reference[worst]):.2e}")
    if args.float64:  # Ours again in float64: which float32 result is nearer the truth?
      with jax.enable_x64(True):
        as64 = lambda t: jax.tree.map(lambda v: np.asarray(v, np.float64)
                                      if np.issubdtype(np.asarray(v).dtype, np.floating)
                                      else np.asarray(v), t)
        exact = gl.fit_influence(loss, as64(params[name]), as64(batches)).scores(
            [as64((query_x, query_y))], as64(batches))
      error = lambda s: np.linalg.norm(s[worst] - exact[worst]) / np.linalg.norm(exact[worst])
      print(f"  against float64 (ours): query {worst}'s relative error, ours {error(ours):.2e}, "
            f"Kronfluence {error(reference):.2e}; Spearman ours "
            f"{_spearman(ours[worst:worst + 1], exact[worst:worst + 1])[0]:.5f}, Kronfluence "
            f"{_spearman(reference[worst:worst + 1], exact[worst:worst + 1])[0]:.5f}")
    kron_s = theirs[name]["fit_s"] + theirs[name]["score_s"]
    kron_best = theirs[name]["best_s"]
    print(f"{name:<6} {rho.min():>12.5f} {np.median(rho):>7.5f} {rel:>10.2e} "
          f"{times[0]:>7.2f} {times[1]:>12.2f} {kron_s:>13.2f} {times[0] / kron_s:>6.2f} "
          f"{best:>17.2f} {kron_best:>11.2f} {best / kron_best:>6.2f}")
  # LDS on the MLP: the example's retraining on random halves, vmapped.
  example = _example()
  subsets = np.random.default_rng(2).random((N_SUBSETS, N_TRAIN)) < 0.5
  measured = example.retrained_losses(train_x, train_y, query_x, query_y, subsets)
  batches = _batches(train_x, train_y)
  scored = {s: gl.fit_influence(example.loss, params["mlp"], batches, strategy=s)
            .scores([(query_x, query_y)], batches) for s in ("identity", "ekfac")}
  scored["kronfluence"] = np.load(os.path.join(directory, "mlp.scores.npy"))
  lds = {name: gl.lds(s, subsets, measured) for name, s in scored.items()}
  print(f"LDS over {N_SUBSETS} half-data retrainings (MLP): ours EK-FAC {lds['ekfac']:.3f}, "
        f"Kronfluence EK-FAC {lds['kronfluence']:.3f}, gradient products "
        f"{lds['identity']:.3f}")
  # dattri's LDS of the same scores, subsets and retrained losses.
  np.savez(os.path.join(directory, "lds.npz"), subsets=subsets,
           measured=np.asarray(measured, np.float64), names=np.array(list(scored)),
           **{f"scores.{n}": np.asarray(s, np.float64) for n, s in scored.items()})
  subprocess.run([args.torch_python, __file__, "--torch-python", args.torch_python,
                  "--side", "dattri", directory], check=True, env=env)
  by_dattri = json.load(open(os.path.join(directory, "dattri.json")))
  for name in scored:
    theirs_lds = np.asarray(by_dattri[name], np.float64)
    print(f"  {name}: LDS by gl.lds {lds[name]:.6f}, by dattri 0.3.0 "
          f"{np.nanmean(theirs_lds):.6f} (queries where dattri gives NaN: "
          f"{int(np.isnan(theirs_lds).sum())})")
  name, loss = "mlp_flipped", loss_of("mlp")
  batches = _batches(noisy_x, noisy_y)
  ours = gl.fit_influence(loss, params[name], batches).self_influence(batches)
  reference = np.load(os.path.join(flipped_dir, f"{name}.scores.npy"))
  top = N_TRAIN // 10
  found = lambda s: int(flipped[np.argsort(-s)[:top]].sum())
  print(f"flipped labels ({int(flipped.sum())} of {N_TRAIN}) in the top {top} by "
        f"self-influence: ours {found(ours)}, Kronfluence {found(reference)}; Spearman "
        f"of the two rankings {_spearman(ours[None], reference[None])[0]:.5f}")


if __name__ == "__main__":
  sys.exit(main())
