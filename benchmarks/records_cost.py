"""What each group of records' analyses adds to a step: workload 15's decoder, record by record.

For example 11's GPT (stock Flax NNX, nothing marked; `bench_any_model.Decoder`),
times the plain gradient beside the gradient plus `gl.per_example_norms` of one group
of `gl.record_layers`' records at a time (attention's query and key, value, output,
the MLP, the layer norms, the embedding, the output head, the position embedding),
and of all of them, each a `jax.jit` called in a Python loop with the same
arguments (nothing donated), at JAX's default matmul precision, timed side by side in
interleaved rounds (`_harness.measure`: the ratio to plain is the median of the
per-round ratios, with their interquartile range). It also counts the
attention score products that XLA leaves as their own fusion, unfused from the
softmax that reads them (top-level fusions whose output is a float32 `(B, H, T, T)`
array; their number over plain's is one per layer where the softmax lost its
product).

This is how the TPU's bfloat16 gap at sequence 1024 was traced to the embedding's
record (RESULTS.md, issue 50: its Gram form's `(B, T, T)` array, now replaced by
sorted ids): a diagnosis tool, not one of `run.py`'s workloads (no targets). Use
`--depth 2`: the effect is per layer, and compiles take seconds instead of a minute.
`--method` passes `gl.per_example_norms`' method to every group (`gram` or
`materialized`: for the embedding, its sums over runs of equal sorted ids or its
scattered per-example rows).

Run: python benchmarks/records_cost.py [--depth 2 --seq 1024 --batch 8
     --dtype bfloat16] [--groups embed,head] [--method gram] [--hlo DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re

import jax

import _harness as h
import bench_any_model as any_model
import oryx_gradlog as gl

GROUPS = {
    "query+key": lambda name: ".query." in name or ".key." in name,
    "value": lambda name: ".value." in name,
    "out": lambda name: ".out." in name,
    "mlp": lambda name: ".up." in name or ".down." in name,
    "layernorm": lambda name: ".ln" in name or name.startswith("ln"),
    "embed": lambda name: name.startswith("embed"),
    "head": lambda name: name.startswith("head"),
    "pos": lambda name: name == "pos",
    "all": lambda name: True,
}


def norms_of(loss, keep, method: str = "auto"):
  """The gradient and the per-example norms of the records whose names `keep` accepts."""
  def step(*args):
    grads, records = gl.call_and_reap(jax.grad(gl.record_layers(loss)))(*args)
    kept = {name: r for name, r in records.items() if keep(name)}
    return grads, gl.per_example_norms(kept, method=method).norms
  return step


def score_fusions(hlo: str, d: any_model.Decoder) -> int:
  """Top-level fusions with a float32 `(B, H, T, T)` output."""
  shape = f"{d.batch},{d.heads},{d.seq},{d.seq}"
  return len(re.findall(r"^\s*%[\w.\-]+ = f32\[" + shape + r"\]\{[^}]*\} fusion\(",
                        hlo, re.M))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--groups", default=",".join(GROUPS),
                      help=f"comma-separated, of: {', '.join(GROUPS)}")
  parser.add_argument("--method", default="auto", choices=("auto", "gram", "materialized"),
                      help="gl.per_example_norms' method, for every group")
  parser.add_argument("--hlo", metavar="DIR",
                      help="also write each variant's compiled HLO text into DIR")
  parser.add_argument("--quick", action="store_true",
                      help="width 64, 4 heads, vocabulary 512, seq 64 x batch 4")
  a = parser.parse_args()
  unknown = set(a.groups.split(",")) - set(GROUPS)
  if unknown:
    parser.error(f"--groups: unknown {sorted(unknown)}; choose from {list(GROUPS)}")
  shape = (dict(width=64, heads=4, vocab=512, seq=64, batch=4) if a.quick else
           dict(width=768, heads=12, vocab=8192, seq=a.seq, batch=a.batch))
  d = any_model.Decoder(depth=a.depth, **shape, dtype=a.dtype)
  loss, args = any_model.model(d)
  steps = {"plain": lambda *args: jax.grad(loss)(*args)}
  steps.update({f"norms of {g}": norms_of(loss, GROUPS[g], a.method)
                for g in a.groups.split(",")})
  settings = h.Settings.make(a.quick, device=jax.default_backend())
  h.cache_compiles(settings)  # On an accelerator the timed jit reads this compile back.
  m = h.measure({key: h.Variant(key, jax.jit(step), args) for key, step in steps.items()},
                settings)
  for key in steps if a.hlo else ():
    os.makedirs(a.hlo, exist_ok=True)
    with open(os.path.join(a.hlo, re.sub(r"\W+", "_", key) + ".hlo.txt"), "w") as f:
      f.write(m[key].hlo_text)
  print(f"# {d.tag}, {a.depth} blocks, method {a.method}, {settings.device}; "
        "interleaved rounds, nothing donated\n")
  print("| variant | ms per call | x plain (IQR) | score fusions | compile (s) |")
  print("|---|---|---|---|---|")
  for key in steps:
    ratio = h.compare(0, m, key, "plain", None, settings)
    print(f"| {key} | {m[key].median_s * 1e3:.2f} | {ratio.value:.3f} ({ratio.low:.3f}-"
          f"{ratio.high:.3f}) | {score_fusions(m[key].hlo_text, d)} | "
          f"{m[key].compile_s:.1f} |")

if __name__ == "__main__":
  main()
