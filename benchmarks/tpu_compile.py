"""What XLA compiles for a TPU v5e, without a TPU: memory and HLO of workloads 12 and 15.

A one-off, not part of `make bench`. libtpu compiles for a TPU that is not there
(JAX's compile-only devices, `jax.experimental.topologies`), so the compiled
program's temporaries (`memory_analysis`), fusions, products and flops can be read
on any x86 Linux machine. Checked on 2026-12-07: workload 15's bfloat16 seq 256 x
32 step compiled here has exactly the temporaries and fusion counts that the real
chip reported (2795.78 / 2928.41 / 3258.91 MiB, 441 / 702 / 788 fusions for plain
/ norms / clipped), so memory targets can be worked on between device sessions.
Times cannot: nothing runs.

Sharp edges:
  * Needs libtpu, in its own environment (never beside the test one: with libtpu
    installed JAX looks for a chip at start-up). For JAX 0.10.2:
    `python -m venv venv-tpu && venv-tpu/bin/pip install "jax[tpu]==0.10.2"`, then the
    rest of `.venv-jax-0.10.2`'s packages and `pip install --no-deps -e .`.
  * One process at a time: libtpu takes a lock file (`/tmp/libtpu_lockfile`) even
    when it only compiles.
  * A 12 x 768 step takes 1-1.5 minutes to compile on 2 cores. At tiny sizes the
    temporaries fit in the chip's on-core memory and read 0 bytes.
  * Parameters are built on the CPU (`JAX_PLATFORMS=cpu`); only shapes go to libtpu.

Run: venv-tpu/bin/python benchmarks/tpu_compile.py --workload 12 [--hlo DIR]
     venv-tpu/bin/python benchmarks/tpu_compile.py --workload 15 --dtypes bfloat16
       [--variants plain,clipped] [--seq 256] [--clip-methods gram,materialized]
"""

from __future__ import annotations

import argparse
import os
import pathlib

import jax
from jax.experimental import topologies

import _harness as h
import bench_any_model as any_model
import bench_train_size as train_size
import oryx_gradlog as gl


def tpu_v5e() -> jax.Device:
  """A compile-only TPU v5e device (one chip); exits with the fix without libtpu."""
  # No chip to ask: libtpu reads these when it starts.
  for name, value in (("TPU_ACCELERATOR_TYPE", "v5litepod-1"),
                      ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_SKIP_MDS_QUERY", "1")):
    os.environ.setdefault(name, value)
  try:
    topology = topologies.get_topology_desc(
        "v5e:1x1", platform="tpu", chips_per_host_bounds=[1, 1, 1], num_slices=1)
  except (RuntimeError, jax.errors.JaxRuntimeError) as error:
    raise SystemExit(f"tpu_compile.py: libtpu cannot make a TPU v5e to compile for "
                     f"({error}). Install it in an environment of its own, see this "
                     "script's docstring.") from error
  return topology.devices[0]


def decoders(workload: int, dtypes: list[str], seq: int | None, quick: bool = False):
  """The workload's regimes (`quick`: its scaled-down ones), those of length `seq`."""
  if workload == 12:
    found = list(any_model.QUICK if quick else any_model.FULL)
  else:
    found = train_size.regimes(h.Settings.make(quick=quick, dtypes=tuple(dtypes)))
  return [d for d in found if seq is None or d.seq == seq]


def main(argv=None) -> list[dict]:
  """Prints the table; returns its rows (regime, variant, temp bytes, ratio, ...)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", type=int, choices=(12, 15), default=12)
  parser.add_argument("--dtypes", default="float32,bfloat16",
                      help="workload 15's computation dtypes (comma-separated)")
  parser.add_argument("--variants", default=None,
                      help="comma-separated keys (default: all but vmap and jax_privacy)")
  parser.add_argument("--seq", type=int, default=None, help="only the regime of this length")
  parser.add_argument("--clip-methods", default="",
                      help="also gl.clipped_grad with these methods for every layer "
                           "(comma-separated: gram, materialized), as clipped_METHOD")
  parser.add_argument("--quick", action="store_true", help="the workloads' --quick sizes")
  parser.add_argument("--hlo", default=None, metavar="DIR",
                      help="also write each compiled program's HLO text into DIR")
  args = parser.parse_args(argv)
  device = tpu_v5e()
  sharding = jax.sharding.SingleDeviceSharding(device)
  print(f"Compiled for {device.device_kind} (compile-only), JAX {jax.__version__}, default "
        f"matmul precision {jax.config.jax_default_matmul_precision or 'JAX default'}.\n")
  print("| regime | variant | temp MiB | temp / plain | fusions | products | GFLOP | "
        "compile s |")
  print("|---|---|---|---|---|---|---|---|")
  rows = []
  for d in decoders(args.workload, args.dtypes.split(","), args.seq, args.quick):
    loss, values = any_model.model(d)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          values)
    workload = any_model if args.workload == 12 else train_size
    steps = workload.steps(loss, d.batch)
    for method in filter(None, args.clip_methods.split(",")):
      steps[f"clipped_{method}"] = gl.clipped_grad(loss, l2_norm_clip=workload.CLIP,
                                                   method=method)
    keys = (args.variants.split(",") if args.variants
            else [k for k in steps if k not in ("vmap", "jax_privacy")])
    if args.variants and args.clip_methods:
      keys += [k for k in steps if k.startswith("clipped_")]
    plain_temp = None
    for key in keys:
      memory, stats, text, seconds = h.analyse(h.Variant(key, jax.jit(steps[key]), shapes))
      plain_temp = memory["temp"] if key == "plain" else plain_temp
      ratio = memory["temp"] / plain_temp if plain_temp else None
      rows.append(dict(regime=d.tag, variant=key, temp=memory["temp"], ratio=ratio,
                       fusions=stats["fusions"], products=stats["all_dots"],
                       flops=stats.get("flops", 0), device=device.device_kind))
      print(f"| {d.tag} | {key} | {memory['temp'] / 2**20:.2f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{stats['fusions']} | {stats['all_dots']} | {stats.get('flops', 0) / 1e9:.1f} | "
            f"{seconds:.0f} |", flush=True)
      if args.hlo:
        folder = pathlib.Path(args.hlo)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"w{args.workload}-{d.tag}-{key}".replace(" ", "").replace(",", "-")
        (folder / f"{name}.txt").write_text(text)
  return rows


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # The parameters are built on the CPU.
  main()
