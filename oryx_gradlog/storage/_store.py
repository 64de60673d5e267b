"""The on-disk log: records and summaries appended step by step to a zarr store.

`RunLog` takes what a training step returns (records, `summarize` output, any pytree
of arrays), hands it to a writer thread through a bounded queue, and returns at once:
the copy to the host and the write happen off the training thread, so logging every
step does not stall the device. Each leaf becomes one zarr array with a leading
`step` axis, named by its tree path (`dense.summary.1.norm`), with xarray dimension
names, so a run opens with `open_run(run_dir)` as an `xarray.Dataset` or with plain
`zarr`/numpy.

The writer stages steps on the host and writes them `steps_per_chunk` at a time
(one zarr chunk per leaf), since a file write per leaf per step would cost more
than the step. Crash safety: zarr writes each chunk file atomically (a rewritten
chunk is either old or new, both holding the committed steps), arrays grow ahead in
blocks of steps, and the group attribute `committed_steps` is advanced only after
all arrays of the staged steps are written; readers (`open_run`) see the committed
steps only. A run killed at any point (SIGKILL included)
leaves a store that opens, with every committed step intact; `flush()` writes the
staged steps and returns the number committed. Steps staged but not yet flushed
(at most `steps_per_chunk - 1`) are lost in a crash. `RunLog(run_dir, resume=True)` cuts any half-written step
and appends after the committed ones. A failed write (disk full, read-only folder)
stops the writer, leaves the committed steps as they are, and is raised, with the
fix, by the next `append`, `flush` or `close`.

Sharp edges:
  * The queue holds whole steps (references to device arrays, no copies). With
    `when_full="block"` (default) `append` waits for room; with `"drop"` it drops
    the step, counts it in `dropped`, and the count is saved in the store.
  * A leaf's shape and dtype must stay the same across steps. A leaf that first
    appears at a later step is back-filled with NaN (0 for integers), as is a leaf
    missing from a step.
  * Staged steps are host copies: at most `steps_per_chunk` steps of every leaf.
  * Step numbers are integers (Python, numpy or 0-d JAX integers) that strictly
    increase from one `append` to the next, across `resume=True` too; a repeated,
    decreasing or non-integer step is a `ValueError` at `append`, and the steps
    before it stay as they were. Gaps are fine (log every 10th step).
  * `config` is checked to be JSON-serialisable before anything touches the disk.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import json
import operator
import os
import platform
import queue
import threading
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import jax
import numpy as np

from oryx_gradlog.statistics._summaries import DEFAULT_BINS

STORE_NAME = "log.zarr"
_STOP, _FLUSH = object(), object()


def _require(module: str, api: str):
  try:
    return __import__(module)
  except ImportError as error:
    raise ImportError(
        f"{api} needs the '{module}' package: pip install 'oryx_gradlog[store]'"
    ) from error


def _versions() -> dict[str, str]:
  versions = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "oryx", "oryx_gradlog", "zarr", "numpy"):
    try:
      versions[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
      pass
  return versions


def _path_name(path) -> str:
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return ".".join(parts)


def flatten_logged(logged: Any) -> dict[str, Any]:
  """Flattens a pytree into `{dotted tree path: leaf}` (the store's variable names)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(logged)
  return {_path_name(path): leaf for path, leaf in leaves}


class RunLog:
  """Appends a pytree of arrays per step to `run_dir/log.zarr`, off the training thread.

  Args:
    run_dir: the run folder; created if needed.
    config: run metadata (JSON-serialisable), saved with library versions.
    dims: names for the leading axes of leaves (after `step`), by fnmatch pattern
      of the variable name, e.g. `{"dense.*": ("call", "example")}`.
    queue_size: steps that may wait for the writer.
    when_full: `"block"` or `"drop"` when the queue is full.
    resume: append to an existing run instead of refusing to overwrite it.
    bins: the magnitude histogram edges the summaries use, saved for the report.
    steps_per_chunk: steps written together, as one zarr chunk per leaf (`flush`
      writes a partial chunk at once).

  Raises:
    TypeError: `config` is not a JSON-serialisable mapping (checked before the
      folder is made, so a corrected retry starts clean).
    NotADirectoryError: `run_dir`, or a folder above it, is a file.
    FileExistsError: `run_dir` already holds a run and `resume` is False.

  Example:
    >>> import tempfile, jax.numpy as jnp, oryx_gradlog as gl
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir, config={"lr": 0.1}) as log:
    ...   for step in range(3):
    ...     log.append(step, {"h": {"norm": jnp.float32(step)}})
    >>> gl.open_run(run_dir)["h.norm"].values
    array([0., 1., 2.], dtype=float32)
  """

  def __init__(self, run_dir: str | os.PathLike, *, config: Mapping[str, Any] | None = None,
               dims: Mapping[str, tuple[str, ...]] | None = None, queue_size: int = 8,
               when_full: str = "block", resume: bool = False, bins=DEFAULT_BINS,
               steps_per_chunk: int = 16):
    zarr = _require("zarr", "RunLog")
    if when_full not in ("block", "drop"):
      raise ValueError(f"RunLog(when_full={when_full!r}): use 'block' or 'drop'.")
    self.run_dir = os.fspath(run_dir)
    config = _checked_config(config, self.run_dir)
    _check_folder(self.run_dir)
    self._dims = dict(dims or {})
    path = os.path.join(self.run_dir, STORE_NAME)
    try:
      os.makedirs(self.run_dir, exist_ok=True)
      if os.path.exists(path) and not resume:
        raise FileExistsError(
            f"RunLog({self.run_dir!r}): the folder already holds a run. Pass resume=True to "
            "append to it, or choose a new run_dir.")
      self._root = zarr.open_group(store=path, mode="a")
      self._committed = int(self._root.attrs.get("committed_steps", 0))
      self._truncate_to_committed()
      self._root.attrs.update({
          "committed_steps": self._committed,
          "config": config or self._root.attrs.get("config", {}),
          "versions": _versions(),
          "started": self._root.attrs.get("started", _now()),
          "dropped_steps": int(self._root.attrs.get("dropped_steps", 0)),
          "magnitude_bins": [float(edge) for edge in bins],
      })
    except OSError as error:
      if isinstance(error, FileExistsError):
        raise
      raise OSError(
          f"RunLog({self.run_dir!r}): cannot write the run folder ({error}). Choose a "
          "writable run_dir.") from error
    self.dropped = int(self._root.attrs["dropped_steps"])
    self._steps_per_chunk = steps_per_chunk
    self._layouts = {name: (array.shape[1:], array.dtype) for name, array in self._root.arrays()}
    self._last_step = (int(self._root["step"][self._committed - 1])
                       if self._committed and "step" in self._root else None)
    self._pending: list[dict[str, np.ndarray]] = []
    self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._when_full = when_full
    self._error: BaseException | None = None
    self._closed = False
    self._writer = threading.Thread(target=self._write_loop, name="gradlog-writer",
                                    daemon=True)
    self._writer.start()

  # The training thread's side.

  def append(self, step: int, logged: Any) -> None:
    """Queues one step's pytree of arrays for writing; returns without waiting for it.

    Args:
      step: the step number, an integer larger than the last one appended.
      logged: a pytree of arrays, with the same leaves every step.

    Raises:
      ValueError: `step` is not an integer, or not after the last step appended;
        nothing is queued and the log carries on.
    """
    self._raise_if_failed("append")
    if self._closed:
      raise RuntimeError(f"RunLog({self.run_dir!r}).append: the log is closed.")
    step = self._next_step(step)
    if self._when_full == "drop":
      try:
        self._queue.put_nowait((step, logged))
      except queue.Full:
        self.dropped += 1
    else:
      self._queue.put((step, logged))

  def _next_step(self, step: Any) -> int:
    """Returns `step` as an int; raises unless it is an integer after the last step."""
    is_bool = isinstance(step, (bool, np.bool_)) or getattr(step, "dtype", None) == bool
    try:
      number = None if is_bool else operator.index(step)
    except TypeError:
      number = None
    if number is None:
      raise ValueError(
          f"RunLog.append: step must be an integer, got {step!r} of type "
          f"{type(step).__name__}. Pass the step counter as an int, e.g. "
          "log.append(int(step), logged) for a whole-valued float.")
    if self._last_step is not None and number <= self._last_step:
      raise ValueError(
          f"RunLog.append: step {number} is not after the last step {self._last_step} "
          f"of {self.run_dir!r}; steps must increase, or the step axis would hold "
          "duplicates. Pass a growing step counter (gaps are fine), or log the new run "
          "to a new run_dir.")
    self._last_step = number
    return number

  def flush(self) -> int:
    """Writes every step appended so far and waits; returns the committed step count."""
    self._queue.put(_FLUSH)
    self._queue.join()
    self._raise_if_failed("flush")
    return self._committed

  @property
  def committed_steps(self) -> int:
    """Steps written in full so far (they survive a crash)."""
    return self._committed

  def close(self) -> None:
    """Flushes, saves the drop count and stops the writer thread."""
    if self._closed:
      return
    self._closed = True
    self._queue.put(_STOP)
    self._writer.join()
    if self._error is None:
      self._truncate_to_committed()  # Exact shapes for plain zarr readers.
      self._root.attrs["dropped_steps"] = self.dropped
    self._raise_if_failed("close")

  def __enter__(self) -> RunLog:
    return self

  def __exit__(self, *exc_info) -> None:
    if exc_info[0] is None:
      self.close()
    else:  # Keep the original error; still stop the writer.
      with contextlib.suppress(Exception):
        self.close()

  def _raise_if_failed(self, api: str) -> None:
    if self._error is not None:
      raise RuntimeError(
          f"RunLog({self.run_dir!r}).{api}: writing a step failed: {self._error}. The "
          f"{self._committed} steps before it are saved intact. Free disk space or make "
          "the folder writable, then continue with RunLog(run_dir, resume=True)."
      ) from self._error

  # The writer thread's side.

  def _write_loop(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if self._error is None:
          if item is _STOP or item is _FLUSH:
            self._commit()
          else:
            self._stage(*item)
      except BaseException as error:  # noqa: BLE001  (reported to the training thread)
        self._error = error
      finally:
        self._queue.task_done()
      if item is _STOP:
        return

  def _leading_dims(self, name: str, ndim: int) -> list[str]:
    # A histogram (of `summarize` or `running_statistics`) ends with its bin axis.
    trailing = ["magnitude_bin"] if name.endswith("histogram") and ndim else []
    lead = ndim - len(trailing)
    names = next((list(dims) for pattern, dims in self._dims.items()
                  if fnmatch.fnmatchcase(name, pattern)), [])[:lead]
    return names + [f"{name}.axis{i}" for i in range(len(names), lead)] + trailing

  def _stage(self, step: int, logged: Any) -> None:
    """Copies one step to the host and checks it; writes once a chunk of steps is full."""
    leaves = {name: np.asarray(value)
              for name, value in flatten_logged(jax.device_get(logged)).items()}
    if "step" in leaves:
      raise ValueError("RunLog.append: 'step' is reserved for the step axis; rename the leaf.")
    leaves["step"] = np.asarray(step, np.int64)
    for name, value in leaves.items():
      known = self._layouts.setdefault(name, (value.shape, value.dtype))
      if known != (value.shape, value.dtype):
        self._commit()  # Keep the good steps before the bad one.
        raise ValueError(
            f"RunLog.append: {name!r} changed from {known[1]}{list(known[0])} to "
            f"{value.dtype}{list(value.shape)} at step {step}. Keep leaves fixed in shape "
            "and dtype, or log the new one under another name.")
    self._pending.append(leaves)
    if len(self._pending) == self._steps_per_chunk:
      self._commit()

  def _commit(self) -> None:
    """Writes the staged steps to every array, then advances `committed_steps`."""
    if not self._pending:
      return
    start, stop = self._committed, self._committed + len(self._pending)
    if stop > self._capacity:  # Grow every array at once, rarely.
      self._capacity = max(2 * self._capacity, stop, 4 * self._steps_per_chunk)
      for _, array in self._root.arrays():
        array.resize((self._capacity, *array.shape[1:]))
    for name, (shape, dtype) in self._layouts.items():
      if name not in self._root:
        dims = ["step"] if name == "step" else ["step", *self._leading_dims(name, len(shape))]
        self._root.create_array(
            name, shape=(self._capacity, *shape), chunks=(self._steps_per_chunk, *shape),
            dtype=dtype, fill_value=-1 if name == "step" else _fill(dtype),
            dimension_names=dims)
      if any(name in leaves for leaves in self._pending):
        fill = np.full(shape, self._root[name].fill_value, dtype)
        self._root[name][start:stop] = np.stack(
            [leaves.get(name, fill) for leaves in self._pending])  # Missing: fill value.
    self._root.attrs["committed_steps"] = stop  # The commit point.
    self._committed, self._pending = stop, []

  def _truncate_to_committed(self) -> None:
    for _, array in self._root.arrays():
      if array.shape and array.shape[0] != self._committed:
        array.resize((self._committed, *array.shape[1:]))
    self._capacity = self._committed


def _checked_config(config: Any, run_dir: str) -> dict[str, Any]:
  """Returns `config` as a dict; raises, naming the bad keys, unless it is JSON."""
  if config is None:
    return {}
  if not isinstance(config, Mapping):
    raise TypeError(
        f"RunLog({run_dir!r}, config=...): config must be a mapping, got "
        f"{type(config).__name__}. Pass a dict, e.g. config={{'lr': 0.1}}.")
  bad = []
  for key, value in config.items():
    try:
      json.dumps({key: value}, allow_nan=True)
    except (TypeError, ValueError):
      bad.append(f"{key!r} ({type(value).__name__})")
  if bad:
    raise TypeError(
        f"RunLog({run_dir!r}, config=...): config is not JSON-serialisable at "
        f"{', '.join(bad)}; nothing was written. Convert those values to str, int, "
        "float, bool, None, lists or dicts, e.g. float(x) or x.tolist().")
  return dict(config)


def _check_folder(run_dir: str) -> None:
  """Raises `NotADirectoryError` when `run_dir`, or a folder above it, is a file."""
  existing = os.path.abspath(run_dir)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    where = ("is a file" if existing == os.path.abspath(run_dir)
             else f"is under the file {existing!r}")
    raise NotADirectoryError(
        f"RunLog({run_dir!r}): the run folder {where}, not a directory. Pass the path "
        "of a folder (it is created if missing), not of a file.")


def _fill(dtype) -> Any:
  return float("nan") if np.issubdtype(dtype, np.inexact) else 0


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def open_run(run_dir: str | os.PathLike):
  """Opens a run as an `xarray.Dataset` of its committed steps, with its metadata.

  Variables are the logged leaves (`dense.summary.norm`, ...), indexed by `step`
  (the step numbers passed to `append`) and the dims given to `RunLog`; `attrs` holds
  `config`, `versions`, `committed_steps` and `dropped_steps`.
  """
  xarray = _require("xarray", "open_run")
  path = os.path.join(os.fspath(run_dir), STORE_NAME)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"open_run({os.fspath(run_dir)!r}): no run here ({path} is "
                            "missing). Pass the run_dir given to RunLog.")
  dataset = xarray.open_zarr(path, consolidated=False)
  committed = int(dataset.attrs.get("committed_steps", 0))
  dataset = dataset.isel(step=slice(0, committed))
  return dataset.assign_coords(step=dataset["step"].values) if "step" in dataset else dataset
