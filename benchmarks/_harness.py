"""Side-by-side timing, compiled-memory and HLO statistics for the benchmarks.

Every workload compares variants of one step (the plain gradient, the recorded
gradient, an alternative way of getting the same values). The machines these run on
are shared, so load drifts over seconds and absolute times wander; what is stable is
the ratio of two variants measured next to each other. Hence:

* All variants of a workload run in one process. A warm-up first compiles each one
  and runs it, so compile time is never inside a timed block.
* Rounds alternate the variants (A B C, then C B A, ...). In a round each variant
  runs a block of back-to-back calls, long enough to dwarf the timer, and every call
  waits for all its outputs with `jax.block_until_ready` (and for its host callbacks
  with `jax.effects_barrier` where it has any).
* A variant's time is the median over rounds of its per-call time. A ratio is the
  median over rounds of the per-round ratio, so a load spike that hits one round
  hits both sides of that round's ratio; the interquartile range of the per-round
  ratios says how noisy it was.
* Memory is XLA's own analysis of the compiled program
  (`jax.jit(f).lower(...).compile().memory_analysis()`): temporaries, outputs, and a
  peak estimate (arguments + outputs + temporaries - aliased). It is exact for the
  program and blind to the Python heap (e.g. a host callback's list).
* Minor page faults per call (`getrusage`) are counted around each timed block:
  on CPU, outputs are fresh host allocations every call, and with glibc's default
  malloc each large one is a new `mmap` whose pages fault on first touch. That cost
  grows with output bytes, whatever computes them, and is shown next to the times.
* HLO statistics count the top-level instructions of the optimized program
  (`compile().as_text()`): matmuls (`dot`), `copy`s and the bytes they move,
  fusions, and custom calls (host callbacks). They are the evidence for explaining
  a ratio.

Sharp edges:
  * Nothing here asserts on time: the benchmarks print ratios and mark targets as
    met or missed; the test suite only checks that the harness runs.
  * The number of rounds adapts to the variants' speed (`Settings.budget_s`) between
    `min_rounds` and `max_rounds`; blocks are short (a few ms) so that the two
    sides of a ratio run within milliseconds of each other.
  * Variants are compiled twice, once by `jax.jit` for timing and once by
    `lower().compile()` for the memory analysis and the HLO text.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

try:
  import resource
except ImportError:  # Not on Unix: no page-fault counts.
  resource = None


@dataclasses.dataclass(frozen=True)
class Settings:
  """How a benchmark run is done.

  Attributes:
    quick: scaled-down sizes and fewer rounds, for a smoke run.
    device: `"cpu"`, `"tpu"` or `"gpu"`; everything runs on the first device of that
      kind.
    max_rounds: at most this many timed rounds per comparison (each round times
      every variant once).
    min_rounds: at least this many, however slow the variants.
    budget_s: aim for this many seconds of timed rounds per comparison.
    min_block_s: a timed block of back-to-back calls lasts at least this long.
    compile_rounds: rounds of trace+compile timing (workload 6).
  """

  quick: bool = False
  device: str = "cpu"
  max_rounds: int = 201
  min_rounds: int = 15
  budget_s: float = 20.0
  min_block_s: float = 0.005
  compile_rounds: int = 9
  dtypes: tuple[str, ...] = ("float32", "bfloat16")

  @classmethod
  def make(cls, quick: bool, device: str = "cpu",
           dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> Settings:
    if quick:
      return cls(quick=True, device=device, max_rounds=41, min_rounds=7, budget_s=1.5,
                 compile_rounds=3, dtypes=dtypes)
    # An accelerator's steps are short and steady, and its compiles long: fewer rounds.
    budget = 20.0 if device == "cpu" else 8.0
    return cls(quick=False, device=device, budget_s=budget, dtypes=dtypes)

  @property
  def judge_targets(self) -> bool:
    """Targets are judged on a CPU and a TPU (each workload's own, see `target`); on
    a GPU only absolute times and ratios are shown."""
    return self.device in ("cpu", "tpu")

  def target(self, cpu: Target | None, tpu: Target | None = None) -> Target | None:
    """The target of this run's device: `cpu` on a CPU, `tpu` on a TPU."""
    return tpu if self.device == "tpu" else cpu


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way of computing a workload's step.

  Attributes:
    label: what it is, for tables.
    fn: a `jax.jit`-wrapped function.
    args: the positional arguments it is timed with.
    reset: called, untimed, before each timed block (e.g. to empty a host list).
    host_effects: after each call also wait for host callbacks.
  """

  label: str
  fn: Callable[..., Any]
  args: tuple
  reset: Callable[[], None] | None = None
  host_effects: bool = False

  def __call__(self) -> Any:
    """Runs the step once and waits for all its outputs (and host callbacks)."""
    out = jax.block_until_ready(self.fn(*self.args))
    if self.host_effects:
      jax.effects_barrier()
    return out


@dataclasses.dataclass
class Measurement:
  """Per-round times of one variant, and what XLA says about its program.

  Attributes:
    label: the variant's label.
    seconds: per-call seconds, one entry per round, in round order.
    faults: minor page faults per call, one entry per round.
    memory: compiled-memory statistics in bytes (see `memory_stats`), or empty.
    hlo: HLO instruction statistics (see `hlo_stats`), or empty.
    hlo_text: the optimized program (`compile().as_text()`), or empty.
    compile_s: seconds its ahead-of-time lower and compile took, or `None`.
  """

  label: str
  seconds: list[float]
  faults: list[float] = dataclasses.field(default_factory=list)
  memory: dict[str, int] = dataclasses.field(default_factory=dict)
  hlo: dict[str, int] = dataclasses.field(default_factory=dict)
  hlo_text: str = dataclasses.field(default="", repr=False)
  compile_s: float | None = None

  @property
  def median_s(self) -> float:
    return statistics.median(self.seconds)

  @property
  def median_faults(self) -> float | None:
    return statistics.median(self.faults) if self.faults else None


@dataclasses.dataclass(frozen=True)
class Target:
  """A bound on a ratio (or on a spread of ratios): `<= bound` or `>= bound`."""

  bound: float
  at_most: bool = True

  def met(self, value: float) -> bool:
    return value <= self.bound if self.at_most else value >= self.bound

  def __str__(self) -> str:
    return f"{'<=' if self.at_most else '>='} {self.bound:.2f}"


@dataclasses.dataclass
class Comparison:
  """One line of the results table: a variant against a baseline.

  Attributes:
    workload: the workload's number.
    what: the measured variant (or quantity).
    baseline: what it is divided by.
    value: the median per-round ratio (or the quantity itself).
    low: lower quartile of the per-round ratios (None when not a ratio).
    high: upper quartile of the per-round ratios (None when not a ratio).
    target: the bound the table judges, or None for information only.
    judged: whether the target is judged in this run (targets are CPU targets).
    explanation: why a missed target is missed and what would fix it (markdown).
  """

  workload: int
  what: str
  baseline: str
  value: float
  low: float | None = None
  high: float | None = None
  target: Target | None = None
  judged: bool = True
  explanation: str = ""

  @property
  def status(self) -> str:
    if self.target is None:
      return "info"
    if not self.judged:
      return "not judged (gpu)"
    return "met" if self.target.met(self.value) else "MISSED"


@dataclasses.dataclass
class WorkloadResult:
  """What one workload measured.

  Attributes:
    number: the workload's number in the issue.
    title: one line saying what is compared.
    measurements: per-variant timings, memory and HLO statistics, by key.
    comparisons: the table lines.
    notes: extra markdown lines for RESULTS.md (sizes, checks done).
    unit: how `Measurement.seconds` are best shown ("ms" or "s").
  """

  number: int
  title: str
  measurements: dict[str, Measurement]
  comparisons: list[Comparison]
  notes: list[str] = dataclasses.field(default_factory=list)
  unit: str = "ms"


def device_for(settings: Settings) -> jax.Device:
  """Returns the device the run uses; exits with the fix when there is none."""
  try:
    return jax.devices(settings.device)[0]
  except RuntimeError as error:
    raise SystemExit(
        f"benchmarks --device {settings.device}: JAX finds no {settings.device} backend "
        f"({error}). On a GPU machine install a CUDA jaxlib matching your jax, e.g. "
        'pip install "jax[cuda12]==0.5.0"; on a TPU machine "jax[tpu]" (or see '
        "../shared/tpu/README.md); or run with --device cpu."
    ) from error


def cache_compiles(settings: Settings) -> None:
  """On an accelerator, keeps compiled programs in JAX's persistent cache for the run.

  Each variant is compiled by `lower().compile()` for its memory analysis and again
  by `jax.jit` for timing; a 12-block decoder's step compiles in 15-50 s on a TPU,
  so the second compile is read back from a fresh cache folder instead.
  """
  if settings.device == "cpu" or jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="bench-cache-"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def memory_stats(compiled: Any) -> dict[str, int]:
  """Returns the compiled program's memory analysis in bytes.

  Args:
    compiled: a `jax.stages.Compiled`.

  Returns:
    `temp`, `output`, `argument`, `alias`, `code` and `peak` (arguments + outputs +
    temporaries - aliased, XLA's live-set bound for the whole program); empty when
    the backend gives no analysis.
  """
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  stats = {
      "temp": analysis.temp_size_in_bytes,
      "output": analysis.output_size_in_bytes,
      "argument": analysis.argument_size_in_bytes,
      "alias": analysis.alias_size_in_bytes,
      "code": analysis.generated_code_size_in_bytes,
  }
  stats["peak"] = stats["argument"] + stats["output"] + stats["temp"] - stats["alias"]
  return stats


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (?P<type>.*?) (?P<op>[a-z][a-z0-9\-]*)\(")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ANY_PRODUCT = re.compile(r" (?:dot|convolution)\(")
_ARRAY_TYPE = re.compile(r"(?P<dtype>[a-z]+)(?P<bits>\d+)\[(?P<dims>[0-9,]*)\]")


def _bytes_of(hlo_type: str) -> int:
  total = 0
  for match in _ARRAY_TYPE.finditer(hlo_type):
    dims = [int(d) for d in match["dims"].split(",") if d]
    total += math.prod(dims) * max(1, int(match["bits"]) // 8)
  return total


def hlo_stats(hlo_text: str) -> dict[str, int]:
  """Counts the top-level instructions of an optimized HLO module's entry.

  Args:
    hlo_text: `compiled.as_text()`.

  Returns:
    `dots` (with cuBLAS matmul custom calls on GPU), `copies`, `copy_bytes`,
    `fusions` (fusions, and on CPU the calls to parallel fusions), `custom_calls`
    (the others: host callbacks) and `instructions`, of the entry computation;
    `all_dots`, the dots and convolutions of the whole module (inside fusions too).
  """
  stats = {name: 0 for name in (
      "dots", "copies", "copy_bytes", "fusions", "custom_calls", "instructions")}
  # On a TPU every product sits inside a fusion: count them in the whole module.
  stats["all_dots"] = len(_ANY_PRODUCT.findall(hlo_text))
  in_entry = False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      in_entry = True
      continue
    if in_entry and line.startswith("}"):
      break
    match = _INSTRUCTION.match(line) if in_entry else None
    if match is None:
      continue
    op = match["op"]
    stats["instructions"] += 1
    target = _CUSTOM_CALL_TARGET.search(line) if op == "custom-call" else None
    if op == "dot" or (target and ("gemm" in target[1] or "matmul" in target[1])):
      stats["dots"] += 1  # On GPU a matmul is a cuBLAS custom call.
    elif op == "copy":
      stats["copies"] += 1
      stats["copy_bytes"] += _bytes_of(match["type"])
    elif op == "fusion" or (op == "call" and "fusion" in line.split("to_apply=")[-1]):
      stats["fusions"] += 1
    elif op == "custom-call":
      stats["custom_calls"] += 1
  return stats


def analyse(variant: Variant) -> tuple[dict[str, int], dict[str, int], str, float]:
  """Compiles `variant` ahead of time; returns its memory and HLO statistics, its
  optimized HLO text and the seconds the lower and compile took."""
  start = time.perf_counter()
  compiled = variant.fn.lower(*variant.args).compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  stats = hlo_stats(text)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  if cost and cost.get("flops", -1) >= 0:
    stats["flops"] = int(cost["flops"])  # XLA's count for the whole program.
  return memory_stats(compiled), stats, text, seconds


def _minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def measure(variants: dict[str, Variant], settings: Settings) -> dict[str, Measurement]:
  """Times variants side by side in interleaved rounds (see the module docstring).

  Args:
    variants: the variants to compare, by key.
    settings: rounds and block length.

  Returns:
    A `Measurement` per key, with per-round per-call seconds, memory and HLO
    statistics.
  """
  analyses = {key: analyse(v) for key, v in variants.items()}
  calls, round_s = {}, 0.0
  for key, variant in variants.items():  # Warm up: compile, run, then size a block.
    variant()
    if variant.reset:
      variant.reset()
    start = time.perf_counter()
    variant()
    once = max(time.perf_counter() - start, 1e-6)
    calls[key] = max(1, math.ceil(settings.min_block_s / once))
    round_s += calls[key] * once
  rounds = int(settings.budget_s / round_s)
  rounds = max(settings.min_rounds, min(settings.max_rounds, rounds)) | 1  # Odd: a median.
  seconds = {key: [] for key in variants}
  faults = {key: [] for key in variants}
  keys = list(variants)
  for round_index in range(rounds):
    for key in keys if round_index % 2 == 0 else reversed(keys):
      variant = variants[key]
      if variant.reset:
        variant.reset()
      faults_before = _minor_faults()
      start = time.perf_counter()
      for _ in range(calls[key]):
        variant()
      seconds[key].append((time.perf_counter() - start) / calls[key])
      faults[key].append((_minor_faults() - faults_before) / calls[key])
  return {
      key: Measurement(variants[key].label, seconds[key], faults[key], *analyses[key])
      for key in variants
  }


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
  if len(values) == 1:
    return values[0], values[0], values[0]
  low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
  return low, mid, high


def compare(
    workload: int,
    measurements: dict[str, Measurement],
    key: str,
    baseline: str,
    target: Target | None,
    settings: Settings,
    explanation: str = "",
) -> Comparison:
  """Returns the median and quartiles of the per-round ratios `key / baseline`."""
  ratios = [a / b for a, b in zip(measurements[key].seconds, measurements[baseline].seconds)]
  low, mid, high = _quartiles(ratios)
  return Comparison(
      workload=workload,
      what=measurements[key].label,
      baseline=measurements[baseline].label,
      value=mid,
      low=low,
      high=high,
      target=target,
      judged=settings.judge_targets,
      explanation=explanation,
  )


def describe_hlo_difference(variant: Measurement, baseline: Measurement) -> str:
  """Says, from HLO and memory statistics, what `variant`'s program adds."""
  v, b = variant.hlo, baseline.hlo
  parts = [(
      f"`{variant.label}` has {v['dots']} dots, {v['copies']} copies "
      f"({v['copy_bytes'] / 2**20:.2f} MiB copied), {v['fusions']} fusions and "
      f"{v['custom_calls']} custom calls; `{baseline.label}` has {b['dots']} dots, "
      f"{b['copies']} copies ({b['copy_bytes'] / 2**20:.2f} MiB), {b['fusions']} fusions "
      f"and {b['custom_calls']} custom calls."
  )]
  if variant.memory and baseline.memory:
    parts.append(
        f"Outputs {mib(variant.memory['output'])} vs {mib(baseline.memory['output'])} MiB, "
        f"temporaries {mib(variant.memory['temp'])} vs {mib(baseline.memory['temp'])} MiB."
    )
  return " ".join(parts)


def mib(n_bytes: int | None) -> str:
  return "-" if n_bytes is None else f"{n_bytes / 2**20:.2f}"


def machine_description(settings: Settings) -> dict[str, str]:
  """Returns what the numbers were measured on, for RESULTS.md."""
  cpu = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count()
  device = device_for(settings)
  try:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    load = "unknown"
  from importlib import metadata

  def version(package):
    try:
      return metadata.version(package)
    except metadata.PackageNotFoundError:
      return "not installed"

  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "cpu": cpu,
      "cores": f"{os.cpu_count()} ({usable} usable by this process)",
      "load average (1, 5, 15 min) at start": load,
      "device": f"{device.platform} ({device.device_kind})",
      "jax default backend": jax.default_backend(),
      "versions": (
          f"jax {version('jax')}, jaxlib {version('jaxlib')}, oryx {version('oryx')}, "
          f"python {platform.python_version()}"
      ),
  }


COMPARISON_HEADER = [
    "| # | variant | vs | ratio (median) | IQR of per-round ratios | target | status |",
    "|---|---|---|---|---|---|---|",
]


def format_comparison(c: Comparison) -> str:
  """Returns one markdown row of the results table."""
  spread = "-" if c.low is None else f"{c.low:.3f} - {c.high:.3f}"
  value = f"{c.value:.3f}" + ("x" if c.low is not None else "")
  target = "-" if c.target is None else str(c.target)
  return (
      f"| {c.workload} | {c.what} | {c.baseline} | {value} | {spread} | {target} | "
      f"{c.status} |"
  )


def format_comparisons(comparisons: Sequence[Comparison]) -> list[str]:
  """Returns the markdown lines of the results table."""
  return COMPARISON_HEADER + [format_comparison(c) for c in comparisons]


def format_measurements(result: WorkloadResult) -> list[str]:
  """Returns markdown lines with each variant's time, memory and HLO counts."""
  scale = 1e3 if result.unit == "ms" else 1.0
  lines = [
      (f"| variant | median ({result.unit}) | page faults/call | temp MiB | output MiB | "
       "peak MiB | dots | copies (MiB) | fusions | custom calls |"),
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for m in result.measurements.values():
    mem, hlo = m.memory, m.hlo
    copies = f"{hlo['copies']} ({hlo['copy_bytes'] / 2**20:.2f})" if hlo else "-"
    faults = "-" if m.median_faults is None else f"{m.median_faults:.0f}"
    lines.append(
        f"| {m.label} | {m.median_s * scale:.3f} | {faults} | {mib(mem.get('temp'))} | "
        f"{mib(mem.get('output'))} | {mib(mem.get('peak'))} | {hlo.get('dots', '-')} | "
        f"{copies} | {hlo.get('fusions', '-')} | {hlo.get('custom_calls', '-')} |"
    )
  return lines


def print_result(result: WorkloadResult, stream=sys.stdout) -> None:
  """Prints one workload's comparisons and measurements as markdown."""
  print(f"\n## {result.number}. {result.title}\n", file=stream)
  print("\n".join(format_comparisons(result.comparisons)), file=stream)
  print(file=stream)
  print("\n".join(format_measurements(result)), file=stream)
  for note in result.notes:
    print(f"- {note}", file=stream)


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the flags every benchmark script takes: `--quick`, `--device`, `--malloc`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true", help="scaled-down sizes, a smoke run")
  parser.add_argument("--device", choices=DEVICES, default="cpu")
  parser.add_argument(
      "--malloc", choices=("retain", "system"), default="retain",
      help="retain: glibc keeps freed memory (no page faults per call, steadier "
      "ratios); system: glibc's defaults")
  add_dtypes_flag(parser)
  return parser.parse_args(argv)


DEVICES = ("cpu", "tpu", "gpu")


def add_dtypes_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--dtypes", default="float32,bfloat16",
      help="the computation dtypes of the workloads that take several (15), "
      "comma-separated")


def dtypes_of(args: argparse.Namespace) -> tuple[str, ...]:
  dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
  unknown = set(dtypes) - {"float32", "bfloat16"}
  if unknown or not dtypes:
    raise SystemExit(f"--dtypes {args.dtypes!r}: choose from float32,bfloat16")
  return dtypes


def retain_freed_memory() -> str:
  """Tells glibc's malloc to keep freed memory instead of returning it to the OS.

  On CPU every call allocates its outputs afresh. By default glibc serves large
  blocks with `mmap` and trims freed memory, so each call's outputs page-fault on
  first touch, and how many do varies with the heap's history (we measured 85 to
  960 faults per call for the same program). With an mmap threshold of 32 MiB
  and no trimming, the pages are reused and the faults go away, which takes a
  large and erratic noise source out of the ratios.

  Returns:
    A description of the allocator setting, for RESULTS.md.
  """
  try:
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
    ok = libc.mallopt(m_trim_threshold, 1 << 30) == 1 and ok
  except (OSError, AttributeError):
    ok = False
  if not ok:
    return "system default (glibc mallopt unavailable)"
  return "glibc malloc told to retain freed memory (mallopt: mmap threshold 32 MiB, no trim)"


def main(run: Callable[[Settings], WorkloadResult], description: str) -> None:
  """Runs one workload script from the command line and prints its tables."""
  args = parse_args(description)
  settings = Settings.make(args.quick, args.device, dtypes_of(args))
  cache_compiles(settings)
  if args.malloc == "retain":
    retain_freed_memory()
  with jax.default_device(device_for(settings)):
    print_result(run(settings))
