"""Command line: `python -m oryx_gradlog report RUN_DIR` (also `oryx-gradlog report`).

RUN_DIR is a run folder written by `gl.RunLog` (the folder that holds `log.zarr`), its
`log.zarr`, or a folder of runs: then each run below it is reported (or exported) in
turn. Nothing imports JAX until a command runs, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys


def _version() -> str:
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    return metadata.version("oryx_gradlog")
  except metadata.PackageNotFoundError:  # A source tree that is not installed.
    return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="oryx-gradlog", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  run_help = ("a run folder written by gl.RunLog (it holds log.zarr), its log.zarr, or "
              "a folder of runs (each run below it, in turn)")
  report = commands.add_parser("report", help="write PNG plots and an HTML page of a run",
                               description="Writes PNG plots and an HTML page of a run.")
  report.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
  report.add_argument("--out", default=None,
                      help="output folder (default RUN_DIR/report; for a folder of runs, "
                      "OUT/RUN for each)")
  board = commands.add_parser(
      "tensorboard", help="export every numeric series to a TensorBoard event file",
      description="Exports every numeric series of a run to one TensorBoard event file "
      "(a second export replaces it).")
  board.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
  board.add_argument("--logdir", default=None,
                     help="output folder (default RUN_DIR/tensorboard; for a folder of "
                     "runs, LOGDIR/RUN for each, as TensorBoard shows runs)")
  attribute = commands.add_parser(
      "attribute", help="print a run's loss spikes, self-influence and queries' examples",
      description="Prints, from the projected per-example gradients a run logged "
      "(gl.projected_grads, with 'ids' and 'lr'), the steps whose loss rose most and the "
      "examples behind each, the examples of the highest TracIn self-influence, and each "
      "logged query's most helpful and harmful examples.")
  attribute.add_argument("run_dir", metavar="RUN_DIR", help=run_help)
  attribute.add_argument("--top", type=int, default=5,
                         help="how many loss spikes (and twice as many examples)")
  return parser


def _attribute(run_dir: str, top: int) -> str:
  # pylint: disable=import-outside-toplevel
  from oryx_gradlog.storage import _attribution_page, _store
  dataset = _store.open_run(_store.run_folder(run_dir, "attribute"))
  if not _attribution_page.has_attribution(dataset):
    raise ValueError(
        f"attribute({run_dir!r}): the run logged no projected gradients with example ids "
        "(the keys 'train', 'ids' and 'lr'; or 'products', 'ids' and 'lr' with Adam). "
        "Log gl.projected_grads(records, projector) with the batch's ids and learning "
        "rate at every step (README, 'From the training run itself').")
  return f"{run_dir}:\n" + _attribution_page.attribution_text(dataset, top=top)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  # pylint: disable=import-outside-toplevel
  from oryx_gradlog.storage import _report, _store, _tensorboard
  if args.command == "attribute":
    command, out = (lambda run, _: _attribute(run, args.top)), None
  else:
    command, out = ((_report.report, args.out) if args.command == "report"
                    else (_tensorboard.export_tensorboard, args.logdir))
  runs = [args.run_dir]
  if (not os.path.isdir(os.path.join(args.run_dir, _store.STORE_NAME))
      and os.path.basename(os.path.normpath(args.run_dir)) != _store.STORE_NAME):
    runs = _store.find_runs(args.run_dir) or runs  # None: the command says what is missing.
  failed = 0
  for run in runs:
    target = out
    if out is not None and run != args.run_dir:
      target = os.path.join(out, os.path.relpath(run, args.run_dir))
    try:
      print(command(run, target))
    except (FileNotFoundError, ValueError, ImportError) as error:
      print(f"oryx-gradlog {args.command}: {error}", file=sys.stderr)
      failed += 1
  return 2 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
