"""Flax NNX with stock modules: which layer's per-example gradients grow during training?

A digits classifier made of stock `nnx.Linear` layers, each given
`dot_general=gl.dense_dot_general(name=...)`: the layer computes what it always does,
and its record (input, kernel, output cotangent) describes a dense layer. The step is
an ordinary `nnx.jit` step with `nnx.Optimizer`; `gl.call_and_reap(nnx.grad(loss))`
returns the gradients and the records, from which `gl.per_example_norms` gives each
example's gradient norm per layer, without a per-example gradient. Every step, the
loss, the learning rate, the per-layer per-example norms (under keys written as tree
paths, `grad_norm/fc1`) and the summaries of the output cotangents go to a `RunLog`;
at the end the report and the TensorBoard export are written, and the last step is
checked against plain JAX: per-example gradients from `jax.vmap` of `jax.grad` over
the model's state, and the gradients of plain `nnx.grad`.

Run: python examples/10_flax_nnx.py [--steps 200] [--run-dir runs/nnx]
     then: python -m oryx_gradlog tensorboard runs/nnx  (tensorboard --logdir runs/nnx/tensorboard)
"""

import argparse
import inspect
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import oryx_gradlog as gl

WIDTHS = (64, 64, 32, 10)
BATCH, LR = 64, 1e-2


class Classifier(nnx.Module):
  """An MLP of stock `nnx.Linear` layers whose products are recorded as dense layers."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(64, 64, dot_general=gl.dense_dot_general(name="fc1"), rngs=rngs)
    self.fc2 = nnx.Linear(64, 32, dot_general=gl.dense_dot_general(name="fc2"), rngs=rngs)
    self.fc3 = nnx.Linear(32, 10, dot_general=gl.dense_dot_general(name="fc3"), rngs=rngs)

  def __call__(self, x):
    return self.fc3(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y, lr):
  (loss, grads), records = gl.call_and_reap(nnx.value_and_grad(loss_fn))(model, x, y)
  # Flax NNX 0.11 added the model to `Optimizer.update`.
  if "model" in inspect.signature(optimizer.update).parameters:
    optimizer.update(model, grads)
  else:
    optimizer.update(grads)
  result = gl.per_example_norms(records)  # Each example's gradient norm, per layer.
  logged = {"loss": loss, "lr": lr, "grad_norm/total": result.norms,
            **{f"grad_norm/{name}": value for name, value in result.layers.items()},
            # Layer records summarize by their output cotangent, per example.
            "cotangents": gl.summarize(records, keep_axes=1)}
  return logged, grads


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--run-dir", default=os.path.join("runs", "nnx"))
  parser.add_argument("--quick", action="store_true", help="30 steps, for the tests")
  args, _ = parser.parse_known_args(argv)
  steps = 30 if args.quick else args.steps

  x_all, y_all = load_digits(return_X_y=True)
  x_all, y_all = jnp.asarray(x_all / 16.0, jnp.float32), jnp.asarray(y_all)
  model = Classifier(rngs=nnx.Rngs(0))
  schedule = optax.cosine_decay_schedule(LR, steps)
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)
  rng = np.random.default_rng(0)

  shutil.rmtree(args.run_dir, ignore_errors=True)
  dims = {"grad_norm/*": ("example",), "cotangents.*": ("example",)}
  with gl.RunLog(args.run_dir, config={"widths": WIDTHS, "lr": LR}, dims=dims) as log:
    for step in range(steps):
      batch = rng.choice(len(x_all), BATCH, replace=False)
      x, y = x_all[batch], y_all[batch]
      # A copy of the parameters this step starts from (the step updates the model's).
      state = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
      logged, grads = train_step(model, optimizer, x, y, jnp.float32(schedule(step)))
      log.append(step, logged)
      if step % 50 == 0 or step == steps - 1:
        medians = {name: float(jnp.median(logged[f"grad_norm/{name}"]))
                   for name in ("fc1", "fc2", "fc3")}
        print(f"step {step:4d}  loss {float(logged['loss']):.4f}  median per-example "
              "gradient norm: " + "  ".join(f"{n} {v:.3f}" for n, v in medians.items()))
  accuracy = float(jnp.mean(jnp.argmax(model(x_all), -1) == y_all))
  page = gl.report(args.run_dir, progress=False)
  logdir = gl.export_tensorboard(args.run_dir)
  print(f"train accuracy {accuracy:.3f}; report: {page}; TensorBoard: "
        f"tensorboard --logdir {logdir}")

  # Check the last step against plain JAX, read back from the store.
  graphdef, _ = nnx.split(model)
  def example_loss(params, x, y):  # One example's loss, from the step's parameters.
    return loss_fn(nnx.merge(graphdef, params), x[None], y[None])
  per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(state, x, y)
  run = gl.open_run(args.run_dir)
  assert run.sizes["step"] == steps
  total = 0.0
  for name in ("fc1", "fc2", "fc3"):
    squares = sum(jnp.sum(leaf.reshape(BATCH, -1) ** 2, 1)  # Its kernel and bias.
                  for leaf in jax.tree.leaves(getattr(per_example, name)))
    total = total + squares
    np.testing.assert_allclose(run[f"grad_norm/{name}"].values[-1], jnp.sqrt(squares),
                               rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(run["grad_norm/total"].values[-1], jnp.sqrt(total), rtol=1e-4)
  expected = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, y))(state)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert run["cotangents.fc1.summary.out_cotangent.norm"].dims == ("step", "example")
  print(f"check: last step's per-example gradient norms of every layer and the gradients "
        f"equal plain JAX ({steps} steps logged)")


if __name__ == "__main__":
  main()
