"""Runs every benchmark workload and writes the results table to RESULTS.md.

Each workload script (`bench_*.py`) compares ways of computing one training step
side by side in one process (see `_harness.py` for the method: interleaved rounds,
medians of per-round ratios, compile time excluded, `block_until_ready` on every
output, XLA's memory analysis of each compiled program). This runner runs them in
turn, prints one table of ratios with each target marked met or missed, and
writes `benchmarks/results/{cpu,tpu,gpu}-jax-VERSION.md` with the machine, the date,
every variant's time, memory and HLO counts, and for each missed target what the
HLO says and what would fix it, plus the same ratios as JSON. Then it rewrites
`benchmarks/RESULTS.md`: the ratios of every JAX version and device in `results/`
side by side (`make bench` for JAX 0.5.0, `make bench-set SET=jax-0.10.2`), keeping
the hand-written sections below the table (from its first `## ` heading on).

Run:
  python benchmarks/run.py              # full sizes (a few minutes), writes results/
  python benchmarks/run.py --quick      # scaled-down smoke run (under a minute)
  python benchmarks/run.py --device tpu # on a TPU: each workload's TPU targets
                                        # (results/tpu-jax-VERSION*.md); add
                                        # JAX_DEFAULT_MATMUL_PRECISION=highest to compare
  python benchmarks/run.py --device gpu # on a GPU: absolute times, targets not judged
  python benchmarks/run.py --only 1,3   # some workloads (a full run of some workloads
                                        # writes results/DEVICE-jax-VERSION-w1-3.md)

A `--quick` run prints its tables but writes a file only when given `--output`, so
that a smoke run never replaces the full results.

Sharp edges:
  * The results file and its .json are written again after each workload, so a run
    cut short (a device call's time limit) keeps the workloads it finished;
    RESULTS.md is rewritten once, at the end.
  * By default glibc's malloc is told to keep freed memory (`--malloc retain`, see
    `_harness.retain_freed_memory`). A full CPU run first measures workload 1 with the
    system's defaults too, so the table shows what page faults add.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax

import _harness as h
import bench_any_model
import bench_architectures
import bench_attribution
import bench_compile_time
import bench_disk_stream
import bench_dp
import bench_full_records
import bench_host_callback
import bench_instruments
import bench_multihost
import bench_running_stats
import bench_scaling
import bench_summaries
import bench_train_size
import bench_zero_perturbation

HERE = pathlib.Path(__file__).resolve().parent
WORKLOADS = {
    1: bench_full_records,
    2: bench_host_callback,
    3: bench_zero_perturbation,
    4: bench_summaries,
    5: bench_running_stats,
    6: bench_compile_time,
    7: bench_scaling,
    8: bench_disk_stream,
    9: bench_dp,
    10: bench_instruments,
    11: bench_multihost,
    12: bench_any_model,
    13: bench_attribution,
    14: bench_architectures,
    15: bench_train_size,
}
TARGETS = {
    1: "full records <= 1.10 x plain grad",
    2: "host callback >= 1.25 x slower than ours (CPU)",
    3: "full records <= 1.08 x the zero-perturbation trick",
    4: "statistics only <= 1.05, with the histogram <= 1.15, per example <= 1.20 x plain grad",
    5: "50-step scan with running statistics <= 1.15 x the plain scan",
    6: "trace+compile <= 1.5 x plain",
    7: "ratio stays flat from 4 to 64 layers and batch 32 to 1024 (spread <= 0.10)",
    9: "one-pass DP-SGD clipped grads <= 1.10 x plain grad (MLP), <= 1.30 x (transformer block)",
    10: ("economy instruments <= 1.10 x a plain training step, read every step and read "
         "every 10th step (`every=10`)"),
    12: ("stock NNX decoder, no layer marked: record_layers reaped and dropped <= 1.05, "
         "per-example norms <= 1.30, gl.clipped_grad <= 1.30 x plain grad (time) and <= 1.30 "
         "x its XLA temp memory; trace+compile of record_layers on 24 blocks <= 1.5 x plain; "
         "on a TPU gl.clipped_grad <= the faster of 1.20 x plain and the vmap clip"),
    13: ("projected per-example gradients (k = 16) logged every step <= 1.25 x plain grad; "
         "the stored run <= 2% of the whole per-example gradients"),
    15: ("TPU: GPT-2-small-sized decoder at seq 256 x 32 and 1024 x 8, float32 and bfloat16: "
         "per-example norms <= 1.08, gl.clipped_grad <= 1.10 x plain grad (time) and <= "
         "1.10 x its XLA temp memory"),
}


def _parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="scaled-down sizes, a smoke run")
  parser.add_argument("--device", choices=h.DEVICES, default="cpu")
  h.add_dtypes_flag(parser)
  parser.add_argument(
      "--malloc", choices=("retain", "system"), default="retain",
      help="retain: glibc keeps freed memory (steadier ratios); system: glibc defaults")
  parser.add_argument("--only", default="", help="comma-separated workload numbers")
  parser.add_argument(
      "--output", type=pathlib.Path, default=None,
      help="where to write the markdown (default: benchmarks/results/DEVICE-jax-VERSION.md "
      "for a full run, none for --quick)")
  return parser.parse_args(argv)


def _selected(only: str) -> list[int]:
  numbers = sorted(WORKLOADS)
  if not only:
    return numbers
  wanted = {int(n) for n in only.split(",") if n.strip()}
  unknown = wanted - set(numbers)
  if unknown:
    raise SystemExit(f"run.py --only: no workload {sorted(unknown)}; choose from {numbers}")
  return [n for n in numbers if n in wanted]


def _as_reference(result: h.WorkloadResult, allocator: str) -> h.WorkloadResult:
  """Marks a result measured under another allocator as information only."""
  comparisons = [
      dataclasses.replace(c, what=f"{c.what} [{allocator}]", target=None)
      for c in result.comparisons
  ]
  measurements = {
      key: dataclasses.replace(m, label=f"{m.label} [{allocator}]")
      for key, m in result.measurements.items()
  }
  return dataclasses.replace(
      result, title=f"{result.title}, with {allocator}", comparisons=comparisons,
      measurements=measurements)


def _summary_lines(results: list[h.WorkloadResult], numbers: list[int]) -> list[str]:
  """Returns the table of every comparison, in workload order."""
  lines = list(h.COMPARISON_HEADER)
  for number in numbers:
    lines += [h.format_comparison(c) for r in results if r.number == number
              for c in r.comparisons]
  return lines


def _precision_note() -> str:
  precision = jax.config.jax_default_matmul_precision
  return f" with JAX_DEFAULT_MATMUL_PRECISION={precision}" if precision else ""


def _markdown(results, numbers, machine, settings, allocator, elapsed_s) -> str:
  judged = [c for r in results for c in r.comparisons if c.target is not None]
  missed = [c for c in judged if c.status == "MISSED"]
  out = [
      "# Benchmark results",
      "",
      (f"Written by `python benchmarks/run.py{' --quick' if settings.quick else ''}"
       f"{'' if settings.device == 'cpu' else ' --device ' + settings.device}` on "
       f"{machine['date']}{_precision_note()} "
       f"in {elapsed_s:.0f} s. Regenerate with `make bench` (or the command above); the "
       "numbers move from run to run on a shared machine, the ratios much less than the "
       "times."),
      "",
      "## Machine",
      "",
      "| | |",
      "|---|---|",
      *[f"| {key} | {value} |" for key, value in machine.items()],
      f"| allocator | {allocator} |",
      "",
      "## Method",
      "",
      ("Every workload times its variants side by side in one process: a warm-up compiles "
       "and runs each variant (compile time is never timed, except in workload 6, which "
       "times only that), then rounds alternate the variants (A B C, C B A, ...), each "
       "timing a short block of back-to-back calls that each wait for all outputs "
       "(`block_until_ready`, plus `jax.effects_barrier` for host callbacks). A ratio is "
       "the median over rounds of the per-round ratio, given with the interquartile range "
       "of those ratios; a time is the median over rounds. Memory is XLA's analysis of "
       "the compiled program (`lower().compile().memory_analysis()`); peak = arguments + "
       "outputs + temporaries - aliased. HLO counts are the top-level instructions of "
       "the optimized program (`compile().as_text()`). Workload 1's A/A row (the plain "
       "step against itself, jitted twice) shows how far noise alone moves a ratio in "
       "this run."),
      "",
      "## Targets",
      "",
      *[f"- {n}: {TARGETS[n]}" for n in sorted(TARGETS) if n in numbers],
      "",
      f"{len(judged) - len(missed)} of {len(judged)} judged targets met"
      + ("" if settings.judge_targets else " (targets are for CPU and TPU; not judged here)")
      + ".",
      "",
      "## Results",
      "",
      *_summary_lines(results, numbers),
      "",
  ]
  for result in results:
    out += [f"### {result.number}. {result.title}", ""]
    out += h.format_comparisons(result.comparisons) + [""]
    out += h.format_measurements(result) + [""]
    out += [f"- {note}" for note in result.notes] + [""]
  if missed:
    out += ["## Missed targets: why, and what would fix it", ""]
    for c in missed:
      out += [
          f"### {c.workload}. {c.what} vs {c.baseline}: {c.value:.3f} (target {c.target})",
          "",
          c.explanation or "No explanation recorded.",
          "",
      ]
  return "\n".join(out)


def main(argv=None) -> None:
  """Runs the selected workloads, prints the table, writes the markdown."""
  args = _parse_args(argv)
  settings = h.Settings.make(args.quick, args.device, h.dtypes_of(args))
  h.cache_compiles(settings)
  numbers = _selected(args.only)
  device = h.device_for(settings)
  started = time.perf_counter()
  results = []
  with jax.default_device(device):
    machine = h.machine_description(settings)
    if (args.malloc == "retain" and 1 in numbers and not settings.quick
        and settings.device == "cpu"):
      print("[1, system malloc] ...", file=sys.stderr, flush=True)
      reference = _as_reference(bench_full_records.run(settings), "system malloc")
    else:
      reference = None
    allocator = (h.retain_freed_memory() if args.malloc == "retain"
                 else "system default (glibc)")
    if args.output is not None:
      output = args.output
    elif not settings.quick:  # Some workloads only: a file of their own, a column of its own.
      only = "-w" + "-".join(str(n) for n in numbers) if args.only else ""
      precision = jax.config.jax_default_matmul_precision
      only += f"-{precision}" if precision else ""
      output = HERE / "results" / f"{settings.device}-jax-{jax.__version__}{only}.md"
    else:
      output = None

    def write(results):
      """The files of the workloads done so far: a run cut short keeps them."""
      elapsed = time.perf_counter() - started
      output.parent.mkdir(parents=True, exist_ok=True)
      output.write_text(_markdown(results, numbers, machine, settings, allocator, elapsed))
      output.with_suffix(".json").write_text(json.dumps({
          "file": output.name, "machine": machine,
          "comparisons": [_as_json(c) for r in results for c in r.comparisons],
      }, indent=1))

    for number in numbers:
      if number not in WORKLOADS:
        continue
      print(f"[{number}] {WORKLOADS[number].TITLE} ...", file=sys.stderr, flush=True)
      start = time.perf_counter()
      result = WORKLOADS[number].run(settings)
      print(f"[{number}] done in {time.perf_counter() - start:.0f} s", file=sys.stderr,
            flush=True)
      results.append(result)
      if number == 1 and reference is not None:
        results.append(reference)
      if output is not None:
        write(results)
  elapsed = time.perf_counter() - started
  print(f"\n# Benchmarks ({'quick' if settings.quick else 'full'}, {device.platform}, "
        f"{machine['date']}, {elapsed:.0f} s)\n")
  print("\n".join(_summary_lines(results, numbers)))
  if output is not None:
    print(f"\nwrote {output} and its .json")
    if args.output is None:
      runs = sorted(output.parent.glob("*.json"), key=_run_order)
      rewrite_results(HERE / "RESULTS.md", runs)
      print(f"wrote {HERE / 'RESULTS.md'}")


def rewrite_results(path: pathlib.Path, runs: list[pathlib.Path]) -> None:
  """Writes the side-by-side table to `path`, keeping the hand-written sections
  (everything from its first `## ` heading on: one-off measurements, analyses)."""
  old = path.read_text() if path.exists() else ""
  start = old.find("\n## ")
  kept = "" if start < 0 else "\n" + old[start:].lstrip("\n")
  path.write_text(side_by_side(runs).rstrip("\n") + "\n" + kept)


def _run_order(path: pathlib.Path) -> tuple:
  """Orders `cpu-jax-0.5.0` before `cpu-jax-0.10.2`, CPU runs before GPU runs, a run of
  all workloads before one of some (`cpu-jax-0.5.0-w12`)."""
  device, _, version = path.stem.partition("-jax-")
  version, _, only = version.partition("-")
  return (device != "cpu", device, tuple(int(p) for p in version.split(".") if p.isdigit()),
          only)


def _as_json(c: h.Comparison) -> dict:
  return {"workload": c.workload, "what": c.what, "baseline": c.baseline,
          "value": c.value, "low": c.low, "high": c.high,
          "target": None if c.target is None else str(c.target), "status": c.status}


def side_by_side(paths: list[pathlib.Path]) -> str:
  """The ratios of several runs (JAX versions, devices) in one table, from their JSON."""
  runs = [json.loads(p.read_text()) for p in paths]
  names = [p.stem for p in paths]
  rows: dict[tuple, dict[str, dict]] = {}
  for name, run in zip(names, runs):
    for c in run["comparisons"]:
      # A spread's baseline text holds that run's ratios: key it without.
      baseline = None if c["baseline"].startswith("ratios ") else c["baseline"]
      rows.setdefault((c["workload"], c["what"], c["target"], baseline), {})[name] = c
  def cell(c):
    if c is None:
      return "-"
    ratio = f"{c['value']:.3f}" + ("x" if c["low"] is not None else "")
    return ratio + ("" if c["target"] is None else f" {c['status']}")
  out = [
      "# Benchmark results, side by side",
      "",
      ("Each column is one full run of `benchmarks/run.py` (`make bench` for JAX 0.5.0, "
       "`make bench-set SET=jax-0.10.2` for the newest JAX), in one process per run; "
       "every ratio compares variants timed side by side within that run (method, times, "
       "memory and HLO counts in each run's file). Runs on different JAX versions were "
       "made at different times on a shared machine: compare ratios, not times."),
      "",
      "| run | file | date | versions | load at start |",
      "|---|---|---|---|---|",
      *[f"| {n} | [results/{r['file']}](results/{r['file']}) | {r['machine'].get('date')} | "
        f"{r['machine'].get('versions')} | "
        f"{r['machine'].get('load average (1, 5, 15 min) at start', '-')} |"
        for n, r in zip(names, runs)],
      "",
      "| # | variant | vs | target | " + " | ".join(names) + " |",
      "|---|---|---|---|" + "---|" * len(names),
  ]
  for (number, what, target, _), by_run in sorted(rows.items(), key=lambda i: i[0][0]):
    baselines = {c["baseline"] for c in by_run.values()}
    baseline = baselines.pop() if len(baselines) == 1 else "(each run's own)"
    out.append(f"| {number} | {what} | {baseline} | {target or '-'} | "
               + " | ".join(cell(by_run.get(n)) for n in names) + " |")
  return "\n".join(out) + "\n"

if __name__ == "__main__":
  main()
