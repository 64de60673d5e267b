r"""The on-disk log: records and summaries appended step by step to a zarr store.

`RunLog` takes what a training step returns (records, `summarize` output, any pytree
of arrays), starts each accelerator array's copy to the host
(`copy_to_host_async`), hands the step to a writer thread through a bounded queue,
and returns at once: the copy and the write happen off the training thread, so
logging every step does not stall the device. Each leaf becomes one zarr array with a leading
`step` axis, named by its tree path (`dense.summary.1.norm`), with xarray dimension
names, so a run opens with `open_run(run_dir)` as an `xarray.Dataset` or with plain
`zarr`/numpy.

Names: any string key comes back from `open_run` (and in the report and the
TensorBoard export) as it was logged, `"grads/fc1"` included. zarr reads `/` and
`\` in an array name as folders, so the array's name in the store is the key
percent-encoded (`%` as `%25`, `/` as `%2F`, `\` as `%5C`, NUL as `%00`, and the
first character of the names `.`, `..`, `zarr.json`, `_commit`, which the store
keeps for itself): `urllib.parse.unquote` of a store name gives the key back, and
an encoded array also holds its key in its `key` attribute.

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
    `when_full="block"` (default) `append` waits for room, and counts each wait in
    `waits` and its seconds in `waited_s` (backpressure: the writer is slower than
    the steps); with `"drop"` it drops the step and counts it in `dropped`. The
    counts are saved in the store (`dropped_steps`, `backpressure_waits`,
    `backpressure_seconds`).
  * Leaves are numeric or boolean arrays, and a key keeps the shape and dtype of
    the first step that logs it: anything else is a `ValueError` at `append`,
    before anything is queued. A key may be logged at some steps only (an
    evaluation metric): it is back-filled with NaN (0 for integers, False for
    booleans) at the other steps, before its first step too. A key whose value is
    `None` is an error; `None` deeper in a value (a record's place for an integer
    leaf, which has no cotangent) is skipped, as pytrees skip it.
  * Staged steps are host copies: at most `steps_per_chunk` steps of every leaf.
  * Leaves of JAX's extra dtypes, which zarr has no type for (bfloat16, as a
    bfloat16 model's records are, float8_*, int4, ...), are stored in float32, int8
    or uint8, which hold their values exactly, and read back so; the array's
    `logged_dtype` attribute names the dtype logged, which the key keeps across
    `resume=True`. Cast to float16 first to store half the bytes of float32.
  * Step numbers are integers (Python, numpy or 0-d JAX integers) that strictly
    increase from one `append` to the next, across `resume=True` too; a repeated,
    decreasing or non-integer step is a `ValueError` at `append`, and the steps
    before it stay as they were. Gaps are fine (log every 10th step).
  * `config` is checked to be JSON-serialisable before anything touches the disk.
  * A name that cannot be stored is a `ValueError` at `append`, before anything is
    queued: a bare array (no name), the reserved `step`, two tree paths joined
    into one name (`{"a.b": x, "a": {"b": y}}`), or a name longer than a file name
    may be (255 bytes, encoded). Names are checked once per tree structure.
  * On a case-insensitive file system (macOS, Windows) keys that differ only in
    case (`"W"`, `"w"`) share one folder; use keys that differ otherwise there.
  * `open_run` of a run with no committed step yet (a live run before its first
    chunk or `flush`) is a `ValueError` that says so.

Many processes (JAX's multi-controller runtime, `jax.process_count() > 1`): every
process makes a `RunLog` on the same `run_dir` (on a file system every process
sees) and appends the same steps. Each process writes only the shards it
holds of each leaf (the `replica_id == 0` ones, so a replicated value is written once,
by the process holding its first copy; a host value by process 0); each array is
chunked like its leaf's shards, so no two processes ever write the same chunk file.
Each process then advances its own mark in `_commit/steps` (one chunk per process),
and the run's committed step count is the smallest mark: no collective runs in the
writer thread, and a process killed at any point leaves every step that all
processes wrote intact. Arrays are made large up front (never resized while the run
goes on, so no process rewrites another's metadata); readers slice to the committed
steps.

Sharp edges (many processes):
  * Making a `RunLog` is a collective: every process must make it, with the same
    arguments, in the same order as its other collectives (it runs two).
  * Every process appends the same steps, and only `when_full="block"` is allowed
    (a dropped step would differ between processes).
  * `flush()` and `committed_steps` count this process's written steps; `open_run`
    sees the steps every process has written.
  * A leaf's shards must tile it evenly (the array's chunks are one shard). A value
    that differs between processes without being a global array (a local metric) is
    saved as process 0 has it.
  * `resume=True` needs the same number of processes as the run was started with.
  * Plain zarr readers see arrays of 2**40 steps with only the committed ones
    written: slice them to `min(group["_commit/steps"][:])`.
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
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oryx_gradlog.statistics._summaries import DEFAULT_BINS

STORE_NAME = "log.zarr"
MARKS = "_commit/steps"  # One committed-step mark per process, in many-process runs.
_LOGGED_DTYPE = "logged_dtype"  # An array's attribute: the dtype logged, when not stored.
_MANY_PROCESS_CAPACITY = 2**40  # Steps; chunks not written take no space.
_STOP, _FLUSH = object(), object()
_TEXT_LENGTH = 80  # Characters of a text kept by `RunLog.describe_examples`.
_IMAGES_NAME = "examples_images.npy"  # `describe_examples(images=...)`, beside the store.
_IMAGE_SIDE = 64  # The largest side of an image kept as an example's thumbnail.


class _Describe(NamedTuple):
  """A queued `describe_examples`: written by the writer thread, which alone writes
  the store's attributes while the run goes on."""

  columns: dict[str, list]
  images: np.ndarray | None = None


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
  """Flattens a pytree into `{dotted tree path: leaf}` (the run's variable names)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(logged)
  return {_path_name(path): leaf for path, leaf in leaves}


# Characters that zarr's local store reads as path separators or cannot write, and
# the escape character itself, percent-encoded (so `urllib.parse.unquote` decodes).
_ESCAPES = {"%": "%25", "/": "%2F", "\\": "%5C", "\x00": "%00"}
# Whole names that a zarr node cannot have, or that the store uses itself: their
# first character is percent-encoded too.
_TAKEN = (".", "..", "zarr.json", "_commit")
_NAME_MAX = 255  # Bytes in a file name, on every common file system.


def store_name(key: str) -> str:
  """The zarr array name of a run variable: `key`, percent-encoded where needed.

  Example:
    >>> store_name("grads/fc1.norm"), store_name("100%")
    ('grads%2Ffc1.norm', '100%25')
  """
  name = "".join(_ESCAPES.get(c, c) for c in key)
  return f"%{ord(name[0]):02X}{name[1:]}" if name in _TAKEN else name


def _names_of(api: str, logged: Any) -> list[str]:
  """The variable names of the leaves of `logged`; raises, listing every one that
  cannot be stored."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(logged)[0]]
  names = [_path_name(path) for path in paths]
  bad, first = [], {}
  for path, name in zip(paths, names):
    where = jax.tree_util.keystr(path) or "the logged value itself"
    if name in first:
      bad.append(f"{where} and {first[name]} both have the name {name!r} (tree paths are "
                 "joined with '.'); rename one of them")
    first.setdefault(name, where)
    if not name:
      bad.append(f"{where} has an empty name; log a dict of named values, e.g. "
                 "log.append(step, {'loss': loss})")
    elif name == "step":
      bad.append("'step' is reserved for the step axis; rename the leaf")
    elif len(store_name(name).encode()) > _NAME_MAX:
      bad.append(f"{name!r} is {len(store_name(name).encode())} bytes long as a file name, "
                 f"more than {_NAME_MAX}; use shorter keys")
  if bad:
    raise ValueError(f"{api}: " + "; ".join(bad) + ". Nothing was queued; the log carries on.")
  return names


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

  Attributes:
    dropped: steps dropped for a full queue (`when_full="drop"`), over the run.
    waits: appends that waited for room in a full queue (`when_full="block"`): the
      writer was slower than the steps; `waited_s` says how long they waited.

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
    self._process, self._processes = jax.process_index(), jax.process_count()
    if self._processes > 1 and when_full != "block":
      raise ValueError(
          f"RunLog({self.run_dir!r}, when_full={when_full!r}): in a run of "
          f"{self._processes} processes a dropped step would differ between them. Use "
          "when_full='block' (the default), or a larger queue_size.")
    self._steps_per_chunk = steps_per_chunk
    path = os.path.join(self.run_dir, STORE_NAME)
    try:
      os.makedirs(self.run_dir, exist_ok=True)
      if os.path.exists(path) and not resume:
        raise FileExistsError(
            f"RunLog({self.run_dir!r}): the folder already holds a run. Pass resume=True to "
            "append to it, or choose a new run_dir.")
      if self._processes > 1:
        self._open_many(zarr, path, config, bins)
      else:
        self._open_one(zarr, path, config, bins)
    except OSError as error:
      if isinstance(error, FileExistsError):
        raise
      raise OSError(
          f"RunLog({self.run_dir!r}): cannot write the run folder ({error}). Choose a "
          "writable run_dir.") from error
    self.dropped = int(self._root.attrs.get("dropped_steps", 0))
    self.waits = int(self._root.attrs.get("backpressure_waits", 0))
    self.waited_s = float(self._root.attrs.get("backpressure_seconds", 0.0))
    arrays = {_key(name, array): array for name, array in self._root.arrays()}  # One listing.
    self._layouts = {name: (array.shape[1:], array.dtype, array.chunks[1:])
                     for name, array in arrays.items()}
    # Per tree structure: the variable names, and whether any leaf is on an
    # accelerator (whose copy to the host `append` starts).
    self._names: dict[Any, tuple[list[str], bool]] = {}
    # Leaves of JAX's extra dtypes (bfloat16, ...) stored in standard ones: the
    # dtype logged (the writer's, and an array attribute for `resume`).
    self._logged_dtypes = {name: jnp.dtype(array.attrs[_LOGGED_DTYPE])
                           for name, array in arrays.items() if _LOGGED_DTYPE in array.attrs}
    # Each leaf's (shape, dtype), fixed by the first step that logs it (the training
    # thread's copy, checked at `append`).
    self._specs = {name: (tuple(shape), self._logged_dtypes.get(name, np.dtype(dtype)))
                   for name, (shape, dtype, _) in self._layouts.items() if name != "step"}
    self._last_step = (int(self._root["step"][self._committed - 1])
                       if self._committed and "step" in self._root else None)
    self._pending: list[dict[str, Any]] = []
    self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._when_full = when_full
    self._error: BaseException | None = None
    self._closed = False
    self._writer = threading.Thread(target=self._write_loop, name="gradlog-writer",
                                    daemon=True)
    self._writer.start()

  def _metadata(self, config, bins) -> dict[str, Any]:
    return {
        "committed_steps": self._committed,
        "config": config or self._root.attrs.get("config", {}),
        "versions": _versions(),
        "started": self._root.attrs.get("started", _now()),
        "dropped_steps": int(self._root.attrs.get("dropped_steps", 0)),
        "magnitude_bins": [float(edge) for edge in bins],
        "processes": self._processes,
    }

  def _open_one(self, zarr, path, config, bins) -> None:
    self._root = zarr.open_group(store=path, mode="a")
    if int(self._root.attrs.get("processes", 1)) != 1:
      raise ValueError(
          f"RunLog({self.run_dir!r}, resume=True): the run was written by "
          f"{self._root.attrs['processes']} processes; resume it with as many.")
    self._committed = int(self._root.attrs.get("committed_steps", 0))
    self._truncate_to_committed()
    self._root.attrs.update(self._metadata(config, bins))

  def _open_many(self, zarr, path, config, bins) -> None:
    """Process 0 makes (or cleans up) the store; the others open it after a barrier."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    barrier = f"oryx_gradlog.RunLog({path!r})"
    multihost_utils.sync_global_devices(barrier + " checked")  # Before anyone creates.
    failure = None
    if self._process == 0:
      try:
        self._root = zarr.open_group(store=path, mode="a")
        self._committed = self._read_committed()
        self._clean_after_committed()
        self._root.attrs.update(self._metadata(config, bins))
      except Exception as error:  # noqa: BLE001  (the others must not wait forever)
        failure = error
    # The others learn whether process 0 made the store (a collective, like a barrier).
    ok = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
    if failure is not None:
      raise failure
    if not int(ok):
      raise RuntimeError(
          f"RunLog({self.run_dir!r}): process 0 could not open the store; its error "
          "says why and how to fix it.")
    if self._process != 0:
      self._root = zarr.open_group(store=path, mode="r+")
      self._committed = self._read_committed()
    self._marks = self._root[MARKS]
    self._capacity = _MANY_PROCESS_CAPACITY

  def _clean_after_committed(self) -> None:
    """Resets every process's mark to the committed count; blanks steps written past it.

    A process writes at most one chunk of staged steps past its own mark before it
    advances the mark, so nothing past the largest mark plus one chunk was written.
    Blanking keeps a leaf missing from the resumed steps at its fill value.
    """
    group = self._root.require_group(MARKS.split("/")[0])
    marks = group.require_array(MARKS.split("/")[1], shape=(self._processes,), chunks=(1,),
                                dtype=np.int64, fill_value=0)
    if marks.shape != (self._processes,):
      raise ValueError(
          f"RunLog({self.run_dir!r}, resume=True): the run was written by "
          f"{marks.shape[0]} processes, this one has {self._processes}. Resume with as "
          "many, or log to a new run_dir.")
    written = int(np.max(marks[:]))
    for _, array in self._root.arrays():
      if array.shape[0] > self._committed:
        stop = min(array.shape[0], written + array.chunks[0])
        array[self._committed:stop] = np.full((stop - self._committed, *array.shape[1:]),
                                              array.fill_value, array.dtype)
    marks[:] = self._committed

  def _read_committed(self) -> int:
    written_by = int(self._root.attrs.get("processes", self._processes))
    if "committed_steps" in self._root.attrs and written_by != self._processes:
      raise ValueError(
          f"RunLog({self.run_dir!r}, resume=True): the run was written by {written_by} "
          f"process(es), this one has {self._processes}; the arrays are chunked by "
          "process. Resume with as many processes, or log to a new run_dir.")
    return _committed_of(self._root) if "committed_steps" in self._root.attrs else 0

  # The training thread's side.

  def append(self, step: int, logged: Any) -> None:
    """Queues one step's pytree of arrays for writing; returns without waiting for it.

    Args:
      step: the step number, an integer larger than the last one appended.
      logged: a pytree of numeric or boolean arrays (JAX or NumPy arrays, Python
        or NumPy numbers). Each leaf keeps the shape and dtype of the first step
        that logs it. A key may be left out at some steps (an evaluation metric
        every 100 steps, as TensorBoard and W&B allow): it reads back as missing
        there (NaN; 0 for integers, False for booleans), in `open_run`, the report
        and the TensorBoard export.

    Raises:
      ValueError: `step` is not an integer, or not after the last step appended;
        a leaf's name cannot be stored (empty, `"step"`, longer than a file name
        may be, or the same as another leaf's); a leaf is not a numeric or boolean
        array (a `str`, `None`, an object), or has another shape or dtype than
        its key was first logged with. Nothing is queued and the log carries on.
    """
    self._raise_if_failed("append")
    if self._closed:
      raise RuntimeError(f"RunLog({self.run_dir!r}).append: the log is closed.")
    leaves, treedef = jax.tree_util.tree_flatten(logged)
    known = self._names.get(treedef)
    if known is None:  # Checked once per tree structure.
      names = _names_of("RunLog.append", logged)
      _check_no_none(logged)
      known = self._names[treedef] = (names, any(map(_on_accelerator, leaves)))
    names, on_accelerator = known
    step = self._next_step(step, dry_run=True)
    self._check_values(step, names, leaves)
    self._next_step(step)
    if on_accelerator:  # The writer's `device_get` then finds the copies made.
      for leaf in leaves:
        if _on_accelerator(leaf):
          leaf.copy_to_host_async()
    item = (step, dict(zip(names, leaves)))
    try:
      self._queue.put_nowait(item)
    except queue.Full:
      if self._when_full == "drop":
        self.dropped += 1
        return
      start = time.perf_counter()
      self._queue.put(item)
      self.waits += 1
      self.waited_s += time.perf_counter() - start

  def _check_values(self, step: int, names: list[str], leaves: list[Any]) -> None:
    """Every leaf a numeric or boolean array with the shape and dtype its key was
    first logged with (read from the arrays' metadata: no device transfer)."""
    bad, specs = [], {}
    for name, leaf in zip(names, leaves):
      spec = _spec_of(leaf)
      if isinstance(spec, str):
        bad.append(f"{name!r} is {spec}")
        continue
      known = self._specs.get(name, spec)
      if known != spec:
        bad.append(
            f"{name!r} was logged as {known[1]}{list(known[0])} and is {spec[1]}"
            f"{list(spec[0])} at step {step}: keep each key's shape and dtype (pad, or "
            f"cast with .astype({str(known[1])!r})), or log the new value under another key")
      specs[name] = spec
    if bad:
      raise ValueError("RunLog.append: " + "; ".join(bad) + ". Nothing was queued; the "
                       "log carries on.")
    self._specs.update(specs)

  def _next_step(self, step: Any, dry_run: bool = False) -> int:
    """Returns `step` as an int; raises unless it is an integer after the last step
    (which it becomes, unless `dry_run`)."""
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
    if not dry_run:
      self._last_step = number
    return number

  def describe_examples(self, *, images: Any = None, **columns: Sequence[Any]) -> None:
    """Saves what each example is, once for the run: columns indexed by example id.

    The attribution page of `gl.report` and `python -m oryx_gradlog attribute` show
    them beside every example id (the ids logged under `"ids"`); `open_run(run_dir)
    .attrs["examples"]` gives them back. Values are numbers or short texts (texts
    are cut to 80 characters); small images (digits, thumbnails) are drawn beside
    the ids on the page. A call replaces what an earlier one saved.

    Args:
      images: optional, `(N, H, W)` or `(N, H, W, 3)` images of at most 64 x 64,
        the example with id `i` at index `i` (saved beside the store,
        `open_run(run_dir).attrs["examples_images"]` is its path).
      **columns: per column name (`label`, `text`, ...), one value per example, the
        example with id `i` at index `i`.

    Raises:
      ValueError: nothing given, columns of different lengths, a value that is not a
        number, a boolean or a string, or images of another shape. Nothing is saved
        and the log carries on.

    Example:
      >>> import tempfile, numpy as np, oryx_gradlog as gl
      >>> run_dir = tempfile.mkdtemp()
      >>> with gl.RunLog(run_dir) as log:
      ...   log.describe_examples(label=np.array([3, 1]), text=["a cat", "a dog"])
      ...   log.append(0, {"loss": np.float32(1.0)})
      >>> gl.open_run(run_dir).attrs["examples"]
      {'label': [3, 1], 'text': ['a cat', 'a dog']}
    """
    api = f"RunLog({self.run_dir!r}).describe_examples"
    self._raise_if_failed("describe_examples")
    if not columns and images is None:
      raise ValueError(f"{api}: give at least one column, e.g. describe_examples("
                       "label=labels) with one label per example id.")
    if images is not None:
      images = np.asarray(images)
      if not (images.ndim == 3 or images.ndim == 4 and images.shape[-1] == 3) or max(
          images.shape[1:3]) > _IMAGE_SIDE:
        raise ValueError(
            f"{api}(images=...): images are (N, H, W) or (N, H, W, 3) with H and W at "
            f"most {_IMAGE_SIDE}, got shape {images.shape}; pass small thumbnails "
            "(e.g. images[:, ::4, ::4]).")
    lengths = {name: len(values) for name, values in columns.items()}
    if images is not None:
      lengths["images"] = len(images)
    if len(set(lengths.values())) > 1:
      raise ValueError(f"{api}: the columns have different lengths {lengths}; give each "
                       "one value per example, the example with id i at index i.")
    saved = {}
    for name, values in columns.items():
      column = []
      for i, value in enumerate(values):
        if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
          value = value.item()
        if isinstance(value, str):
          value = value[:_TEXT_LENGTH]
        elif not isinstance(value, (bool, int, float)):
          raise ValueError(f"{api}: {name}[{i}] is {type(value).__name__} {value!r}; "
                           "values are numbers, booleans or short texts (str).")
        column.append(value)
      saved[name] = column
    self._queue.put(_Describe(saved, images))

  def flush(self) -> int:
    """Writes every step appended so far and waits; returns the committed step count.

    In a run of many processes, the count is of the steps this process has written.
    """
    self._queue.put(_FLUSH)
    self._queue.join()
    self._raise_if_failed("flush")
    return self._committed

  @property
  def committed_steps(self) -> int:
    """Steps written in full so far (they survive a crash)."""
    return self._committed

  def close(self) -> None:
    """Flushes, saves the drop and backpressure counts and stops the writer thread."""
    if self._closed:
      return
    self._closed = True
    self._queue.put(_STOP)
    self._writer.join()
    if self._error is None and self._processes == 1:
      self._truncate_to_committed()  # Exact shapes for plain zarr readers.
      self._root.attrs.update({"dropped_steps": self.dropped,
                               "backpressure_waits": self.waits,
                               "backpressure_seconds": self.waited_s})
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
      advice = ("Free disk space or make the folder writable, then continue with "
                "RunLog(run_dir, resume=True)." if isinstance(self._error, OSError) else
                "Continue with RunLog(run_dir, resume=True); the failed step is not in "
                "the store.")
      raise RuntimeError(
          f"RunLog({self.run_dir!r}).{api}: writing a step failed: {self._error}. The "
          f"{self._committed} steps before it are saved intact. {advice}"
      ) from self._error

  # The writer thread's side.

  def _write_loop(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if self._error is None:
          if item is _STOP or item is _FLUSH:
            self._commit()
          elif isinstance(item, _Describe):
            if self._process == 0:
              self._root.attrs["examples"] = item.columns
              path = os.path.join(self.run_dir, _IMAGES_NAME)
              if item.images is not None:
                np.save(path, item.images)
              elif os.path.exists(path):
                os.remove(path)
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

  def _stage(self, step: int, flat: dict[str, Any]) -> None:
    """Copies one step to the host and checks it; writes once a chunk of steps is full."""
    flat = {**flat, "step": np.asarray(step, np.int64)}
    leaves, layouts = {}, {}
    for name, value in flat.items():
      leaves[name], layouts[name] = self._local_parts(name, value)
    for name, (shape, dtype, chunk) in layouts.items():
      known = self._layouts.setdefault(name, (shape, dtype, chunk))
      if known[:2] != (shape, dtype):
        self._commit()  # Keep the good steps before the bad one.
        raise ValueError(
            f"RunLog.append: {name!r} changed from {known[1]}{list(known[0])} to "
            f"{dtype}{list(shape)} at step {step}. Keep leaves fixed in shape "
            "and dtype, or log the new one under another name.")
      if known[2] != chunk:
        self._commit()
        raise ValueError(
            f"RunLog.append: {name!r} changed its sharding at step {step}: its shards "
            f"were {list(known[2])}, now {list(chunk)}. Keep each logged leaf sharded "
            "the same way every step, or log it under another name.")
    self._pending.append(leaves)
    if len(self._pending) == self._steps_per_chunk:
      self._commit()

  def _local_parts(self, name: str, value: Any):
    """Returns `({region: host array}, (shape, dtype, chunk))`: what this process writes.

    A region is a tuple of `(start, stop)` per axis of the leaf. One process holds
    the whole leaf (region: all of it); in a run of many processes, a global array's
    `replica_id == 0` shards held here, or a host value on process 0.
    """
    if self._processes > 1 and isinstance(value, jax.Array) and not value.is_fully_addressable:
      dtype = self._stored_dtype(name, np.dtype(value.dtype))
      chunk = tuple(value.sharding.shard_shape(value.shape))
      parts = {}
      for shard in value.addressable_shards:
        if shard.replica_id == 0:
          region = tuple(index.indices(size)[:2]
                         for index, size in zip(shard.index, value.shape, strict=True))
          if tuple(stop - start for start, stop in region) != chunk:
            raise ValueError(
                f"RunLog.append: {name!r} of shape {list(value.shape)} is split into "
                f"uneven shards ({shard.data.shape} at {region}, others {chunk}); each "
                "process writes whole chunks of one shard. Pad the leaf so its sharded "
                "axes divide evenly by the mesh axes, or log it replicated.")
          parts[region] = np.asarray(shard.data).astype(dtype, copy=False)
      return parts, (tuple(value.shape), dtype, chunk)
    host = np.asarray(jax.device_get(value))
    host = host.astype(self._stored_dtype(name, host.dtype), copy=False)
    whole = tuple((0, size) for size in host.shape)
    parts = {whole: host} if self._process == 0 else {}
    return parts, (host.shape, host.dtype, host.shape)

  def _stored_dtype(self, name: str, dtype: np.dtype) -> np.dtype:
    """The dtype zarr stores `name`'s `dtype` in, remembering `dtype` if another."""
    stored = _stored(dtype)
    if stored != dtype:
      self._logged_dtypes.setdefault(name, dtype)
    return stored

  def _commit(self) -> None:
    """Writes the staged steps to every array, then advances `committed_steps`."""
    if not self._pending:
      return
    start, stop = self._committed, self._committed + len(self._pending)
    if stop > self._capacity:  # Grow every array at once, rarely.
      self._capacity = max(2 * self._capacity, stop, 4 * self._steps_per_chunk)
      for _, array in self._root.arrays():
        array.resize((self._capacity, *array.shape[1:]))
    for name, (shape, dtype, chunk) in self._layouts.items():
      if store_name(name) not in self._root:
        self._create_array(name, shape, dtype, chunk)
      array = self._root[store_name(name)]
      regions = sorted({region for leaves in self._pending for region in leaves.get(name, {})})
      for region in regions:  # Missing from a step: the fill value.
        fill = np.full([stop_ - start_ for start_, stop_ in region], array.fill_value, dtype)
        array[(slice(start, stop), *(slice(*bounds) for bounds in region))] = (
            np.stack([leaves.get(name, {}).get(region, fill) for leaves in self._pending]))
    if self._processes > 1:
      self._marks[self._process] = stop  # This process's commit point.
    else:
      self._root.attrs["committed_steps"] = stop  # The commit point.
    self._committed, self._pending = stop, []

  def _create_array(self, name, shape, dtype, chunk) -> None:
    dims = ["step"] if name == "step" else ["step", *self._leading_dims(name, len(shape))]
    try:
      self._root.create_array(
          store_name(name), shape=(self._capacity, *shape),
          chunks=(self._steps_per_chunk, *chunk), dtype=dtype,
          fill_value=-1 if name == "step" else _fill(dtype), dimension_names=dims,
          attributes={**({} if store_name(name) == name else {"key": name}),
                      **({_LOGGED_DTYPE: self._logged_dtypes[name].name}
                         if name in self._logged_dtypes else {})})
    except Exception:  # Another process made it first (the same metadata): use it.
      if self._processes == 1 or store_name(name) not in self._root:
        raise

  def _truncate_to_committed(self) -> None:
    for _, array in self._root.arrays():
      if array.shape and array.shape[0] != self._committed:
        array.resize((self._committed, *array.shape[1:]))
    self._capacity = self._committed


def _spec_of(leaf: Any) -> tuple[tuple, np.dtype] | str:
  """`(shape, dtype)` of a numeric or boolean array-like leaf, else what it is and
  what to log instead."""
  if isinstance(leaf, (str, bytes)):
    return (f"a {type(leaf).__name__} ({leaf!r:.40}): log numbers or arrays; keep text "
            "in the run's config, or log an integer code")
  if isinstance(leaf, (bool, int, float, complex, np.generic, np.ndarray, jax.Array)):
    dtype = getattr(leaf, "dtype", None)  # An array's: no transfer from the device.
    dtype = np.asarray(leaf).dtype if dtype is None else np.dtype(dtype)
    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number):
      return tuple(np.shape(leaf)), dtype
    return (f"an array of dtype {dtype}: log numeric or boolean arrays (encode text or "
            "objects as numbers)")
  if hasattr(leaf, "__array__"):  # Another array type (a masked array, a tensor).
    return _spec_of(np.asarray(leaf))
  return (f"a {type(leaf).__module__}.{type(leaf).__qualname__}, not an array: log its "
          "numeric fields (e.g. a dict of arrays), or register it as a pytree")


def _on_accelerator(leaf: Any) -> bool:
  """A JAX array held by this process on a device other than the host's CPU."""
  return (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
          and any(device.platform != "cpu" for device in leaf.devices()))


def _check_no_none(logged: Any) -> None:
  """A key of the logged mapping whose value is `None` would be dropped silently by
  the tree flattening: an error. (`None` deeper in a value, as records and
  summaries hold it for what has no cotangent, is a pytree's empty node: skipped.)"""
  if not isinstance(logged, Mapping):
    return
  missing = [repr(key) for key, value in logged.items() if value is None]
  if missing:
    raise ValueError(
        f"RunLog.append: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} None, "
        "which would not be stored. Leave the key out of the step instead (it reads back "
        "as missing there), or log a number (NaN for a value not measured). Nothing was "
        "queued; the log carries on.")


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


def _stored(dtype: np.dtype) -> np.dtype:
  """The dtype zarr stores `dtype` in: itself, or, for JAX's extra types (ml_dtypes'
  bfloat16, float8_*, int4, ...), which zarr has no type for, the standard type
  that holds each of their values exactly (float32, int8, uint8)."""
  if dtype.kind != "V":
    return dtype
  if jnp.issubdtype(dtype, jnp.inexact):
    return np.dtype(np.float32)
  return np.dtype(np.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else np.uint8)


def _fill(dtype) -> Any:
  return float("nan") if np.issubdtype(dtype, np.inexact) else 0


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _committed_of(root) -> int:
  """The run's committed steps: the smallest process mark, or the one process's count."""
  if int(root.attrs.get("processes", 1)) > 1 and MARKS.split("/")[0] in root:
    return int(np.min(root[MARKS][:]))
  return int(root.attrs.get("committed_steps", 0))


def find_runs(folder: str | os.PathLike) -> list[str]:
  """The run folders (folders holding a `log.zarr`) in and below `folder`, sorted."""
  runs = []
  for parent, children, _ in os.walk(os.fspath(folder)):
    if STORE_NAME in children:
      runs.append(parent)
    # Not into stores, nor into what report and export_tensorboard write.
    children[:] = [c for c in children if c not in (STORE_NAME, "report", "tensorboard")]
  return sorted(runs)


def run_folder(run_dir: str | os.PathLike, api: str) -> str:
  """The run folder of `run_dir`: itself, or its parent when given its `log.zarr`.

  Raises:
    FileNotFoundError: `run_dir` holds no run, naming the runs below it if any.
  """
  run_dir = os.fspath(run_dir)
  if os.path.basename(os.path.normpath(run_dir)) == STORE_NAME and os.path.isdir(run_dir):
    return os.path.dirname(os.path.normpath(run_dir)) or "."
  path = os.path.join(run_dir, STORE_NAME)
  if os.path.isdir(path):
    return run_dir
  runs = find_runs(run_dir) if os.path.isdir(run_dir) else []
  if runs:
    listed = ", ".join(repr(r) for r in runs[:10]) + (", ..." if len(runs) > 10 else "")
    raise FileNotFoundError(
        f"{api}({run_dir!r}): this folder holds {len(runs)} runs, not one ({listed}). "
        f"Pass one of them; `python -m oryx_gradlog report {run_dir}` reports each.")
  raise FileNotFoundError(f"{api}({run_dir!r}): no run here ({path} is missing). Pass "
                          "the run_dir given to RunLog (the folder that holds log.zarr).")


def open_run(run_dir: str | os.PathLike):
  """Opens a run as an `xarray.Dataset` of its committed steps, with its metadata.

  Variables are the logged leaves (`dense.summary.norm`, ...), under the names they
  were logged with (`"opt/lr"` included), indexed by `step` (the step numbers passed
  to `append`) and the dims given to `RunLog`; `attrs` holds `config`, `versions`,
  `committed_steps` and `dropped_steps`.

  `run_dir` is the folder given to `RunLog`, or the `log.zarr` store in it.

  Raises:
    FileNotFoundError: `run_dir` holds no run (the error names the runs below it).
    ValueError: the run has no committed step yet (a live run before its first
      write).

  Example:
    >>> import tempfile, jax.numpy as jnp, oryx_gradlog as gl
    >>> run_dir = tempfile.mkdtemp()
    >>> with gl.RunLog(run_dir) as log:
    ...   log.append(0, {"opt/lr": jnp.float32(0.5)})
    ...   log.append(10, {"opt/lr": jnp.float32(0.25)})
    >>> run = gl.open_run(run_dir)
    >>> run["opt/lr"].values, run["step"].values.tolist(), run.attrs["committed_steps"]
    (array([0.5 , 0.25], dtype=float32), [0, 10], 2)
  """
  xarray = _require("xarray", "open_run")
  path = os.path.join(run_folder(run_dir, "open_run"), STORE_NAME)
  zarr = _require("zarr", "open_run")
  root = zarr.open_group(store=path, mode="r")
  committed = _committed_of(root)
  if not committed:
    raise ValueError(
        f"open_run({os.fspath(run_dir)!r}): the run has no committed step yet. RunLog "
        "writes steps a chunk at a time (steps_per_chunk) and at log.flush() or "
        "log.close(); open the run again once it has written a step.")
  many = int(root.attrs.get("processes", 1)) > 1
  if many:  # Arrays 2**40 steps long: index lazily (no dask), step coordinate cut first.
    dataset = xarray.open_zarr(path, consolidated=False, chunks=None, drop_variables=["step"])
    dataset = dataset.isel(step=slice(0, committed))
    dataset.attrs["committed_steps"] = committed
    steps = root["step"][:committed] if "step" in root else np.arange(committed)
    dataset = dataset.assign_coords(step=steps).load()
  else:
    dataset = xarray.open_zarr(path, consolidated=False)
    dataset = dataset.isel(step=slice(0, committed))
    dataset = dataset.assign_coords(step=dataset["step"].values)
  keys = {name: dataset[name].attrs.pop("key") for name in dataset.data_vars
          if "key" in dataset[name].attrs}
  images = os.path.join(os.path.dirname(path), _IMAGES_NAME)
  if os.path.exists(images):
    dataset.attrs["examples_images"] = images
  return dataset.rename_vars(keys)


def _key(name: str, array) -> str:
  """The variable name of a zarr array of a run: its `key` attribute, else its name."""
  return array.attrs.get("key", name)
