"""The public surface and the import-time version guard."""


import pytest

import oryx_gradlog as gl
from oryx_gradlog.record import _compat


def test_all_is_the_documented_api():
  assert sorted(gl.__all__) == sorted([
      "ClippedGrads", "DEFAULT_TAG", "DPNoiseState", "GradientNoise",
      "KFACFactors", "LayerInputs", "LayerParams", "Logged", "MovingAverage", "NoiseScale",
      "NonFiniteReport", "PerExampleNorms", "PoissonBatch", "RunLog", "RunningStats",
      "Summary", "VJPRecord", "add_dp_noise", "call_and_reap",
      "per_example_clip", "conv2d", "dense", "dense_dot_general", "dp_epsilon", "dp_noise",
      "dp_noise_multiplier", "embed", "export_tensorboard", "find_nonfinite",
      "gradient_noise_scale", "gradient_variance", "kfac_factors", "layer_norm",
      "magnitude_bins", "moving_average", "open_run", "per_example_norms", "poisson_batch",
      "raise_if_nonfinite", "reap", "record_vjp", "report", "running_statistics",
      "sum_grad_squared", "summarize", "tap", "to_param_tree",
      # Training instruments (issue 13).
      "BatchSizeTests", "GradientSNR", "InstrumentsState",
      "batch_size_tests", "gradient_snr", "hessian_max_eigenvalue", "hessian_trace",
      "step_alpha", "training_instruments", "update_size",
      # Cockpit's instruments, all of them (issue 19).
      "GradientHistograms", "Schedule", "gradient_histograms", "hessian_diagonal",
      "linear_schedule", "logarithmic_schedule",
      # Any model, unchanged (issue 17).
      "LayerCoverage", "LayerUse", "ParamCoverage", "UseCoverage", "clipped_grad",
      "layer_coverage", "record_layers",
      # Training-data attribution (issue 25).
      "Influence", "InfluenceFactors", "fit_influence", "lds",
      # From the training run itself (issue 26).
      "ProjectedGrads", "Projector", "fit_projector", "projected_grads", "LossSpike",
      "loss_spikes", "tracin", "tracin_self_influence", "influence_from_run",
      # TracIn for Adam (issue 51).
      "adam_preconditioner", "per_example_products", "per_example_self_products",
      # One init/update type (issue 24).
      "Transform"])
  assert gl.DEFAULT_TAG == "vjp"
  assert list(gl.__all__) == sorted(gl.__all__)


def test_renamed_names_say_what_to_write():
  with pytest.raises(AttributeError, match=r"clipped_grads was renamed: use "
                     r"gl\.per_example_clip"):
    gl.clipped_grads  # pylint: disable=pointless-statement
  for old in ("DPNoiseTransform", "InstrumentsTransform", "StatisticsTransform"):
    with pytest.raises(AttributeError, match=rf"{old} was renamed: use gl\.Transform"):
      getattr(gl, old)
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    gl.no_such_name  # pylint: disable=pointless-statement
  norms = gl.PerExampleNorms({}, None)
  with pytest.raises(AttributeError, match=r"renamed PerExampleNorms\.norms"):
    norms.total  # pylint: disable=pointless-statement


def test_the_installed_jax_and_oryx_pass_the_probe():
  _compat.check_supported()


def test_a_failing_probe_is_an_import_error_with_the_install_lines():
  def probe():
    raise AttributeError("module 'jax._src.pjit' has no attribute 'pjit_p'")

  installed = {"jax": "0.10.2", "jaxlib": "0.10.2", "oryx": "0.2.9",
               "tensorflow-probability": "0.25.0"}.get
  with pytest.raises(ImportError) as info:
    _compat.check_supported(probe=probe, installed=installed)
  message = str(info.value)
  assert "jax 0.10.2, jaxlib 0.10.2, oryx 0.2.9, tensorflow-probability 0.25.0" in message
  assert "AttributeError: module 'jax._src.pjit' has no attribute 'pjit_p'" in message
  # The set for the user's JAX comes first, with both of its install lines.
  first = message.split("Install the set for your JAX")[1].splitlines()[1:3]
  assert first[0].strip().startswith("JAX 0.10.2 with Oryx main @9b9ef13")
  assert ('pip install --no-deps "oryx @ git+https://github.com/jax-ml/oryx@9b9ef13"'
          in first[1])
  assert 'pip install "jax==0.5.0" "jaxlib==0.5.0" "oryx==0.2.9"' in message
  assert "Without GitHub, build Oryx main's wheel from a copied clone" in message


