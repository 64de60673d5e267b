"""Smoke test of `benchmarks/`: a workload runs in-process at tiny sizes.

Benchmarks print ratios and never assert on time (STYLE.md); this only checks that
the recorded and plain variants compute the same gradients, that the harness
returns positive timings and memory figures, and that the logging workloads (4, 5, 8)
run and check their values.
"""

import importlib
import pathlib

import jax
import numpy as np
import optax
import pytest
from conftest import assert_trees_close

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmarks(monkeypatch):
  """Makes the benchmark scripts importable; returns an importer."""
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  return importlib.import_module


def _tiny(benchmarks):
  harness, mlp = benchmarks("_harness"), benchmarks("_mlp")
  sizes = mlp.Sizes(layers=2, width=16, batch=4)
  settings = harness.Settings(
      quick=True, max_rounds=3, min_rounds=3, budget_s=0.0, min_block_s=0.0,
      compile_rounds=1)
  return sizes, settings


def test_recorded_and_plain_variants_return_equal_gradients(benchmarks):
  # Setup: the tiny variants of workload 1.
  full_records = benchmarks("bench_full_records")
  sizes, _ = _tiny(benchmarks)
  variants = full_records.variants(sizes)
  # True computation: the plain gradient.
  expected = variants["plain"]()
  # Library computation, and comparison.
  for key in ("record_vjp", "tap", "record_inputs"):
    grads, records = variants[key]()
    assert_trees_close(grads, expected)
    assert records, key
  full_records.check(variants, sizes)  # What the benchmark checks before timing.


def test_quick_workload_returns_positive_timings(benchmarks):
  full_records = benchmarks("bench_full_records")
  sizes, settings = _tiny(benchmarks)
  with jax.default_device(jax.devices("cpu")[0]):
    result = full_records.run(settings, sizes)
  assert result.number == 1
  for measurement in result.measurements.values():
    assert len(measurement.seconds) == 3
    assert all(s > 0 for s in measurement.seconds), measurement.label
    assert measurement.memory["output"] > 0 and measurement.memory["peak"] > 0
    assert measurement.hlo["dots"] > 0
  for comparison in result.comparisons:
    assert comparison.value > 0, comparison.what
    assert comparison.status in ("met", "MISSED", "info")


@pytest.mark.parametrize("module", ["bench_summaries", "bench_running_stats",
                                    "bench_disk_stream", "bench_dp", "bench_train_size",
                                    pytest.param("bench_instruments", marks=pytest.mark.slow),
                                    pytest.param("bench_any_model", marks=pytest.mark.slow),
                                    pytest.param("bench_architectures",
                                                 marks=pytest.mark.slow)])
def test_logging_workloads_run_and_check_their_values(benchmarks, module):
  sizes, settings = _tiny(benchmarks)
  result = benchmarks(module).run(settings, sizes)  # Each checks its values first.
  assert result.comparisons and all(c.value > 0 for c in result.comparisons)


def test_results_of_two_jax_versions_are_put_side_by_side(benchmarks, tmp_path):
  run = benchmarks("run")
  for version, value in (("0.10.2", 1.2), ("0.5.0-w4", 1.3), ("0.5.0", 1.1)):
    (tmp_path / f"cpu-jax-{version}.json").write_text(__import__("json").dumps({
        "file": f"cpu-jax-{version}.md", "machine": {"date": "d", "versions": version},
        "comparisons": [{"workload": 4, "what": "summaries", "baseline": "plain grad",
                         "value": value, "low": 1.0, "high": 1.3, "target": "<= 1.05",
                         "status": "MISSED"}]}))
  paths = sorted(tmp_path.glob("*.json"), key=run._run_order)
  assert [p.stem for p in paths] == ["cpu-jax-0.5.0", "cpu-jax-0.5.0-w4", "cpu-jax-0.10.2"]
  table = run.side_by_side(paths)
  assert ("| 4 | summaries | plain grad | <= 1.05 | 1.100x MISSED | 1.300x MISSED | "
          "1.200x MISSED |") in table
  # Rewriting RESULTS.md keeps the hand-written sections below the table.
  results = tmp_path / "RESULTS.md"
  results.write_text("# old table\n\n## One-off measurement\n\nby hand\n")
  run.rewrite_results(results, paths)
  assert results.read_text() == table.rstrip("\n") + "\n\n## One-off measurement\n\nby hand\n"


