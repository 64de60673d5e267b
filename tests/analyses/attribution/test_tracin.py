"""TracIn and loss-spike attribution from a logged run, against the same sums
recomputed from the run's checkpoints with `vmap(grad)` per-example gradients
(projected by hand where the projection is not exact)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_influence import N, Q, B, _mlp, _mlp_blocks, _per_example
from test_projection import _expected

import oryx_gradlog as gl
from oryx_gradlog.storage import _attribution_page


def _flat(grads) -> np.ndarray:
  """`(n, D)`: a parameter tree of per-example gradients, flattened."""
  return np.concatenate([np.asarray(g, np.float64).reshape(g.shape[0], -1)
                         for g in jax.tree.leaves(grads)], axis=1)


def _train(loss, params, data, batches, projector, run_dir, lr_of, query=None,
           described=None):
  """SGD in a Python loop of jitted steps, each logging its batch's projected
  gradients, ids, learning rate and loss (and the query's); returns the parameters
  each step started from (the checkpoints)."""
  grad = gl.call_and_reap(jax.value_and_grad(gl.record_layers(loss)))

  @jax.jit
  def step(params, batch, query, lr):
    (value, grads), records = grad(params, *batch)
    each = jax.vmap(lambda *example: loss(params, *(v[None] for v in example)))(*batch)
    logged = {"train": gl.projected_grads(records, projector), "lr": lr, "loss": value,
              "losses": each}
    if query is not None:
      logged["query"] = gl.projected_grads(
          gl.reap(jax.grad(gl.record_layers(loss)))(params, *query), projector)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), logged

  checkpoints = []
  with gl.RunLog(run_dir) as log:
    if described is not None:
      log.describe_examples(**described)
    for i, ids in enumerate(batches):
      checkpoints.append(params)
      lr = jnp.float32(lr_of(i))
      params, logged = step(params, tuple(a[ids] for a in data), query, lr)
      log.append(i, {**logged, "ids": jnp.asarray(ids)})
  return checkpoints


def _mlp_run(tmp_path, k):
  params, x, t, forward, loss = _mlp()
  order = np.random.default_rng(0).permutation(N)
  batches = [order[i:i + B] for i in range(0, N, B)] * 2  # Two epochs, 6 steps.
  projector = gl.fit_projector(loss, params, [(x[:B], t[:B])], k=k, seed=2)
  lr_of = lambda i: 0.05 / (1 + i)
  query = (x[N:], t[N:])
  checkpoints = _train(loss, params, (x, t), batches, projector, tmp_path / "run", lr_of,
                       query)
  return params, x, t, forward, loss, batches, projector, lr_of, checkpoints


def test_tracin_with_an_exact_projection_is_the_sum_of_lr_weighted_gradient_products(
    tmp_path):
  _, x, t, _, loss, batches, projector, lr_of, checkpoints = _mlp_run(tmp_path, k=8)
  assert all(p is None for pair in projector.blocks.values() for p in pair)  # Exact.
  expected, own = np.zeros((Q, N)), np.zeros(N)
  for i, (ids, params) in enumerate(zip(batches, checkpoints)):
    gz = _flat(_per_example(loss, params, x[ids], t[ids]))
    gq = _flat(_per_example(loss, params, x[N:], t[N:]))
    expected[:, ids] += lr_of(i) * gq @ gz.T
    own[ids] += lr_of(i) * np.sum(gz ** 2, axis=1)
  scores = gl.tracin(tmp_path / "run")
  np.testing.assert_allclose(scores, expected, rtol=2e-4, atol=1e-6 * np.abs(expected).max())
  np.testing.assert_allclose(gl.tracin_self_influence(tmp_path / "run"), own, rtol=2e-4)
  assert gl.tracin(gl.open_run(tmp_path / "run"), num_examples=N + 5).shape == (Q, N + 5)
  with pytest.raises(ValueError, match=r"tracin_self_influence\(num_examples=3\): the run "
                     r"has ids up to 11"):
    gl.tracin_self_influence(tmp_path / "run", num_examples=3)


def test_tracin_of_projected_gradients_is_the_sum_of_their_products(tmp_path):
  _, x, t, forward, loss, batches, projector, lr_of, checkpoints = _mlp_run(tmp_path, k=2)

  def projected(params, x, t):  # Sorted block order, as ProjectedGrads.flat.
    blocks = dict(zip(("w1", "w2", "s"), _mlp_blocks(params, x, t, forward, loss)))
    return np.concatenate([_expected(projector, name, blocks[name][-1]).reshape(
        x.shape[0], -1) for name in sorted(blocks)], axis=1)

  expected = np.zeros((Q, N))
  for i, (ids, params) in enumerate(zip(batches, checkpoints)):
    expected[:, ids] += lr_of(i) * projected(params, x[N:], t[N:]) @ projected(
        params, x[ids], t[ids]).T
  np.testing.assert_allclose(gl.tracin(tmp_path / "run"), expected, rtol=2e-4,
                             atol=1e-6 * np.abs(expected).max())


def test_tracin_of_an_adam_run_is_the_sum_of_preconditioned_gradient_products(tmp_path):
  # Setup: Adam in a Python loop of jitted steps; each step logs, per query, the
  # products of its preconditioned gradient with the batch's per-example gradients.
  optax = pytest.importorskip("optax")
  params, x, t, _, loss = _mlp()
  opt = optax.adam(0.05, b2=0.99)
  grad = gl.call_and_reap(jax.value_and_grad(gl.record_layers(loss)))
  one = lambda p, x, t: loss(p, x[None], t[None])

  @jax.jit
  def step(params, opt_state, batch):
    (_, grads), records = grad(params, *batch)
    updates, opt_state = opt.update(grads, opt_state)
    pre = gl.adam_preconditioner(opt_state, b2=0.99)
    queries = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x[N:], t[N:])
    directions = jax.tree.map(lambda p, q: p * q, pre, queries)
    products = jax.vmap(lambda v: gl.per_example_products(records, v))(directions)
    own = gl.per_example_self_products(records, pre)
    return optax.apply_updates(params, updates), opt_state, products, own

  order = np.random.default_rng(0).permutation(N)
  batches = [order[i:i + B] for i in range(0, N, B)] * 2
  opt_state, checkpoints = opt.init(params), []
  with gl.RunLog(tmp_path / "run") as log:
    for i, ids in enumerate(batches):
      checkpoints.append((params, opt_state))
      params, opt_state, products, own = step(params, opt_state, (x[ids], t[ids]))
      log.append(i, {"products": products, "self": own, "ids": jnp.asarray(ids),
                     "lr": jnp.float32(0.05)})
  # True computation: sum_t lr <P_t g_t(q), g_t(z)>, with P_t from optax's state
  # after step t's update, recomputed from the checkpoints with vmap(grad); and the
  # self-influence sum_t lr <g_t(z), P_t g_t(z)>.
  expected, plain = np.zeros((Q, N)), np.zeros((Q, N))
  expected_own, plain_own = np.zeros(N), np.zeros(N)
  for ids, (params, opt_state) in zip(batches, checkpoints):
    grads = jax.grad(loss)(params, x[ids], t[ids])
    _, state = opt.update(grads, opt_state)
    nu_hat = jax.tree.map(lambda nu: nu / (1 - 0.99 ** state[0].count), state[0].nu)
    pre = jax.tree.map(lambda nu: 1 / (jnp.sqrt(nu) + 1e-8), nu_hat)
    gq = _per_example(loss, params, x[N:], t[N:])
    gz_tree = _per_example(loss, params, x[ids], t[ids])
    gz = _flat(gz_tree)
    expected[:, ids] += 0.05 * _flat(jax.tree.map(lambda p, q: p * q, pre, gq)) @ gz.T
    plain[:, ids] += 0.05 * _flat(gq) @ gz.T
    expected_own[ids] += 0.05 * np.sum(
        _flat(jax.tree.map(lambda p, g: p * g ** 2, pre, gz_tree)), axis=1)
    plain_own[ids] += 0.05 * np.sum(gz ** 2, axis=1)
  # Library computation, and comparison.
  scores = gl.tracin(tmp_path / "run", products="products")
  np.testing.assert_allclose(scores, expected, rtol=2e-4, atol=1e-6 * np.abs(expected).max())
  # Adam's scores are not SGD's products of the same gradients (up to a scale).
  assert np.abs(np.corrcoef(scores.ravel(), plain.ravel())[0, 1]) < 0.99
  own = gl.tracin_self_influence(tmp_path / "run", self_products="self")
  np.testing.assert_allclose(own, expected_own, rtol=2e-4)
  assert np.abs(np.corrcoef(own, plain_own)[0, 1]) < 0.99
  with pytest.raises(ValueError, match=r"tracin_self_influence\(self_products='products'\): "
                     r"each step's self-products must be \(B,\)"):
    gl.tracin_self_influence(tmp_path / "run", self_products="products")
  # The command line (and the report's page) show each query's examples by them.
  lines = _attribution_page.attribution_text(gl.open_run(tmp_path / "run")).splitlines()
  best = np.argsort(-scores[1], kind="stable")[0]
  assert lines[3].startswith(f"query 1: helpful {best} ({scores[1, best]:+.3g})")
  assert lines[0] == "no projected gradients 'train' logged: no spikes"
  best_own = int(np.argmax(expected_own))
  assert lines[1].startswith(f"highest TracIn self-influence: {best_own} ")
  index = gl.report(tmp_path / "run", progress=False)
  page = open(os.path.join(os.path.dirname(index), "attribution.html"),
              encoding="utf-8").read()
  assert "lr &lt;g, P g&gt; of each example's gradient" in page
  assert f"<tr><td>{best_own}</td><td>{own[best_own]:.4g}</td></tr>" in page
  with pytest.raises(ValueError, match=r"tracin\(products='lr'\): each step's products "
                     r"must be \(n_query, B\)"):
    gl.tracin(tmp_path / "run", products="lr")
  with pytest.raises(ValueError, match="adam_preconditioner: the optimiser state holds 0"):
    gl.adam_preconditioner(optax.sgd(0.1).init(params))


def test_per_example_products_are_those_of_vmap_grad_for_hand_marked_layers():
  def loss(p, x):
    h = jnp.tanh(gl.dense(x, p["w1"], p["b1"], name="fc1"))
    return jnp.mean(gl.dense(h, p["w2"], name="fc2") ** 2)

  params = {"w1": jax.random.normal(jax.random.PRNGKey(0), (3, 4)), "b1": jnp.ones(4),
            "w2": jax.random.normal(jax.random.PRNGKey(1), (4, 2))}
  direction = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size).reshape(p.shape)), params)
  x = jax.random.normal(jax.random.PRNGKey(2), (5, 3))
  per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x[:, None])
  expected = _flat(per_example) @ _flat(jax.tree.map(lambda d: d[None], direction))[0]

  @jax.jit  # The step hands the recorded weights through: found among params' leaves.
  def products(params, x, direction):
    return gl.per_example_products(gl.reap(jax.grad(loss))(params, x), direction,
                                   params=params)

  np.testing.assert_allclose(products(params, x, direction), expected, rtol=1e-5)
  where = {"w1": "fc1.w", "b1": "fc1.b", "w2": "fc2.w"}
  records = gl.reap(jax.grad(loss))(params, x)
  np.testing.assert_allclose(
      gl.per_example_products(records, direction, params=params, where=where), expected,
      rtol=1e-5)
  with pytest.raises(ValueError, match=r"per_example_products: the layer records \['fc1', "
                     r"'fc2'\] have a weight or bias that is not a leaf(.|\n)*or pass "
                     r"params=, the parameters the step took"):
    gl.per_example_products(records, direction)
  # Self-products: each example's gradient against itself, weighted by a positive
  # preconditioner (the direction squared), through the same leaves.
  pre = jax.tree.map(jnp.square, direction)
  expected_self = np.sum(_flat(jax.tree.map(lambda p, g: p * g ** 2, pre, per_example)),
                         axis=1)
  np.testing.assert_allclose(
      gl.per_example_self_products(records, pre, params=params, where=where),
      expected_self, rtol=1e-5)
  with pytest.raises(ValueError, match=r"per_example_self_products: the per-example "
                     r"gradients of 'fc2' are \(5, 4, 2\) \(batch first\) but its "
                     r"preconditioner is \(2,\)"):
    gl.per_example_self_products(records, {**pre, "w2": jnp.ones(2)}, params=params,
                                 where=where)


def test_per_example_self_products_of_a_layer_scanned_over_stacked_weights():
  def loss(p, x):
    def body(h, w):
      return jnp.tanh(gl.dense(h, w, name="fc")), None
    return jnp.mean(jax.lax.scan(body, x, p["w"])[0] ** 2)

  params = {"w": jnp.cos(jnp.arange(48.0)).reshape(3, 4, 4)}
  pre = {"w": jnp.arange(48.0).reshape(3, 4, 4) / 48}
  x = jnp.arange(8.0).reshape(2, 4) / 5
  per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x[:, None])
  expected = jnp.sum(pre["w"] * per_example["w"] ** 2, axis=(1, 2, 3))
  got = jax.jit(lambda p, x, pre: gl.per_example_self_products(
      gl.reap(jax.grad(loss))(p, x), pre, params=p, where={"w": "fc.w"}))(params, x, pre)
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_influence_from_a_run_is_fit_influence_with_the_same_projection(tmp_path):
  """An influence pass logged at fixed parameters (learning rate 0), in shuffled
  batches: the scores of gl.fit_influence(strategy="full", projection=...), from the
  log alone."""
  params, x, t, _, loss = _mlp()
  order = np.random.default_rng(1).permutation(N)
  batches = [order[i:i + B] for i in range(0, N, B)]
  projector = gl.fit_projector(loss, params, [(x[:B], t[:B])], k=2, seed=5)
  query = (x[N:], t[N:])
  _train(loss, params, (x, t), batches, projector, tmp_path / "run", lambda i: 0.0, query)
  expected = gl.fit_influence(
      loss, params, [(x[ids], t[ids]) for ids in batches], strategy="full",
      projection=projector).scores([query], [(x[:N], t[:N])])
  got = gl.influence_from_run(tmp_path / "run")
  np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-5 * np.abs(expected).max())
  # Given damping, and a subset of steps: the first two batches' examples only.
  part = gl.influence_from_run(tmp_path / "run", steps=slice(0, 2), damping=0.5,
                               num_examples=N)
  seen = np.concatenate(batches[:2])
  expected = gl.fit_influence(
      loss, params, [(x[ids], t[ids]) for ids in batches[:2]], strategy="full", damping=0.5,
      projection=projector).scores([query], [(x[seen], t[seen])])
  np.testing.assert_allclose(part[:, seen], expected, rtol=2e-4,
                             atol=1e-5 * np.abs(expected).max())
  assert np.all(np.delete(part, seen, axis=1) == 0)


def test_a_poisoned_batch_is_named_as_the_cause_of_the_loss_spike(tmp_path):
  """Linear regression on clean data, fitted by step 60, whose batch has 4 of its 8
  targets shifted. Its own loss jumps (a rise the update of step 59 does not explain),
  then step 61's, which step 60's update caused: its 4 poisoned examples pushed it up,
  the others not at all, and the contributions sum to the first-order rise from
  vmap(grad)."""
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (640, 5))
  true = jax.random.normal(jax.random.PRNGKey(1), (5, 3))
  y = x @ true
  poisoned = np.arange(480, 484)  # Step 60's batch is examples 480..487.
  y = y.at[poisoned].add(5.0)

  def loss(p, x, y):
    return jnp.mean(0.5 * jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))

  params = {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}
  projector = gl.fit_projector(loss, params, [(x[:8], y[:8])], k=8)  # Exact here.
  batches = [np.arange(i, i + 8) for i in range(0, 640, 8)]
  checkpoints = _train(loss, params, (x, y), batches, projector, tmp_path / "run",
                       lambda i: 0.2)
  spikes = {spike.step: spike for spike in gl.loss_spikes(tmp_path / "run", top=3)}
  assert {60, 61} <= set(spikes)  # (The third: the loss rising in the first steps.)
  own, caused = spikes[60], spikes[61]
  assert own.explained < 1e-3 * own.rise  # The batch's own loss: not step 59's update.
  # ...its own examples named: the 4 poisoned ones first, shares from their losses.
  assert set(own.own_ids[:4].tolist()) == set(poisoned.tolist())
  losses60 = jax.vmap(lambda x, y: loss(checkpoints[60], x[None], y[None]))(
      x[batches[60]], y[batches[60]])
  baseline = np.median(np.asarray(gl.open_run(tmp_path / "run")["loss"].values)[55:60])
  expected = dict(zip(batches[60].tolist(), (np.asarray(losses60) - baseline) / 8))
  np.testing.assert_allclose(own.own_shares, [expected[i] for i in own.own_ids.tolist()],
                             rtol=1e-5, atol=1e-6 * own.rise)
  np.testing.assert_allclose(own.own_shares.sum(), own.rise, rtol=1e-5)
  assert caused.cause == 60 and caused.explained > 0.3 * caused.rise
  assert set(caused.ids[:4].tolist()) == set(poisoned.tolist())
  assert np.all(caused.contributions[:4] > 0.1 * caused.rise)
  np.testing.assert_allclose(caused.contributions[4:], 0.0, atol=1e-3 * caused.rise)
  run = gl.open_run(tmp_path / "run")
  losses = run["loss"].values
  np.testing.assert_allclose(caused.rise, losses[61] - np.median(losses[56:61]), rtol=1e-6)
  g60 = _flat(_per_example(loss, checkpoints[60], x[batches[60]], y[batches[60]]))
  g61 = _flat(_per_example(loss, checkpoints[61], x[batches[61]], y[batches[61]]))
  estimate = -0.2 * g60.mean(axis=0) @ g61.mean(axis=0)
  np.testing.assert_allclose(caused.explained, estimate, rtol=1e-4)
  np.testing.assert_allclose(caused.contributions.sum(), estimate, rtol=1e-4)


def test_a_run_without_the_keys_is_a_clear_error(tmp_path):
  with gl.RunLog(tmp_path / "run") as log:
    for step in (0, 2):
      log.append(step, {"loss": jnp.float32(1.0 + step)})
  with pytest.raises(ValueError, match=r"tracin: the run has no projected gradients under "
                     r"'train' \(no variable train.grads....; its variables: \['loss'\]\)\. "
                     r"Log gl.projected_grads"):
    gl.tracin(tmp_path / "run")
  with pytest.raises(ValueError, match=r"loss_spikes: the run has no two consecutive "
                     r"steps with a logged loss \(steps \[0, 2\]"):
    gl.loss_spikes(tmp_path / "run")
  with pytest.raises(ValueError, match=r"loss_spikes\(top=0\): top is how many"):
    gl.loss_spikes(tmp_path / "run", top=0)


_KILLED_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, oryx_gradlog as gl
    sys.path.insert(0, sys.argv[2])
    from test_tracin import _killed_step
    step_fn = _killed_step()
    with gl.RunLog(sys.argv[1]) as log:
      step = 0
      while True:
        log.append(step, step_fn(step))
        if step % 3 == 2:
          print("flushed", log.flush(), flush=True)
        step += 1
""")


