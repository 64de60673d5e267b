"""Command line: `python -m oryx_gradlog report RUN_DIR` (also `oryx-gradlog report`)."""

from __future__ import annotations

import argparse
import sys


def _version() -> str:
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    return metadata.version("oryx_gradlog")
  except metadata.PackageNotFoundError:  # A source tree that is not installed.
    return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="oryx-gradlog", description=__doc__)
  parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  commands = parser.add_subparsers(dest="command", required=True)
  run_help = "a run folder written by gl.RunLog (it holds log.zarr)"
  report = commands.add_parser("report", help="write PNG plots and an HTML page of a run")
  report.add_argument("run_dir", help=run_help)
  report.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
  board = commands.add_parser("tensorboard", help="export every numeric series to TensorBoard files")
  board.add_argument("run_dir", help=run_help)
  board.add_argument("--logdir", default=None, help="default RUN_DIR/tensorboard")
  args = parser.parse_args(argv)

  from oryx_gradlog.storage import _report, _tensorboard  # pylint: disable=import-outside-toplevel
  try:
    if args.command == "report":
      print(_report.report(args.run_dir, args.out))
    else:
      print(_tensorboard.export_tensorboard(args.run_dir, args.logdir))
  except (FileNotFoundError, ValueError, ImportError) as error:
    print(f"oryx-gradlog {args.command}: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
