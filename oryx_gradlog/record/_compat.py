"""Checks, when the package is imported, that the installed JAX and Oryx work together.

Oryx's last release (0.2.9) imports only on JAX 0.4.38-0.5.x; its main branch keeps
up with JAX, one commit for a narrow band of releases, and every commit calls itself
0.2.9. So the check is by feature, not by version: import Oryx's harvest, then reap
a probe that has what record sites need (an `append` sow inside `lax.scan`, a
`lax.cond` and a `jax.jit`). Where that fails, the `ImportError` names what is
installed and gives the install lines of each supported set, nearest to the user's
JAX first, instead of an `AttributeError` deep inside Oryx.

Sharp edges:
  * A JAX release between two supported ones passes when its Oryx passes the probe;
    the test matrix (README, "Versions") lists the sets that were tested.
  * tensorflow-probability and tfp-nightly install the same module; having both is
    named in the error, since either one can shadow the other.
  * A module missing below Oryx (`tf_keras`, which tensorflow-probability wants
    when TensorFlow was imported first) is named with its pip line instead: no set
    of JAX and Oryx would fix it.
  * With TensorFlow installed, importing Oryx imports TensorFlow too (the JAX
    substrate of tensorflow-probability does, to copy docstrings; neither has a
    switch): the first use of `oryx_gradlog` then takes seconds longer.
  * The probe reaps in the default float dtype, so with `jax_enable_x64` on (the
    `JAX_ENABLE_X64` variable, or `jax.config.update` before the import) it checks
    float64, which works on every supported set.
"""

from __future__ import annotations

from importlib import metadata

# The tested sets: (JAX versions, Oryx source, TensorFlow Probability, install line).
SUPPORTED = (
    (("0.4.38", "0.5.0"), "Oryx 0.2.9 (PyPI)", "tensorflow-probability 0.25.0",
     'pip install "jax==0.5.0" "jaxlib==0.5.0" "oryx==0.2.9" '
     '"tensorflow-probability==0.25.0"'),
    (("0.8.2",), "Oryx main @aa33090", "tfp-nightly",
     'pip install "jax==0.8.2" "jaxlib==0.8.2" "tfp-nightly==0.26.0.dev20261027" && '
     'pip install --no-deps "oryx @ git+https://github.com/jax-ml/oryx@aa33090"'),
    (("0.10.2",), "Oryx main @9b9ef13", "tfp-nightly",
     'pip install "jax==0.10.2" "jaxlib==0.10.2" "tfp-nightly==0.26.0.dev20261027" && '
     'pip install --no-deps "oryx @ git+https://github.com/jax-ml/oryx@9b9ef13"'),
)


def _version(package: str) -> str | None:
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def _release(version: str | None) -> tuple[int, ...]:
  parts = []
  for part in (version or "0").split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def install_lines(jax_version: str | None) -> str:
  """The supported sets' install lines, the one nearest to `jax_version` first."""
  target = _release(jax_version)
  def distance(entry):
    return min(abs(_release(v)[1] - target[1]) + 100 * abs(_release(v)[0] - target[0])
               for v in entry[0])
  return "\n".join(
      f"  JAX {' or '.join(versions)} with {oryx} and {tfp}:\n    {line}"
      for versions, oryx, tfp, line in sorted(SUPPORTED, key=distance))


def unsupported_message(error: BaseException, installed=_version) -> str:
  """What is installed, why it cannot work, and the install lines that fix it."""
  packages = ("jax", "jaxlib", "oryx", "tensorflow-probability", "tfp-nightly")
  found = ", ".join(f"{p} {installed(p) or 'not installed'}" for p in packages)
  both = installed("tensorflow-probability") and installed("tfp-nightly")
  return (
      "oryx_gradlog needs JAX and Oryx releases that work together, and this "
      f"environment has {found}, where Oryx's harvest fails: "
      f"{type(error).__name__}: {error}. "
      + ("tensorflow-probability and tfp-nightly both install the module "
         "`tensorflow_probability`: uninstall both, then install the one of your set. "
         if both else "")
      + "Install the set for your JAX (README, 'Versions'):\n"
      + install_lines(installed("jax"))
      + "\nWithout GitHub, build Oryx main's wheel from a copied clone with "
      "`make oryx-wheel ORYX_COMMIT=... ORYX_REPO=path/to/clone` (README, 'Versions')."
  )


def _probe() -> None:
  """Reaps what record sites need from Oryx: scan with append sows, cond, jit."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from oryx.core import reap, sow  # pylint: disable=g-import-not-at-top

  def body(carry, x):
    x = sow(x * carry, tag="probe", name="x", mode="append")
    return lax.cond(x > 0, jax.jit(lambda c: c + x), lambda c: c, carry), None

  # The carry has the inputs' dtype, and the inputs the default float (float64 with
  # `jax_enable_x64`): a scan whose carry changes dtype fails in JAX itself.
  reaped = reap(lambda xs: lax.scan(body, jnp.ones((), xs.dtype), xs)[0], tag="probe")
  shapes = jax.eval_shape(reaped, jax.ShapeDtypeStruct((3,), jnp.result_type(float)))
  if shapes["x"].shape != (3,):
    raise RuntimeError(f"a scan of 3 steps reaped {shapes['x'].shape}, not (3,)")


# The modules of the supported sets themselves: their absence is a set to install.
_OWN_MODULES = ("jax", "jaxlib", "oryx", "tensorflow_probability")
# Pip names of modules whose package is named otherwise.
_PIP_NAMES = {"tf_keras": "tf-keras"}


def missing_dependency(error: BaseException) -> str | None:
  """The module whose absence caused `error` (in its cause chain), unless it is one
  of JAX, Oryx or TensorFlow Probability themselves."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if name and name.split(".")[0] not in _OWN_MODULES:
      return name
    error = error.__cause__ or error.__context__
  return None


def missing_dependency_message(module: str, error: BaseException) -> str:
  """Which module is missing and the pip line, for a dependency of a dependency."""
  top = module.split(".")[0]
  pip = _PIP_NAMES.get(top, top.replace("_", "-"))
  fix = f"Install it: pip install {pip}"
  if top == "tf_keras":
    fix = ("TensorFlow is installed and already imported, so tensorflow-probability "
           "(which Oryx imports) checks for TF-Keras: import oryx_gradlog before "
           "TensorFlow, uninstall TensorFlow if nothing needs it, or install TF-Keras "
           f"(the release matching your TensorFlow): pip install {pip}")
  return (f"oryx_gradlog could not import Oryx: the module `{module}`, which one of "
          f"its dependencies imports, is missing ({type(error).__name__}: {error}). "
          f"The installed JAX and Oryx are not the cause. {fix}")


def check_supported(probe=_probe, installed=_version) -> None:
  """Raises `ImportError`, with the fix, unless Oryx's harvest works on this JAX."""
  try:
    probe()
  except Exception as error:  # pylint: disable=broad-except
    module = missing_dependency(error)
    if module is not None:
      raise ImportError(missing_dependency_message(module, error)) from error
    raise ImportError(unsupported_message(error, installed)) from error
