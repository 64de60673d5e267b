"""Canaries: one test per Oryx 0.2.9 behaviour that oryx_gradlog relies on or works around.

If an Oryx or JAX upgrade changes one of these, the test fails by name, before a user
sees a wrong record.
"""

import inspect
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from oryx.core import reap, sow
from oryx.core.interpreters import harvest


def _recipe(f, name, mode="strict"):
  """The seed's Oryx recipe: sow the input cotangents in a custom_vjp backward rule."""
  @jax.custom_vjp
  def custom_f(*args):
    return f(*args)

  def fwd(*args):
    return f(*args), args

  def bwd(res, dy):
    return sow(jax.vjp(f, *res)[1](dy), tag="vjp", name=name, mode=mode)

  custom_f.defvjp(fwd, bwd)
  return custom_f


def test_reap_collects_sows_from_a_backward_rule():
  square = _recipe(lambda x: x ** 2.0, "square_vjp")
  records = reap(jax.grad(lambda x: square(jnp.sin(x))), tag="vjp")(3.0)
  assert list(records) == ["square_vjp"]
  assert jnp.allclose(records["square_vjp"][0], 0.28224, rtol=1e-4)


def test_strict_sows_of_one_name_at_top_level_raise():
  # Why every record site sows under a name unique to its call.
  f = lambda x: sow(x, tag="t", name="a") + sow(2 * x, tag="t", name="a")
  with pytest.raises(ValueError, match="Variable has already been reaped: a"):
    reap(f, tag="t")(1.0)


def test_append_mode_stacks_scan_iterations_in_order():
  f = lambda xs: lax.scan(lambda c, x: (c, sow(x * 2, tag="t", name="a", mode="append")),
                          0.0, xs)
  assert jnp.array_equal(reap(f, tag="t")(jnp.arange(3.0))["a"], jnp.array([0.0, 2.0, 4.0]))


def _run_with_oryx_rules(code):
  """Runs `code` in a fresh process with Oryx's own scan and cond rules restored.

  A fresh process, because a failure inside Oryx's rules can leave JAX caches that
  break later traces in the same process.
  """
  prelude = textwrap.dedent("""
      import jax, jax.numpy as jnp
      from jax import lax
      from oryx.core import reap, sow
      from oryx.core.interpreters import harvest
      from oryx_gradlog.record import _oryx_rules
      from oryx_gradlog.record._internals import cond_p, scan_p
      harvest.reap_custom_rules[scan_p] = _oryx_rules._oryx_scan_rule
      harvest.reap_custom_rules[cond_p] = _oryx_rules._oryx_cond_rule
  """)
  return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=120, check=False)


def test_oryx_scan_rule_with_argnums_fails_loudly_or_is_right():
  # Oryx 0.2.9's scan rule misaligns `linear`: "safe_zip() argument 2 is shorter ...".
  # Oryx main @aa33090 and @9b9ef13 give the right records. Either way never a wrong
  # record; when every supported Oryx passes, _oryx_rules' scan rule can go.
  result = _run_with_oryx_rules("""
      @jax.custom_vjp
      def mvm(x, w):
        return jnp.tanh(x @ w)
      def bwd(res, g):
        return sow(jax.vjp(lambda x, w: jnp.tanh(x @ w), *res)[1](g), tag="vjp",
                   name="mvm", mode="append")
      mvm.defvjp(lambda x, w: (mvm(x, w), (x, w)), bwd)
      loss = lambda ws, x: jnp.sum(lax.scan(lambda c, w: (mvm(c, w), None), x, ws)[0])
      records = reap(jax.grad(loss, argnums=1), tag="vjp")(jnp.ones((3, 2, 2)), jnp.ones(2))
      assert records["mvm"][1].shape == (3, 2, 2), records
  """)
  assert result.returncode == 0 or (
      "safe_zip() argument 2 is shorter than argument 1" in result.stderr), result.stderr


def test_oryx_cond_rule_still_rejects_sows_in_one_branch():
  result = _run_with_oryx_rules("""
      f = lambda x: lax.cond(x > 0, lambda x: sow(x, tag="t", name="a", mode="append"),
                             lambda x: x, x)
      reap(f, tag="t")(1.0)
  """)
  assert result.returncode != 0
  assert "Mismatching number of `sow`s between branches" in result.stderr


def test_while_loop_rule_rejects_append_sows():
  # oryx_gradlog rewords this error for record sites.
  result = _run_with_oryx_rules("""
      f = lambda n: lax.fori_loop(0, n, lambda i, c: sow(c + 1.0, tag="t", name="a",
                                                          mode="append"), 0.0)
      jax.jit(reap(f, tag="t"))(3)
  """)
  assert "Must use clobber or cond_clobber mode for 'a'" in result.stderr


def test_harvest_internals_we_build_on_exist():
  assert set(inspect.signature(harvest.HarvestSettings).parameters) == {
      "tag", "blocklist", "allowlist", "exclusive"}
  assert {"settings", "reaps"} <= set(inspect.signature(harvest.ReapContext).parameters)
  assert callable(harvest.harvest_trace) and callable(harvest._sow)
  assert callable(harvest._get_harvest_metadata)
  assert inspect.signature(harvest.ReapContext.handle_sow).parameters.keys() >= {
      "name", "tag", "tree", "mode"}
