"""Workload 7: the cost ratio (recorded / plain) as depth and batch grow.

For each size, the plain gradient, `record_vjp` on every dense layer and `tap` on
every layer output are timed side by side (as in workload 1), width 512, float32:
layers 4, 8, 16, 32, 64 at batch 128, and batch 32, 128, 512, 1024 at 4 layers.
The table gives each size's ratio, and the spread (largest minus smallest ratio)
of each recording style over all sizes, which the target asks to stay small: the
ratio stays flat when recording adds a fixed fraction of work at every size.

Run: python benchmarks/bench_scaling.py [--quick] [--device gpu]
"""

from __future__ import annotations

import dataclasses

import _harness as h
import _mlp

NUMBER = 7
TITLE = "Scaling: recorded / plain as layers go 4 to 64 and batch 32 to 1024"
FLAT = h.Target(0.10)

FULL_LAYERS, FULL_BATCHES = (4, 8, 16, 32, 64), (32, 128, 512, 1024)
QUICK_LAYERS, QUICK_BATCHES = (4, 8, 16), (16, 64, 256)


def sizes_to_run(settings: h.Settings, base: _mlp.Sizes | None = None) -> list[_mlp.Sizes]:
  """Returns the sizes: the layer sweep at the base batch, then the batch sweep."""
  base = base or (_mlp.QUICK if settings.quick else _mlp.FULL)
  layers, batches = (QUICK_LAYERS, QUICK_BATCHES) if settings.quick else (FULL_LAYERS,
                                                                          FULL_BATCHES)
  sizes = [dataclasses.replace(base, layers=n) for n in layers]
  sizes += [dataclasses.replace(base, layers=layers[0], batch=b) for b in batches]
  return list(dict.fromkeys(sizes))  # The base size is in both sweeps: once.


def _explain_spread(key: str, ratios: dict[_mlp.Sizes, h.Comparison],
                    m: dict[str, h.Measurement]) -> str:
  def tag(s):
    return f"{s.layers} layers, batch {s.batch}"

  def faults_of(variant, s):
    return m[f"{variant} {tag(s)}"].median_faults or 0

  lines = "; ".join(
      f"{tag(s)}: {r.value:.3f} ({faults_of(key, s):.0f} vs "
      f"{faults_of('plain', s):.0f} page faults per call, "
      f"{h.mib(m[f'{key} {tag(s)}'].memory.get('output'))} vs "
      f"{h.mib(m[f'plain {tag(s)}'].memory.get('output'))} MiB of outputs)"
      for s, r in ratios.items())
  widths = sorted(c.high - c.low for c in ratios.values())
  text = (
      f"Ratio by size (recorded vs plain page faults and outputs): {lines}. The "
      "interquartile ranges of the per-round ratios at these sizes are "
      f"{widths[0]:.3f} to {widths[-1]:.3f} wide (median {widths[len(widths) // 2]:.3f}), "
      "so ratios measured minutes apart in this run move by a few hundredths from "
      "noise alone."
  )
  faulting = [tag(s) for s in ratios if faults_of(key, s) > faults_of("plain", s) + 100]
  if faulting:
    faults = (
        f" At {', '.join(faulting)} the recorded step also page-faults much more than the "
        "plain one: its outputs are large enough that the allocator stops reusing their "
        "pages."
    )
  else:
    faults = ""
  if key == "record_vjp":
    text += (
        " `record_vjp`'s extra work is not a fixed fraction of the step: the first "
        "layer's `dL/dx` is one matmul on 3L - 1 (9% at 4 layers, 0.5% at 64), and the "
        "duplicated `dL/dw` records are copied (width x width per layer whatever the "
        "batch, so they weigh most at batch 32) and double the parameter-sized outputs."
        + faults
        + " Recording only the layer inputs removes the copies and the extra matmul, and "
        "then the ratio is that of `tap` (workload 1, 'record_vjp of layer inputs only')."
    )
  else:
    text += (
        " `tap` adds no instruction that scales differently from the step: its records "
        "are matmul outputs the plain step forms anyway, and their bytes grow with "
        "batch x width x layers like the step's work. What they do change is memory: "
        "as outputs they cannot share buffers with later temporaries, so the working "
        "set grows by the records (most at the largest batches, where it no longer fits "
        "in cache), and fresh output buffers can page-fault (counts above)."
        + faults
        + " That is the price of returning the values, which the zero-perturbation trick "
        "pays too (workload 3); the rest is noise on this shared machine."
    )
  return text


def run(settings: h.Settings, base: _mlp.Sizes | None = None) -> h.WorkloadResult:
  """Times plain, record_vjp and tap at each size; returns ratios and spreads."""
  settings = dataclasses.replace(settings, budget_s=settings.budget_s / 2)  # 8 sizes.
  measurements, comparisons = {}, []
  ratios = {"record_vjp": {}, "tap": {}}
  for sizes in sizes_to_run(settings, base):
    params, x, target = _mlp.init(sizes)
    args = (params, x, target)
    tag = f"{sizes.layers} layers, batch {sizes.batch}"
    vs = {
        "plain": h.Variant(f"plain grad [{tag}]", _mlp.plain_step(), args),
        "record_vjp": h.Variant(f"record_vjp [{tag}]", _mlp.record_vjp_step(), args),
        "tap": h.Variant(f"tap [{tag}]", _mlp.tap_step(), args),
    }
    _mlp.assert_trees_close(vs["record_vjp"]()[0], vs["plain"](), f"{tag}: gradients")
    _mlp.assert_trees_close(vs["tap"]()[0], vs["plain"](), f"{tag}: gradients")
    m = h.measure(vs, settings)
    for key in vs:
      measurements[f"{key} {tag}"] = m[key]
    for key in ("record_vjp", "tap"):
      comparison = h.compare(NUMBER, m, key, "plain", None, settings)
      ratios[key][sizes] = comparison
      comparisons.append(comparison)
  for key, label in (("record_vjp", "record_vjp"), ("tap", "tap")):
    values = [c.value for c in ratios[key].values()]
    comparisons.append(h.Comparison(
        workload=NUMBER,
        what=f"{label} / plain: spread over {len(values)} sizes (max - min)",
        baseline=f"ratios {min(values):.3f} - {max(values):.3f}",
        value=max(values) - min(values),
        target=FLAT,
        judged=settings.judge_targets,
        explanation=_explain_spread(key, ratios[key], measurements),
    ))
  notes = ["Each size is checked (recorded gradients equal plain ones) before timing."]
  return h.WorkloadResult(NUMBER, TITLE, measurements, comparisons, notes)


if __name__ == "__main__":
  h.main(run, __doc__.splitlines()[0])
