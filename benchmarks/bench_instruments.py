"""Workload 10: training instruments in the step vs a plain training step.

Side by side, on the 4 x 512 tanh MLP with biases, batch 128 (`_mlp.FULL`), float32:

* `plain`: a plain SGD training step, `jax.value_and_grad` of the unmarked loss and
  the update: the floor.
* `economy`: the same step on the marked model (`gl.dense`) with
  `gl.training_instruments("economy")` (Cockpit's economy: loss, gradient norm, the
  norm, inner-product and orthogonality tests, alpha's weighted fit, update size,
  distance and the 1-D histogram of per-example gradient elements) read every step.
* `plain_10`, `economy_10`, `every_10`: ten training steps in one `lax.scan`, plain,
  with the economy preset read every step, and read every 10th step
  (`training_instruments("economy", every=10)`, Cockpit's `track_interval`). The
  state carries from step to step, so the schedule is real (a variant called
  repeatedly with the same state would read on every call). Target for `every_10`:
  <= 1.10 x `plain_10`.
* `plain_10u`, `static_10`: the same ten steps unrolled in one jit, plain and with
  `every=10` read through static phases (`update(..., phase=instruments.phase(i))`,
  what a Python training loop compiles: no `lax.cond`). Target <= 1.10 x `plain_10u`.
* `plain_loop`, `every_loop`: what users run, ten calls of a jitted step from a
  Python loop (carrying on from call to call, so the schedule is real), plain and
  with `every=10` through static phases, both with the parameters and the
  instruments' state donated (`donate_argnums`); target `every_loop` <= 1.10 x
  `plain_loop`. `plain_loop_nd`, `every_loop_nd`: the same without donation.
* `plain_loop_ce`, `every_loop_ce`: the same donated loops with a 10-class
  cross-entropy on the first ten outputs (random labels) instead of the regression
  loss, so that the per-example gradient elements fill the 1-D histogram's bins
  (with the regression loss's small gradients nearly every element is within a bin
  of zero and counted by its sign); on a TPU the target is `every_loop_ce` <= 1.5 x
  `plain_loop_ce`.
* `alpha`, `hist_1d`, `hist_2d`, `moments`, `tic`: one new instrument read in the
  step, every step: alpha's weighted fit (per-example losses and two jvps per layer
  for the per-example slopes), the 1-D and 2-D gradient histograms (per-example
  gradients formed layer by layer), mean_gsnr + early_stopping + cabs (second
  moments `(x^2)^T (g^2)`), and tic_diag + tic_trace + hessian_trace
  (`NUM_PRODUCTS` products and the second moments): each one's cost per reading.
* `hvp`: one Hessian-vector product (`jax.jvp` of `jax.grad`) of the plain loss.
* `trace` / `max_eig`: one use of `gl.hessian_trace` / `gl.hessian_max_eigenvalue`
  with `NUM_PRODUCTS` products: each curvature instrument's cost per use, in plain
  steps (the ratio) and in products (the ratio over one `hvp`'s).

Before timing, the economy step's norm test is checked against per-example
gradients from `vmap(grad)`, and the curvature instruments against their product
count (`trace` on a diagonal quadratic is exact).

Run: python benchmarks/bench_instruments.py [--quick]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import _harness as h
import _mlp
import oryx_gradlog as gl

NUMBER = 10
TITLE = "Training instruments: economy preset in the step vs a plain step; curvature per use"
TARGET = h.Target(1.10)
TPU_FILLED_TARGET = h.Target(1.5)  # Economy every 10th, bins filled (issue 50).
CLASSES = 10
NUM_PRODUCTS = 20
LR = 0.01
EVERY = 10


def _losses(dense, params, x, target):
  for i, layer in enumerate(params):
    x = jnp.tanh(dense(x, layer["w"], layer["b"], name=f"fc{i:02d}"))
  if target.ndim == 1:  # Class labels: cross-entropy of the first CLASSES outputs.
    logits = 4.0 * x[:, :CLASSES]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), target[:, None], 1)[:, 0]
  return jnp.mean((x - target) ** 2, axis=-1)


def _loss(dense, params, x, target):
  return jnp.mean(_losses(dense, params, x, target))


def _plain_dense(x, w, b, name):
  del name
  return x @ w + b


def plain_loss(params, x, target):
  return _loss(_plain_dense, params, x, target)


def marked_loss(params, x, target):
  losses = _losses(gl.dense, params, x, target)
  return jnp.mean(losses), losses


def steps(instruments):
  def plain(params, x, target):
    loss, grads = jax.value_and_grad(plain_loss)(params, x, target)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

  def economy(params, state, x, target, phase=None):
    ((loss, losses), grads), records = gl.call_and_reap(
        jax.value_and_grad(marked_loss, has_aux=True))(params, x, target)
    updates = jax.tree.map(lambda g: -LR * g, grads)
    readings, state = instruments.update(
        records, state, loss=loss, grads=grads, params=params, updates=updates,
        losses=losses, learning_rate=LR, phase=phase,
        hessian_loss=lambda p: plain_loss(p, x, target))
    return jax.tree.map(jnp.add, params, updates), state, readings

  def hvp(params, v, x, target):
    return gl.analyses.curvature._hessian.hessian_vector_product(plain_loss, params, x, target)(v)  # pylint: disable=protected-access

  def trace(params, key, x, target):
    return gl.hessian_trace(plain_loss, params, x, target, key=key,
                            num_products=NUM_PRODUCTS)

  def max_eig(params, key, x, target):
    return gl.hessian_max_eigenvalue(plain_loss, params, x, target, key=key,
                                     num_products=NUM_PRODUCTS)

  return plain, economy, hvp, trace, max_eig


class _Loop:
  """Ten calls of a jitted step from a Python loop, carrying on from call to call
  (the user's form); `lower` lowers one read step, for the harness's HLO statistics."""

  def __init__(self, step, carry, x, target, phase=None):
    self.step, self.carry, self.x, self.target, self.phase = step, carry, x, target, phase
    self.t = 0
    self.first = (*carry, x, target) + (({"phase": phase(0)},) if phase else ())

  def __call__(self):
    out = None
    for _ in range(EVERY):
      if self.phase is None:
        params, out = self.step(self.carry[0], self.x, self.target)
        self.carry = (params,)
      else:
        params, state, out = self.step(*self.carry, self.x, self.target,
                                       phase=self.phase(self.t))
        self.carry = (params, state)
      self.t += 1
    return self.carry[0], out

  def lower(self):
    *args, kwargs = self.first if self.phase else (*self.first, {})
    return self.step.lower(*args, **kwargs)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def ten_steps_unrolled(step, phase=None):
  """Ten steps of `step` in a Python loop inside one jit (what a Python training loop
  runs, in one program); `phase(i)` is the instruments' static phase of step i."""
  def run(carry, x, target):
    outputs = []
    for i in range(EVERY):
      if phase is None:
        carry, loss = step(carry, x, target)
        outputs.append(loss)
      else:
        params, state, readings = step(*carry, x, target, phase=phase(i))
        carry = (params, state)
        outputs.append(readings)
    return carry, outputs
  return run


def ten_steps(step, with_state: bool):
  """Ten steps of `step` in one `lax.scan`, carrying parameters (and state); returns
  the last carry and every step's loss (plain) or readings (instruments)."""
  def run(carry, x, target):
    def body(carry, _):
      if with_state:
        params, state, readings = step(*carry, x, target)
        return (params, state), readings
      params, loss = step(carry, x, target)
      return params, loss
    return jax.lax.scan(body, carry, None, length=EVERY)
  return run


def check(economy, params, state, x, target) -> None:
  """The economy step's norm test equals the one from vmap(grad)'s per-example grads."""
  _, _, readings = economy(params, state, x, target)
  per_example = jax.vmap(jax.grad(lambda p, x, t: jnp.sum(
      (jnp.tanh(_forward_last(p, x)) - t) ** 2) / t.shape[-1]), in_axes=(None, 0, 0))(
          params, x[:, None], target[:, None])
  batch = x.shape[0]
  flat = jnp.concatenate([g.reshape(batch, -1) for g in jax.tree.leaves(per_example)], 1)
  mean = flat.mean(0)
  expected = jnp.sqrt(jnp.sum((flat - mean) ** 2) / (batch * (batch - 1))) / jnp.linalg.norm(mean)
  np.testing.assert_allclose(readings["norm_test"], expected, rtol=2e-3)
  # The 1-D histogram counts every element of every example's gradient.
  assert int(readings["grad_hist_1d"]["counts"].sum()) == flat.size
  fun = lambda w: 0.5 * jnp.sum(jnp.arange(1.0, 5.0) * w ** 2)
  np.testing.assert_allclose(gl.hessian_trace(fun, jnp.ones(4), key=jax.random.PRNGKey(0),
                                              num_products=2), 10.0, rtol=1e-6)


def _filled_fraction(economy, params, state, x, target) -> float:
  """The share of the 1-D gradient histogram's counts outside the two bins at zero."""
  counts = np.asarray(economy(params, state, x, target)[2]["grad_hist_1d"]["counts"])
  middle = counts.size // 2
  return 1.0 - float(counts[middle - 1:middle + 1].sum()) / float(counts.sum())


def _forward_last(params, x):
  """The MLP up to the last pre-activation (plain)."""
  for layer in params[:-1]:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def run(settings: h.Settings, sizes: _mlp.Sizes | None = None) -> h.WorkloadResult:
  sizes = sizes or (_mlp.QUICK if settings.quick else _mlp.FULL)
  params, x, target = _mlp.init(sizes)
  instruments = gl.training_instruments("economy")
  state = instruments.init(params)
  plain, economy, hvp, trace, max_eig = steps(instruments)
  economy = jax.jit(economy)
  check(economy, params, state, x, target)
  one = {  # One new instrument per step variant: its cost per reading.
      "alpha": ("alpha",), "hist_1d": ("grad_hist_1d",), "hist_2d": ("grad_hist_2d",),
      "moments": ("mean_gsnr", "early_stopping", "cabs"),
      "tic": ("tic_diag", "tic_trace", "hessian_trace")}
  singles = {}
  for name, chosen in one.items():
    single = gl.training_instruments(chosen, curvature_every=1, num_products=NUM_PRODUCTS)
    singles[name] = h.Variant(f"{'+'.join(chosen)} read every step",
                              jax.jit(steps(single)[1]), (params, single.init(params), x, target))
  key = jax.random.PRNGKey(0)
  every = gl.training_instruments("economy", every=EVERY)
  economy_every = steps(every)[1]
  donated = jax.jit(economy_every, static_argnames="phase", donate_argnums=(0, 1))
  plain_donated = jax.jit(plain, donate_argnums=0)
  # Economy without its 1-D gradient histogram, which forms every per-example gradient.
  lean = gl.training_instruments(
      tuple(n for n in gl.analyses.instruments._cockpit.PRESETS["economy"]  # pylint: disable=protected-access
            if n != "grad_hist_1d"), every=EVERY)
  lean_donated = jax.jit(steps(lean)[1], static_argnames="phase", donate_argnums=(0, 1))
  # Two sets of interleaved rounds, so that the curvature variants (tens of steps
  # each) do not thin out the rounds of the step variants.
  step_variants = {
      "plain": h.Variant("plain training step", jax.jit(plain), (params, x, target)),
      "economy": h.Variant("economy instruments in the step", economy,
                           (params, state, x, target)),
      "plain_10": h.Variant(f"{EVERY} plain steps (scan)", jax.jit(ten_steps(plain, False)),
                            (params, x, target)),
      "economy_10": h.Variant(f"{EVERY} steps, economy read every step (scan)",
                              jax.jit(ten_steps(economy, True)),
                              ((params, state), x, target)),
      "every_10": h.Variant(f"{EVERY} steps, economy read every {EVERY}th step (scan)",
                            jax.jit(ten_steps(economy_every, True)),
                            ((params, every.init(params)), x, target)),
      "plain_10u": h.Variant(f"{EVERY} plain steps (unrolled)",
                             jax.jit(ten_steps_unrolled(plain)), (params, x, target)),
      "static_10": h.Variant(
          f"{EVERY} steps, economy read every {EVERY}th step, static phases (unrolled)",
          jax.jit(ten_steps_unrolled(economy_every, every.phase)),
          ((params, every.init(params)), x, target)),
  }
  loop_variants = {
      "plain_loop": h.Variant(f"{EVERY} plain steps (Python loop, params donated)",
                              _Loop(plain_donated, (_copy(params),), x, target), ()),
      "every_loop": h.Variant(
          f"{EVERY} steps, economy every {EVERY}th (Python loop, static phases, "
          "params and state donated)",
          _Loop(donated, (_copy(params), every.init(params)), x, target, every.phase), ()),
      "lean_loop": h.Variant(
          f"{EVERY} steps, economy without grad_hist_1d every {EVERY}th (Python loop, "
          "static phases, params and state donated)",
          _Loop(lean_donated, (_copy(params), lean.init(params)), x, target, lean.phase), ()),
      "plain_loop_nd": h.Variant(f"{EVERY} plain steps (Python loop, no donation)",
                                 _Loop(jax.jit(plain), (params,), x, target), ()),
      "every_loop_nd": h.Variant(
          f"{EVERY} steps, economy every {EVERY}th (Python loop, static phases, "
          "no donation)",
          _Loop(jax.jit(economy_every, static_argnames="phase"),
                (params, every.init(params)), x, target, every.phase), ()),
  }
  labels = jax.random.randint(jax.random.PRNGKey(1), (x.shape[0],), 0, CLASSES)
  filled = (_filled_fraction(economy, params, state, x, labels),
            _filled_fraction(economy, params, state, x, target))
  loop_variants.update({
      "plain_loop_ce": h.Variant(
          f"{EVERY} plain steps, 10-class cross-entropy (Python loop, params donated)",
          _Loop(plain_donated, (_copy(params),), x, labels), ()),
      "every_loop_ce": h.Variant(
          f"{EVERY} steps, economy every {EVERY}th, 10-class cross-entropy: bins filled "
          "(Python loop, static phases, params and state donated)",
          _Loop(donated, (_copy(params), every.init(params)), x, labels, every.phase), ()),
  })
  single_variants = {"plain_s": h.Variant("plain training step (single rounds)",
                                          jax.jit(plain), (params, x, target)), **singles}
  curvature_variants = {
      "plain_c": h.Variant("plain training step (curvature rounds)", jax.jit(plain),
                           (params, x, target)),
      "hvp": h.Variant("one Hessian-vector product", jax.jit(hvp), (params, params, x, target)),
      "trace": h.Variant(f"hessian_trace, {NUM_PRODUCTS} products", jax.jit(trace),
                         (params, key, x, target)),
      "max_eig": h.Variant(f"hessian_max_eigenvalue, {NUM_PRODUCTS} products",
                           jax.jit(max_eig), (params, key, x, target)),
  }
  m = {**h.measure(step_variants, settings), **h.measure(loop_variants, settings),
       **h.measure(single_variants, settings), **h.measure(curvature_variants, settings)}
  comparisons = []
  for name, baseline in (("economy", "plain"), ("economy_10", "plain_10"),
                         ("every_10", "plain_10"), ("static_10", "plain_10u"),
                         ("every_loop", "plain_loop"), ("lean_loop", "plain_loop"),
                         ("every_loop_nd", "plain_loop_nd"),
                         ("every_loop_ce", "plain_loop_ce"),
                         *((name, "plain_s") for name in one),
                         ("hvp", "plain_c"), ("trace", "plain_c"), ("max_eig", "plain_c")):
    target = (settings.target(None, TPU_FILLED_TARGET) if name == "every_loop_ce"
              else TARGET if name in ("every_10", "static_10", "every_loop") else None)
    comparison = h.compare(NUMBER, m, name, baseline, target, settings)
    if comparison.status == "MISSED":
      comparison.explanation = h.describe_hlo_difference(m[name], m[baseline])
    comparisons.append(comparison)
  for name in ("trace", "max_eig"):
    comparisons.append(h.compare(NUMBER, m, name, "hvp", None, settings))
  notes = [f"Bins filled: with the 10-class cross-entropy, {filled[0]:.1%} of the 1-D "
           "histogram's counts are outside the two bins at zero (with the regression "
           f"loss, {filled[1]:.1%}).",
           f"Model: {sizes}, SGD (lr {LR}). Checked before timing: the economy step's "
           "norm test equals the one from vmap(grad) per-example gradients. Curvature "
           f"per use: {NUM_PRODUCTS} products; the ratio over `hvp` is its cost in "
           "products.",
           "Where the economy step's time goes (measured one instrument at a time on "
           "this model, CPU, JAX 0.5.0): the three batch-size tests about 1.15x (two "
           "128 x 128 Gram matrices per layer, B^2 (d_in + d_out) multiply-adds, a "
           "sixth of the step's matmuls; the jvp form they replaced, one B d_in d_out "
           "matmul per layer, was 1.25x); grad_norm, update_size, alpha and distance "
           "about 1.2x together (five parameter-sized sums in one variadic reduce "
           "per leaf, which XLA's CPU backend runs well below memory speed, and the "
           "previous update and a copy of the initial parameters written to the state "
           "unless the step donates it). Read every step, that is the floor on this "
           "machine; `every=10` reads one step in ten, as Cockpit's track_interval "
           "does. Scheduled by the step count inside a scan, the `lax.cond`s read "
           "loop-carried parameter-sized values (parameters, previous update), and on "
           "JAX 0.10.2's CPU backend that costs about 1.17x a step even when nothing "
           "is read; static phases (a Python training loop) cost about 1.02. The "
           "single-call `economy` row also pays a 4 MiB copy of the initial parameters "
           "that the scans carry instead."]
  return h.WorkloadResult(NUMBER, TITLE, m, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