def _killed_step():
  """The logged quantities of step `step` of a fixed model (deterministic)."""
  loss = lambda p, x: jnp.mean(jnp.sum(jnp.tanh(x @ p["w"]) ** 2, axis=-1))
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (20, 20)) / 5}
  base = jax.random.normal(jax.random.PRNGKey(1), (4, 20))
  projector = gl.fit_projector(loss, params, [(base,)], k=3, seed=4)
  grads = jax.jit(lambda x: gl.projected_grads(
      gl.reap(jax.grad(gl.record_layers(loss)))(params, x), projector))
  return lambda step: {"train": grads(base * (1 + 0.1 * step)), "lr": jnp.float32(0.1),
                       "ids": jnp.arange(4) + 4 * step}


def test_a_killed_run_keeps_every_committed_steps_projections(tmp_path):
  process = subprocess.Popen(
      [sys.executable, "-c", _KILLED_SCRIPT, str(tmp_path / "run"), os.path.dirname(__file__)],
      stdout=subprocess.PIPE, text=True)
  for _ in range(3):
    line = process.stdout.readline()
    assert line.startswith("flushed"), line
    reported = int(line.split()[1])
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=60)
  run = gl.open_run(tmp_path / "run")
  committed = run.sizes["step"]
  assert committed >= reported >= 9
  step_fn = _killed_step()
  expected = np.concatenate([0.1 * np.sum(np.asarray(step_fn(s)["train"].flat()) ** 2, axis=1)
                             for s in range(committed)])
  np.testing.assert_allclose(gl.tracin_self_influence(run), expected, rtol=1e-5)


