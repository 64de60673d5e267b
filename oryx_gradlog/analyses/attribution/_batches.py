"""Batches and parameters as the attribution functions take them (internal).

A batch is a tuple (or list) of the loss's batch arguments, `(x, y)` for
`loss(params, x, y)`, or any other pytree, a dict `{"x": ..., "y": ...}` included,
that the loss takes as its one batch argument, `loss(params, batch)`. Every array of
a batch has the examples on its leading axis, as many in each. Batches of one call
may differ in size (each new size compiles once).

Sharp edges:
  * A tuple is always the loss's arguments: a loss that takes one tuple,
    `loss(params, (x, y))`, gets its batches wrapped, `[((x, y),)]`.
  * A batch of one example is recorded as two copies of it and the copy dropped:
    `gl.record_layers` tells the batch axis from a batch of two, and a loss such as
    optax's cross-entropy traces differently with one example.
  * What is compiled for a loss (the check of its mean, the passes, the steps of
    `Influence`) is kept for the last 16 losses where the loss is hashable (a
    function); a loss that is not (an Equinox module's call) compiles anew each call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_FORM = ("A batch is a tuple of the loss's batch arguments, (x, y) for loss(params, x, "
         "y), or one pytree such as a dict for loss(params, batch), with the examples on "
         "the leading axis of every array")


def as_args(api: str, batch: Any, where: str) -> tuple:
  """`batch` as the tuple of the loss's batch arguments; `where` names it in errors
  (`"batches[3]"`)."""
  args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
  sizes: dict[int, str] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    shape = np.shape(leaf)
    name = f"{where}{jax.tree_util.keystr(path)}"
    if not shape:
      raise ValueError(f"{api}: {name} has no leading (batch) axis: it is a scalar. "
                       f"{_FORM}.")
    sizes.setdefault(shape[0], name)
  if not sizes:
    raise ValueError(f"{api}: {where} holds no array. {_FORM}.")
  if len(sizes) > 1:
    found = ", ".join(f"{name} has {size}" for size, name in sizes.items())
    raise ValueError(f"{api}: the arrays of {where} hold different numbers of examples "
                     f"({found}). {_FORM}, as many in each.")
  return args


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def kept_per_loss(cached: Callable, *args: Any) -> Any:
  """`cached(*args)`, a `functools.lru_cache`d function of a loss: kept across calls
  where the arguments are hashable (a list, `batch_argnums=[1, 2]`, taken as its
  tuple), made anew for this call where they are not."""
  args = tuple(tuple(a) if isinstance(a, list) else a for a in args)
  return cached(*args) if _hashable(args) else cached.__wrapped__(*args)


def cache_key(fun: Callable) -> Any:
  """`fun` as a key of a cache that lives no longer than it: itself where hashable,
  else its id."""
  return fun if _hashable(fun) else id(fun)


def positions(argnums: int, batch_argnums: int | Sequence[int] | None, n_args: int
              ) -> tuple[int, ...]:
  """The positions of the batch arguments among a call's `n_args` (parameters
  included): `batch_argnums`, or every one but `argnums`."""
  if batch_argnums is None:
    return tuple(i for i in range(n_args) if i != argnums)
  return (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)


def size(args: Any) -> int:
  """The number of examples of a checked batch (`as_args`)."""
  return int(np.shape(jax.tree.leaves(args)[0])[0])


def twice(args: Any) -> Any:
  """Every array with its examples repeated: one example becomes two."""
  return jax.tree.map(lambda v: jnp.concatenate([v, v]), args)


def check_call(api: str, fun: Callable, args: list) -> None:
  """Raises unless `fun` can be called with `args` (the parameters among them)."""
  try:
    signature = inspect.signature(fun)
  except (TypeError, ValueError):  # A callable whose signature Python cannot read.
    return
  try:
    signature.bind(*args)
  except TypeError as error:
    raise TypeError(
        f"{api}: the loss cannot take the parameters and a batch of {len(args) - 1} "
        f"argument(s) ({error}). {_FORM}; a list of batches holds such batches, "
        "[(x, y)], not the arrays of one batch (x, y).") from None


def check_params(api: str, params: Any) -> None:
  """Raises unless `params` is a pytree of arrays (an NNX module is not)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float)):
      raise TypeError(
          f"{api}: params{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an "
          "array. Pass the parameters as a pytree of arrays; for a Flax NNX model, "
          "graphdef, params, rest = nnx.split(model, nnx.Param, ...) and "
          "nnx.merge(graphdef, params, rest) inside the loss.")


def progress(batches: Iterable, desc: str, show: bool) -> Iterable:
  """`batches` with a progress bar (tqdm's, in terminals, notebooks and logs) where
  `show` is true and tqdm is installed (the `report` extra); else as they are."""
  if not show:
    return batches
  try:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return batches
  total = len(batches) if hasattr(batches, "__len__") else None
  return tqdm(batches, desc=desc, total=total, unit="batch", leave=False)


def one_ahead(results: Iterable) -> Iterator:
  """`results` (one per batch, each a pytree of arrays of the batch's program), each
  passed on once the next batch's program is dispatched and the one before it has
  finished. JAX dispatches asynchronously: the device keeps working while the host
  waits, yet at most two batches are in flight (not every batch's outputs allocated
  at once), and a progress bar over the batches says how far the device has got."""
  pending = None
  for result in results:
    if pending is not None:
      jax.block_until_ready(pending)
    leaves = jax.tree.leaves(result)
    pending = min(leaves, key=np.size) if leaves else None  # Ready with the rest.
    yield result
