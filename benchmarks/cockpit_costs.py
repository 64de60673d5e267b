"""Cockpit 1.0.2's cost per reading on workload 10's model, for RESULTS.md (a one-off).

Not part of `make bench`: it needs PyTorch, BackPACK and cockpit-for-pytorch 1.0.2
(which needs setuptools < 81), which do not belong in our environments. Run it in a
throwaway virtual environment:

  python -m venv /tmp/cockpit && /tmp/cockpit/bin/pip install "setuptools<81" \
      torch cockpit-for-pytorch==1.0.2
  /tmp/cockpit/bin/python benchmarks/cockpit_costs.py

The model is workload 10's (`_mlp.FULL`): 4 dense layers `h -> tanh(h @ w + b)` of
512 units, batch 128, float32, mean squared error, SGD (lr 0.01), on the CPU with
two threads. Each variant is a Python loop of ten training steps; the rounds
alternate the variants (A B C, C B A, ...) and the table gives the median over the
rounds of each variant's time over the plain loop's in the same round, as
`benchmarks/run.py` does. TIC and the Hessian trace (BackPACK's exact diagonal
Hessian, minutes per ten steps here) are timed once, in their first ten steps.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
from backpack import extend  # pylint: disable=wrong-import-position
from cockpit import Cockpit, quantities as q  # pylint: disable=wrong-import-position
from cockpit.utils import schedules  # pylint: disable=wrong-import-position
from cockpit.utils.configuration import configuration  # pylint: disable=wrong-import-position

LAYERS, WIDTH, BATCH, LR, STEPS, ROUNDS = 4, 512, 128, 0.01, 10, 5


def model_and_data():
  torch.manual_seed(0)
  layers = []
  for _ in range(LAYERS):
    layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
  model = extend(torch.nn.Sequential(*layers))
  x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
  return model, x, y


class Loop:
  """Ten SGD steps of one model, with Cockpit tracking `quantities` (or none)."""

  def __init__(self, quantities):
    self.model, self.x, self.y = model_and_data()
    self.loss_fn = extend(torch.nn.MSELoss(reduction="mean"))
    self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
    self.cockpit = Cockpit(list(self.model.parameters()), quantities=quantities) if quantities else None
    self.step = 0

  def __call__(self):
    for _ in range(STEPS):
      self.opt.zero_grad()
      out = self.model(self.x)
      loss = self.loss_fn(out, self.y)
      if self.cockpit is None:
        loss.backward()
      else:
        losses = ((out - self.y) ** 2).mean(1)
        info = {"batch_size": BATCH, "individual_losses": losses, "loss": loss,
                "optimizer": self.opt}
        with self.cockpit(self.step, info=info):
          loss.backward(create_graph=self.cockpit.create_graph(self.step))
      self.opt.step()
      self.step += 1


def every(interval):
  return schedules.linear(interval)


VARIANTS = {
    "plain": ("10 plain steps", lambda: Loop(None)),
    "economy": ("economy read every step", lambda: Loop(configuration("economy", every(1)))),
    "economy_10": ("economy read every 10th step",
                   lambda: Loop(configuration("economy", every(10)))),
    "alpha": ("Alpha read every step", lambda: Loop([q.Alpha(every(1))])),
    "hist_1d": ("GradHist1d read every step", lambda: Loop([q.GradHist1d(every(1))])),
    "hist_2d": ("GradHist2d read every step", lambda: Loop([q.GradHist2d(every(1))])),
    "moments": ("MeanGSNR + EarlyStopping + CABS read every step",
                lambda: Loop([q.MeanGSNR(every(1)), q.EarlyStopping(every(1)),
                              q.CABS(every(1))])),
    "tic": ("TICDiag + TICTrace + HessTrace read every step",
            lambda: Loop([q.TICDiag(every(1)), q.TICTrace(every(1)), q.HessTrace(every(1))])),
}

# Timed once (ten steps take minutes on this CPU), against the rounds' median plain loop.
ONCE = ("tic",)


def main():
  torch.set_num_threads(2)
  loops = {name: make() for name, (_, make) in VARIANTS.items()}
  once = {}
  for name, loop in loops.items():  # Warm up; the slowest variants are timed once here.
    start = time.perf_counter()
    loop()
    once[name] = time.perf_counter() - start
    print(f"warm-up {name}: {once[name]:.2f} s", file=sys.stderr, flush=True)
  order = [name for name in loops if name not in ONCE]
  ratios = {name: [] for name in order if name != "plain"}
  plain = []
  for r in range(ROUNDS):
    times = {}
    for name in (order if r % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      loops[name]()
      times[name] = time.perf_counter() - start
    plain.append(times["plain"])
    for name in ratios:
      ratios[name].append(times[name] / times["plain"])
  print(f"Cockpit 1.0.2, torch {torch.__version__}, {LAYERS} x {WIDTH} tanh MLP, batch "
        f"{BATCH}, {ROUNDS} rounds of {STEPS} steps; 10 plain steps take "
        f"{statistics.median(plain) * 1e3:.1f} ms\n")
  print("| variant | vs | ratio (median) | range |\n|---|---|---|---|")
  for name, values in ratios.items():
    print(f"| {VARIANTS[name][0]} | 10 plain steps | {statistics.median(values):.2f}x | "
          f"{min(values):.2f} - {max(values):.2f} |")
  for name in ONCE:
    print(f"| {VARIANTS[name][0]} | 10 plain steps (median) | "
          f"{once[name] / statistics.median(plain):.0f}x | timed once |")


if __name__ == "__main__":
  main()
