"""Where a step's device time goes: workload 15's variants, op by op, from JAX's profiler.

For each variant of `bench_train_size` (plain grad, per-example norms, clipped_grad)
at one regime, runs a few warm calls under `jax.profiler.trace`, reads the device's
"XLA Ops" line of the trace (`jax.profiler.ProfileData`) and prints the ops that take
the most time per call, each with its share of the step and its category (the
`hlo_category` the profiler gives, else the op's own name), and the time per
category side by side for the variants. With `--hlo DIR` it also writes each
variant's optimised HLO, to read what a fusion holds.

Not a timing benchmark (the profiler adds overhead; ratios come from `run.py`): it
says which ops an extra millisecond is spent in.

Run: python benchmarks/profile_ops.py [--seq 256 --batch 32] [--dtype float32]
     [--variants plain,norms,clipped] [--quick] [--hlo DIR]
     (JAX_DEFAULT_MATMUL_PRECISION=highest profiles the comparison run)
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import tempfile

import jax

import bench_any_model as any_model
import bench_train_size

CALLS = 5


def _device_events(directory: str):
  """`(name, category, duration_ns)` of every op on the accelerator's "XLA Ops" line
  (the host's XLA ops on a CPU)."""
  if not hasattr(jax.profiler, "ProfileData"):
    raise SystemExit("profile_ops.py reads traces with jax.profiler.ProfileData, which "
                     "this JAX lacks (0.10.2 has it; 0.5.0 does not): run it with a "
                     "newer JAX, e.g. .venv-jax-0.10.2/bin/python.")
  ProfileData = jax.profiler.ProfileData  # pylint: disable=invalid-name
  path, = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  data = ProfileData.from_file(path)
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  for plane in planes or data.planes:
    for line in plane.lines:
      if planes and line.name != "XLA Ops":
        continue
      for event in line.events:
        stats = dict(event.stats)
        if not planes and "hlo_op" not in stats:
          continue
        yield event.name, _category(event.name, stats), event.duration_ns


def _category(text: str, stats: dict) -> str:
  """The profiler's `hlo_category`, else the fusion kind or op of an event named by
  its HLO text (`%fusion.3 = f32[8]{0} fusion(...), kind=kLoop, ...`)."""
  if stats.get("hlo_category"):
    return str(stats["hlo_category"])
  kind = re.search(r"kind=(k\w+)", text)
  if kind:
    return {"kOutput": "convolution fusion", "kLoop": "loop fusion",
            "kInput": "reduction fusion"}.get(kind.group(1), kind.group(1))
  return re.sub(r"[.\d]+$", "", text.split(" = ")[0].lstrip("%"))


def _short(text: str) -> str:
  """An op's name and output type, from its HLO text."""
  name, _, rest = text.partition(" = ")
  return f"{name} = {re.sub(r'{[^}]*}', '', rest)[:110]}" if rest else text


def profile(fn, args, calls: int = CALLS) -> tuple[dict, dict]:
  """Per op and per category, the mean device time of one call (ms)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    ops, categories = collections.Counter(), collections.Counter()
    kinds = {}
    for name, category, ns in _device_events(directory):
      ops[name] += ns / calls / 1e6
      categories[category] += ns / calls / 1e6
      kinds[name] = category
  return {name: (ms, kinds[name]) for name, ms in ops.items()}, dict(categories)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--variants", default="plain,norms,clipped")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--quick", action="store_true", help="2 blocks of width 128")
  parser.add_argument("--hlo", help="a folder for each variant's optimised HLO and "
                      "its ops' times (ops.json)")
  a = parser.parse_args()
  shape = (dict(depth=2, width=128, heads=4, vocab=512) if a.quick
           else dict(depth=12, width=768, heads=12, vocab=8192))
  d = any_model.Decoder(**shape, seq=a.seq, batch=a.batch, dtype=a.dtype)
  loss, args = any_model.model(d)
  fns = bench_train_size.steps(loss, d.batch)
  totals, per_op = {}, {}
  for key in a.variants.split(","):
    fn = jax.jit(fns[key]).lower(*args).compile()
    if a.hlo:
      os.makedirs(a.hlo, exist_ok=True)
      with open(os.path.join(a.hlo, f"{key}.hlo.txt"), "w") as f:
        f.write(fn.as_text())
    ops, totals[key] = profile(fn, args)
    per_op[key] = {name: ms for name, (ms, _) in ops.items()}
    step = sum(ms for ms, _ in ops.values())
    temp = fn.memory_analysis().temp_size_in_bytes / 2 ** 20
    print(f"\n## {d.tag}: {key}: {step:.2f} ms of device ops per call, "
          f"temporaries {temp:.0f} MiB")
    for name, (ms, category) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:a.top]:
      print(f"{ms:8.3f} ms {ms / step:6.1%}  {category:20s} {_short(name)}")
  if a.hlo:
    with open(os.path.join(a.hlo, "ops.json"), "w") as f:
      json.dump(per_op, f)
  names = sorted({c for t in totals.values() for c in t},
                 key=lambda c: -max(t.get(c, 0.0) for t in totals.values()))
  print(f"\n## {d.tag}: ms per call by category\n")
  print("| category | " + " | ".join(totals) + " |")
  print("|---|" + "---|" * len(totals))
  for c in names:
    print(f"| {c} | " + " | ".join(f"{t.get(c, 0.0):.2f}" for t in totals.values()) + " |")
  print("| total | " + " | ".join(f"{sum(t.values()):.2f}" for t in totals.values()) + " |")


if __name__ == "__main__":
  main()
