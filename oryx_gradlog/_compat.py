"""Checks, before Oryx is imported, that JAX and Oryx are versions we support.

Oryx 0.2.9 (its last release) reaches into JAX internals. Measured with
tensorflow-probability 0.25.0: JAX/jaxlib 0.4.38 and 0.5.0 work; 0.5.1 and 0.5.2
break Oryx's scan and remat rules; 0.5.3 and later fail inside Oryx at import.
An unsupported combination is an `ImportError` that names the working versions and
the pip line that installs them, instead of an `AttributeError` deep inside Oryx.
"""

from importlib import metadata

SUPPORTED_VERSIONS = {
    "jax": ("0.4.38", "0.5.0"),
    "jaxlib": ("0.4.38", "0.5.0"),
    "oryx": ("0.2.9",),
}
PIP_LINE = (
    'pip install "jax==0.5.0" "jaxlib==0.5.0" "oryx==0.2.9" '
    '"tensorflow-probability==0.25.0"'
)


def _installed(package: str) -> str | None:
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def check_versions(installed=_installed) -> None:
  """Raises `ImportError` unless every supported package is at a working version."""
  problems = []
  for package, working in SUPPORTED_VERSIONS.items():
    version = installed(package)
    if version not in working:
      found = "not installed" if version is None else f"version {version}"
      problems.append(f"{package} is {found} (works with {', '.join(working)})")
  if problems:
    raise ImportError(
        "oryx_gradlog needs versions of JAX and Oryx that work together: "
        + "; ".join(problems)
        + f". Install a working combination with: {PIP_LINE}"
    )
