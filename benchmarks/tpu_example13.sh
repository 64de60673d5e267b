#!/bin/bash
# Example 13 at GPT-2-small's shape on one TPU v5e chip (issue 52), one device call a phase:
#   bash benchmarks/tpu_example13.sh fit       (about 5-8 minutes)
#   bash benchmarks/tpu_example13.sh highest   (the next call, while the machine is warm)
# From the project's root on the TPU machine, .tpu/ carried (../shared/tpu/README.md).
#  fit:     trains 2,000 steps (the parameters kept in /tmp/gpt2.npz while the machine
#           stays warm; a later call loads them), fits EK-FAC, scores 481 queries x
#           4,600 training sequences, each phase's time and compiling printed; the
#           scores in /tmp/scores.npy, their first 50 rows in $OUT/scores50.npy.
#  highest: the first 50 queries again at JAX_DEFAULT_MATMUL_PRECISION=highest, with
#           their per-query Spearman against the default run's; then 200 training
#           steps plain and with --log-run (LoGra's projected gradients logged), each
#           printing its milliseconds a step besides compiling.
# Everything goes to $OUT (default runs/tpu) through tee alone: a filter such as awk or
# tr in the pipe holds its output back, and a call cut off at its limit loses it.
set -u
OUT=${OUT:-runs/tpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
e13() { bash .tpu/run.sh python3 examples/13_stdlib_attribution.py --size gpt2 "$@"; }
case ${1:-fit} in
  fit)
    e13 --params /tmp/gpt2.npz --save-scores /tmp/scores.npy --no-checks --progress 2>&1 |
      tee "$OUT/e13-gpt2.log"
    python3 -c "import numpy as np; np.save('$OUT/scores50.npy', np.load('/tmp/scores.npy')[:50])"
    ;;
  highest)
    JAX_DEFAULT_MATMUL_PRECISION=highest e13 --params /tmp/gpt2.npz --queries 50 \
      --compare-scores /tmp/scores.npy --no-checks --progress 2>&1 |
      tee "$OUT/e13-gpt2-highest.log"
    e13 --steps 200 --train-only 2>&1 | tee "$OUT/e13-gpt2-plain.log"
    e13 --steps 200 --train-only --log-run /tmp/gpt2-run 2>&1 | tee "$OUT/e13-gpt2-logged.log"
    ;;
  *) echo "usage: bash benchmarks/tpu_example13.sh fit|highest"; exit 2 ;;
esac
