"""The public surface and the import-time version guard."""

import re

import pytest

import oryx_gradlog as gl
from oryx_gradlog import _compat


def test_all_is_the_documented_api():
  assert sorted(gl.__all__) == [
      "DEFAULT_TAG", "GradientNoise", "KFACFactors", "LayerInputs", "LayerParams", "Logged",
      "MovingAverage", "NoiseScale", "NonFiniteReport", "PerExampleNorms", "RunLog",
      "RunningStats", "StatisticsTransform", "Summary", "VJPRecord", "call_and_reap", "conv2d",
      "dense", "dense_dot_general", "embed", "export_tensorboard", "find_nonfinite",
      "gradient_noise_scale", "gradient_variance", "kfac_factors", "magnitude_bins",
      "moving_average", "open_run", "per_example_norms", "raise_if_nonfinite", "reap",
      "record_vjp", "report", "running_statistics", "sum_grad_squared", "summarize", "tap"]
  assert gl.DEFAULT_TAG == "vjp"


def test_supported_versions_pass():
  _compat.check_versions()  # The installed ones.
  _compat.check_versions(installed={"jax": "0.4.38", "jaxlib": "0.4.38", "oryx": "0.2.9"}.get)


@pytest.mark.parametrize("versions", [
    {"jax": "0.5.3", "jaxlib": "0.5.3", "oryx": "0.2.9"},
    {"jax": "0.5.1", "jaxlib": "0.5.1", "oryx": "0.2.9"},
    {"jax": "0.5.0", "jaxlib": "0.5.0", "oryx": None},
])
def test_unsupported_versions_raise_import_error_with_the_fix(versions):
  with pytest.raises(ImportError) as info:
    _compat.check_versions(installed=versions.get)
  message = str(info.value)
  assert "works with 0.4.38, 0.5.0" in message or "oryx is not installed" in message
  assert re.search(r'pip install "jax==0.5.0" "jaxlib==0.5.0" "oryx==0.2.9"', message)


@pytest.mark.parametrize("name", ["", None, 3, "a#gradlog:b"])
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


def test_importing_under_an_unsupported_jax_raises_before_oryx_is_touched():
  import subprocess
  import sys

  code = (
      "import importlib.metadata as m\n"
      "real = m.version\n"
      "m.version = lambda p: '0.6.0' if p in ('jax', 'jaxlib') else real(p)\n"
      "import oryx_gradlog\n"
  )
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode != 0
  assert "ImportError: oryx_gradlog needs versions of JAX and Oryx that work together" in (
      result.stderr)
  assert "jax is version 0.6.0 (works with 0.4.38, 0.5.0)" in result.stderr
