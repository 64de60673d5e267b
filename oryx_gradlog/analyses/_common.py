"""What every layer analysis checks and shares, below the analyses' own modules.

An analysis of layer records (`per_example_norms`, `kfac_factors`, the instruments,
...) starts with `select` (its arguments checked, the records read as one
`Selection` of layer uses) and scales what the records hold to the per-example
losses' convention with `loss_scale`.

Sharp edges:
  * The recorded cotangents are those of the batch loss: for `reduction="mean"`
    they are the per-example losses' cotangents divided by the batch size, which
    `loss_scale` gives back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any

# `dot` (einsum at the model's precision, summed in float32) is the analyses' too.
from oryx_gradlog.record._canonical import GRAM, MATERIALIZED, dot  # noqa: F401
from oryx_gradlog.record._kinds import NORM_KINDS
from oryx_gradlog.record._selection import Selection, collect

METHODS = ("auto", GRAM, MATERIALIZED)
REDUCTIONS = ("mean", "sum")


def check_reduction(api: str, reduction: str) -> None:
  if reduction not in REDUCTIONS:
    raise ValueError(
        f"{api}(reduction={reduction!r}): reduction must be 'mean' (the loss is the "
        "mean of the per-example losses) or 'sum' (their sum). For another scaling c * "
        "sum_i l_i, use 'sum' and divide the results by c (norms) or c**2 (squares).")


@contextlib.contextmanager
def scalar_loss(api: str, has_aux: bool) -> Iterator[None]:
  """Turns JAX's error for a loss that returns more than a scalar, inside the block,
  into one that names `has_aux`, the usual cause."""
  try:
    yield
  except TypeError as error:
    if has_aux or "Gradient only defined for scalar-output functions" not in str(error):
      raise
    raise TypeError(
        f"{api}: the loss returned more than a scalar. A loss that returns (loss, aux) "
        "(metrics, updated batch statistics) needs has_aux=True, as for jax.grad: "
        f"gl.{api}(loss, ..., has_aux=True). JAX's error is above.") from error


def loss_scale(reduction: str, batch_size: int) -> float:
  """The factor from a recorded cotangent to the per-example loss's cotangent."""
  return float(batch_size) if reduction == "mean" else 1.0


def one_batch_size(api: str, sizes: dict[str, int], minimum: int = 1) -> int:
  """The one batch size of the layers analysed, else an error listing them."""
  if len(set(sizes.values())) != 1:
    raise ValueError(
        f"{api}: the layer records have batch sizes {sorted(set(sizes.values()))}, by "
        f"name {sizes}; the analysis needs every layer of one batch. Reap one backward "
        "pass of one batch loss.")
  size = next(iter(sizes.values()))
  if size < minimum:
    raise ValueError(
        f"{api}: the layer records have batch size {size}; the analysis needs a batch "
        f"size of at least {minimum}. Reap one backward pass of one batch loss.")
  return size


def select(api: str, records: dict[str, Any], *, reduction: str,
           names: Sequence[str] | None, tied: Collection[str], method: str = "auto",
           kinds: Sequence[str] = NORM_KINDS) -> Selection:
  """Checks the arguments of an analysis; returns the records it reads."""
  check_reduction(api, reduction)
  if method not in METHODS:
    raise ValueError(f"{api}(method={method!r}): method must be one of {METHODS}.")
  return collect(api, records, names, kinds, tied)