def test_the_report_and_the_cli_show_the_runs_attribution(tmp_path):
  pytest.importorskip("matplotlib")
  _mlp_run(tmp_path, k=8)
  run_dir = tmp_path / "run"
  index = gl.report(run_dir, progress=False)
  assert "href='attribution.html'" in open(index, encoding="utf-8").read()
  page = open(os.path.join(os.path.dirname(index), "attribution.html"), encoding="utf-8").read()
  own = gl.tracin_self_influence(run_dir)
  top = np.argsort(-own, kind="stable")[:3]
  assert "".join(f"<tr><td>{i}</td><td>{own[i]:.4g}</td></tr>" for i in top) in page
  spikes = gl.loss_spikes(run_dir, top=5)
  for spike in spikes:
    assert f"<tr><td>{spike.step}</td><td>{spike.rise:+.4g}</td><td>{spike.cause}</td>" in page
    named = ", ".join(f"{int(i)} ({v:+.3g})" for i, v in zip(spike.own_ids[:5],
                                                              spike.own_shares[:5]))
    assert f"<td>{named}</td></tr>" in page
  scores = gl.tracin(run_dir)
  best = np.argsort(-scores[0], kind="stable")[0]
  assert f"<tr><td>0</td><td>{best} ({scores[0, best]:+.3g})" in page
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "attribute", str(run_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0] == f"{run_dir}:"
  assert sum(line.startswith("step ") for line in lines) == len(spikes)
  assert any(line.startswith(f"highest TracIn self-influence: {top[0]} (") for line in lines)
  assert sum(line.startswith("query ") for line in lines) == Q
  with gl.RunLog(tmp_path / "plain") as log:
    log.append(0, {"loss": jnp.float32(1.0)})
  result = subprocess.run([sys.executable, "-m", "oryx_gradlog", "attribute",
                           str(tmp_path / "plain")],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2 and "logged no projected gradients" in result.stderr


def test_described_examples_are_shown_beside_their_ids(tmp_path):
  params, x, t, _, loss = _mlp()
  batches = [np.arange(i, i + B) for i in range(0, N, B)] * 2
  projector = gl.fit_projector(loss, params, [(x[:B], t[:B])], k=4, seed=2)
  labels = np.arange(N) % 3
  texts = [f"example number {i} " * 10 for i in range(N)]  # Cut to 80 characters.
  _train(loss, params, (x, t), batches, projector, tmp_path / "run", lambda i: 0.05,
         described={"label": labels, "text": texts})
  run = gl.open_run(tmp_path / "run")
  assert run.attrs["examples"] == {"label": labels.tolist(),
                                   "text": [text[:80] for text in texts]}
  own = gl.tracin_self_influence(run)
  top = int(np.argmax(own))
  from oryx_gradlog.storage import _attribution_page  # The CLI's text.
  text = _attribution_page.attribution_text(run)
  assert (f"highest TracIn self-influence: {top} [label {labels[top]}, text "
          f"{texts[top][:80]!r}] ({own[top]:+.3g})") in text
  # Images: drawn beside the ids on the report's attribution page.
  pytest.importorskip("matplotlib")
  images = np.arange(N * 8 * 8, dtype=np.float32).reshape(N, 8, 8) % 7
  with gl.RunLog(tmp_path / "run", resume=True) as log:
    log.describe_examples(label=labels, images=images)
  run = gl.open_run(tmp_path / "run")
  np.testing.assert_array_equal(np.load(run.attrs["examples_images"]), images)
  index = gl.report(tmp_path / "run", progress=False)
  page = open(os.path.join(os.path.dirname(index), "attribution.html"),
              encoding="utf-8").read()
  assert f"<tr><td><img alt='example {top}' src='data:image/png;base64," in page
  assert f"'>{top} [label {labels[top]}]</td><td>{own[top]:.4g}</td></tr>" in page
  with gl.RunLog(tmp_path / "bad") as log:
    with pytest.raises(ValueError, match=r"describe_examples: the columns have different "
                       r"lengths \{'label': 12, 'text': 3\}"):
      log.describe_examples(label=labels, text=texts[:3])
    with pytest.raises(ValueError, match=r"describe_examples\(images=...\): images are "
                       r"\(N, H, W\) or \(N, H, W, 3\) with H and W at most 64, got "
                       r"shape \(12, 100, 100\)"):
      log.describe_examples(images=np.zeros((N, 100, 100)))
    with pytest.raises(ValueError, match=r"describe_examples: label\[0\] is list"):
      log.describe_examples(label=[[1, 2]])
    log.append(0, {"loss": np.float32(1.0)})  # The log carries on.
  assert "examples" not in gl.open_run(tmp_path / "bad").attrs