def test_both_tensorflow_probability_packages_are_named_in_the_error():
  installed = {"jax": "0.5.0", "tensorflow-probability": "0.25.0",
               "tfp-nightly": "0.26.0.dev20261027"}.get
  with pytest.raises(ImportError, match=r"tensorflow-probability and tfp-nightly both "
                     r"install the module `tensorflow_probability`: uninstall both"):
    _compat.check_supported(probe=lambda: 1 / 0, installed=installed)


def test_a_missing_module_below_oryx_is_named_with_its_pip_line():
  def probe():
    try:
      raise ModuleNotFoundError("No module named 'tf_keras'", name="tf_keras")
    except ModuleNotFoundError as error:  # As tfp re-raises it, inside Oryx's import.
      raise ImportError("Oryx failed to import") from error

  with pytest.raises(ImportError) as info:
    _compat.check_supported(probe=probe)
  message = str(info.value)
  assert "the module `tf_keras`, which one of its dependencies imports, is missing" in message
  assert "import oryx_gradlog before TensorFlow" in message
  assert message.endswith("pip install tf-keras")
  assert "work together" not in message  # Not a JAX/Oryx mismatch.
  def raising(error):
    def probe():
      raise error
    return probe

  with pytest.raises(ImportError, match=r"the module `einops\.layers`.*pip install einops$"):
    _compat.check_supported(probe=raising(ModuleNotFoundError("x", name="einops.layers")))
  # A missing Oryx itself is a set to install.
  with pytest.raises(ImportError, match="work together"):
    _compat.check_supported(probe=raising(ModuleNotFoundError("x", name="oryx.core")))


@pytest.mark.parametrize("name", ["", None, 3, "a#gradlog:b", "a#gradlog&b"])
def test_bad_names_are_rejected_with_the_api_named(name):
  with pytest.raises(ValueError, match=r"record_vjp\(name=.*a record name must be"):
    gl.record_vjp(lambda x: x, name=name)
  with pytest.raises(ValueError, match=r"tap\(name=.*a record name must be"):
    gl.tap(1.0, name=name)


def test_record_vjp_decorator_and_direct_forms_agree():
  import jax
  import jax.numpy as jnp

  @gl.record_vjp(name="f")
  def decorated(x):
    return jnp.sin(x)

  direct = gl.record_vjp(jnp.sin, name="f")
  x = jnp.arange(3.0)
  a = gl.reap(jax.grad(lambda x: decorated(x).sum()))(x)
  b = gl.reap(jax.grad(lambda x: direct(x).sum()))(x)
  assert decorated.__name__ == "decorated"
  assert jnp.allclose(a["f"][0], b["f"][0]) and jnp.allclose(a["f"][0], jnp.cos(x))


def test_importing_where_oryx_cannot_be_imported_raises_the_install_lines(tmp_path):
  import subprocess
  import sys

  # A stand-in for an Oryx release that breaks on this JAX at import.
  (tmp_path / "oryx").mkdir()
  (tmp_path / "oryx" / "__init__.py").write_text(
      "raise AttributeError(\"module 'jax' has no attribute 'util'\")\n")
  # The import itself takes no JAX; the first public name loads it, and fails.
  code = ("import sys, oryx_gradlog; assert 'jax' not in sys.modules and 'oryx' not in "
          "sys.modules, sorted(sys.modules); print('imported'); oryx_gradlog.reap")
  result = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
  assert result.returncode != 0 and result.stdout == "imported\n", result.stderr
  assert "ImportError: oryx_gradlog needs JAX and Oryx releases that work together" in (
      result.stderr)
  assert "AttributeError: module 'jax' has no attribute 'util'" in result.stderr
  assert "pip install" in result.stderr


def test_signatures_are_readable_in_help():
  import inspect  # pylint: disable=import-outside-toplevel
  for api in (gl.RunLog, gl.summarize, gl.running_statistics):
    signature = str(inspect.signature(api))
    assert "bins=magnitude_bins()" in signature and len(signature) < 400, signature
  np = pytest.importorskip("numpy")
  np.testing.assert_array_equal(np.asarray(gl.statistics._summaries.DEFAULT_BINS),  # pylint: disable=protected-access
                                gl.magnitude_bins())
