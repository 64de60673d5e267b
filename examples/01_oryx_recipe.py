"""The Oryx answer to "Saving gradient in backward pass", as oryx_gradlog code.

Shows: the cotangent of an intermediate `y = sin(x)` of `f(x) = sin(x) ** 2`, first
as the Oryx maintainer's `record_vjp` recipe returns it, then with `tap`, each
checked against Matt Johnson's perturbation function.

Run: python examples/01_oryx_recipe.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import oryx_gradlog as gl


def main():
  # The recipe: record the cotangents of the inputs of `lambda y: y ** 2`.
  square = gl.record_vjp(lambda y: y ** 2.0, name="square_vjp")
  f = lambda x: square(jnp.sin(x))
  records = gl.reap(jax.grad(f))(3.0)
  print("reap(grad(f))(3.) =", records)

  # The same cotangent with `tap`, keeping the gradient too.
  g = lambda x: gl.tap(jnp.sin(x), name="y") ** 2
  grad, tapped = gl.call_and_reap(jax.grad(g))(3.0)
  print("grad(f)(3.) =", grad, " dL/dy =", tapped["y"])

  # Check: the perturbation function f_perturbed(x, delta_y), differentiated.
  f_perturbed = lambda x, delta_y: (jnp.sin(x) + delta_y) ** 2
  expected_grad, expected_ct = jax.grad(f_perturbed, (0, 1))(3.0, 0.0)
  np.testing.assert_allclose(records["square_vjp"][0], expected_ct, rtol=1e-6)
  np.testing.assert_allclose(tapped["y"], expected_ct, rtol=1e-6)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-6)
  print("check: records equal the perturbation reference")


if __name__ == "__main__":
  main()
