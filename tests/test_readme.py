"""The README's Python blocks run as written, in order, as a reader pastes them into
one session (in a fresh folder: they write `runs/exp1`). Each block's own results
are checked against plain JAX where the block computes something a reader relies on."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
  assert len(BLOCKS) >= 7


@pytest.mark.slow
@pytest.mark.newcomer
def test_every_readme_block_runs_as_written(tmp_path, monkeypatch, capsys):
  pytest.importorskip("flax")
  monkeypatch.chdir(tmp_path)
  namespace: dict = {"__name__": "readme"}
  for i, block in enumerate(BLOCKS):
    try:
      exec(compile(block, f"README.md block {i + 1}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as error:  # pragma: no cover  (the failure names the block)
      raise AssertionError(f"README.md block {i + 1} failed:\n{block}") from error
  capsys.readouterr()
  # Block 3's logged losses: plain SGD on the same loss (the records are identities).
  mvm_loss = lambda w, x, t: jnp.sum((jnp.tanh(x @ w) @ w - t) ** 2)
  w, x, t = 0.5 * jnp.eye(3), jnp.ones((4, 3)), jnp.zeros((4, 3))
  expected = []
  for _ in range(20):
    value, grads = jax.value_and_grad(mvm_loss)(w, x, t)
    expected.append(float(value))
    w = w - 0.01 * grads
  run = namespace["gl"].open_run(tmp_path / "runs" / "exp1")
  np.testing.assert_allclose(run["loss"].values, expected, rtol=1e-5)
  assert (tmp_path / "runs" / "exp1" / "report" / "index.html").exists()
  # Block 4's readings: its last step (29) is not a read step (every=10): NaN.
  assert {"loss", "grad_norm", "alpha"} <= set(namespace["readings"])
  assert np.isnan(float(namespace["readings"]["grad_norm"]))
  # The NNX block (dropout, batch norm, GRU): with a clip no example reaches, the
  # clipped gradient is the loss's own gradient, dropout key and carry included.
  tag_loss = namespace["tag_loss"]
  args = [namespace[n] for n in ("tagger_params", "words", "tags", "carry", "key")]
  unclipped = namespace["gl"].clipped_grad(
      tag_loss, l2_norm_clip=1e9, batch_argnums=(1, 2, 3))(*args)
  for got, want in zip(jax.tree.leaves(unclipped), jax.tree.leaves(jax.grad(tag_loss)(*args))):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  assert namespace["tag_norms"].shape == (16,) and np.all(np.isfinite(namespace["tag_norms"]))
  # The run's attribution block: the logged steps' TracIn and spikes.
  tracin_scores = namespace["tracin_scores"]
  assert tracin_scores.shape == (4, 32) and np.all(np.isfinite(tracin_scores))
  run = namespace["gl"].open_run(tmp_path / "runs" / "attribution")
  assert run["ids"].values.tolist() == [list(range(16 * (s % 2), 16 * (s % 2) + 16))
                                        for s in range(6)]
  assert all(spike.cause == spike.step - 1 for spike in namespace["spikes"])
  # Each step's per-example losses, whose mean is its loss, name a spike's own examples.
  np.testing.assert_allclose(run["losses"].values.mean(axis=1), run["loss"].values, rtol=1e-5)
  for spike in namespace["spikes"]:
    assert sorted(spike.own_ids.tolist()) == run["ids"].values[spike.step].tolist()
  assert run.attrs["examples"]["text"][5] == str(np.asarray(namespace["ids"])[5, :4].tolist())
  scores = namespace["scores"]
  assert scores.shape == (4, 32) and np.all(np.isfinite(scores))
  # The Adam run logged each query's products with each step's batch.
  adam_run = namespace["gl"].open_run(tmp_path / "runs" / "attribution-adam")
  assert adam_run["products"].shape == (6, 4, 16)
  assert namespace["adam_scores"].shape == (4, 32)
  assert np.all(np.isfinite(namespace["adam_scores"]))
  # Block 6's norms against vmap(grad) of the block-5 loss.
  loss, params = namespace["loss"], namespace["params"]
  ids, targets = namespace["ids"], namespace["targets"]
  per_example = jax.vmap(jax.grad(lambda p, i, t: loss(p, i[None], t[None])),
                         in_axes=(None, 0, 0))(params, ids, targets)
  squares = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
                for g in jax.tree.leaves(per_example))
  np.testing.assert_allclose(namespace["norms"].norms, np.sqrt(squares), rtol=1e-4)