def test_profile_ops_reads_the_ops_of_a_step_from_the_profiler(benchmarks):
  if not hasattr(jax.profiler, "ProfileData"):
    pytest.skip("jax.profiler.ProfileData is newer than this JAX (0.10.2 has it)")
  profile_ops = benchmarks("profile_ops")
  step = jax.jit(lambda a: jax.numpy.tanh(a @ a).sum())
  ops, categories = profile_ops.profile(step, (jax.numpy.ones((64, 64)),), calls=2)
  assert ops and all(ms >= 0 for ms, _ in ops.values())
  # Every op's time is in its category, once.
  assert sum(categories.values()) == pytest.approx(sum(ms for ms, _ in ops.values()))
  assert set(categories) == {category for _, category in ops.values()}


def test_records_cost_norms_one_group_of_records(benchmarks):
  # Setup: a one-block decoder and the embedding's group.
  any_model, records_cost = benchmarks("bench_any_model"), benchmarks("records_cost")
  d = any_model.Decoder(depth=1, width=16, heads=2, vocab=32, seq=8, batch=4)
  loss, args = any_model.model(d)
  # True computation: vmap(grad), the embedding table's per-example gradients.
  per_example, _ = any_model.per_example_grads(loss, d.batch, *args)
  leaves = jax.tree_util.tree_flatten_with_path(per_example)[0]
  table, = [g for path, g in leaves if "embed" in jax.tree_util.keystr(path)]
  expected = jax.numpy.sqrt(jax.numpy.sum(table.reshape(d.batch, -1) ** 2, axis=1))
  grads, norms = jax.jit(records_cost.norms_of(loss, records_cost.GROUPS["embed"]))(*args)
  assert_trees_close(grads, jax.grad(loss)(*args))
  assert_trees_close(norms, expected, rtol=1e-4)
  # The count of standalone float32 score fusions reads the HLO's top level only.
  hlo = ("  %fusion.1 = f32[4,2,8,8]{3,2,1,0} fusion(%a), kind=kOutput\n"
         "  %fusion.2 = (f32[4,2,8], f32[4,2,8,8]{3,2,1,0}) fusion(%b)\n")
  assert records_cost.score_fusions(hlo, d) == 1


def test_tpu_compile_reads_the_program_a_tpu_v5e_would_run(benchmarks):
  # Without libtpu (CI, the test environments) there is nothing to compile for.
  pytest.importorskip("libtpu", reason="tpu_compile.py needs libtpu in an environment "
                      "of its own (its docstring)")
  tpu_compile = benchmarks("tpu_compile")
  # Setup: workload 12's first quick regime, plain grad and the clipped gradient.
  rows = tpu_compile.main(["--workload", "12", "--quick", "--seq", "16",
                           "--variants", "plain,clipped", "--clip-methods", "gram"])
  # Expected: compiled for a v5e (at these sizes the temporaries fit in the chip's
  # on-core memory: 0 bytes), and the norms' Gram products beside the plain step's.
  assert [row["variant"] for row in rows] == ["plain", "clipped", "clipped_gram"]
  assert {row["device"] for row in rows} == {"TPU v5 lite"}
  assert all(row["products"] > rows[0]["products"] for row in rows[1:])


def test_counterfactual_retraining_leaves_out_only_the_removed_sequences(benchmarks):
  # Setup: a bigram model of 12 sequences of 5 tokens; 3 steps of batches of 4.
  counterfactual = benchmarks("counterfactual")
  jnp = jax.numpy

  def loss(p, inputs, targets, per_sequence=False):
    logits = p["embed"][inputs] @ p["out"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
    return losses if per_sequence else losses.mean()

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"embed": jax.random.normal(keys[0], (7, 4)),
            "out": jax.random.normal(keys[1], (4, 7))}
  windows = jax.random.randint(keys[2], (12, 6), 0, 7)
  batches = counterfactual.draws(12, 3, 4)
  removed = batches[1][:2]  # Two sequences of the second batch.
  weights = jnp.ones((2, 12)).at[0, removed].set(0.0)
  optimizer = optax.adam(0.1)
  # True computation: plain Adam on the mean loss of each batch's kept rows.
  expected, state = params, optimizer.init(params)
  for rows in batches:
    kept = [r for r in rows if r not in removed]
    grads = jax.grad(loss)(expected, windows[kept, :-1], windows[kept, 1:])
    updates, state = optimizer.update(grads, state)
    expected = optax.apply_updates(expected, updates)
  # Library computation: the two models at once, from the same start.
  models, _ = counterfactual.masked_training(loss, optimizer, params,
                                             optimizer.init(params), windows,
                                             np.asarray(weights), batches)
  # Expected: the first model is plain training without the removed sequences; the
  # second, with every weight 1, is not.
  assert_trees_close(jax.tree.map(lambda v: v[0], models), expected, rtol=1e-5)
  assert not np.allclose(models["out"][1], expected["out"], rtol=1e-3)
