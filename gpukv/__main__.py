"""The `gpukv` command (`python -m gpukv`): `demo`, `bench` and `info` subcommands."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with a `main(argv) -> int`, one line of help)
_COMMANDS = {
    "demo": ("gpukv.tools.demo", "run the tutorial and a short data-parallel training, checked"),
    "bench": ("gpukv.tools.bench", "measure push/pull/pushpull speed against baselines"),
    "info": ("gpukv.tools.info",
             "show versions, devices, links and the strategies gpukv would pick"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukv",
        description="gpukv: a key-value store for tensors shared by several devices.",
        epilog="Run 'gpukv COMMAND --help' for the options of a command.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"gpukv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, text) in _COMMANDS.items():
        # Each command parses its own options: everything after its name is handed over.
        command = sub.add_parser(name, help=text, description=text, add_help=False)
        command.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `gpukv` / `python -m gpukv`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv[:1])  # the command name (or --help / --version)
    module_name, _ = _COMMANDS[args.command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"gpukv {args.command}: not available in this installation", file=sys.stderr)
        return 2
    status = module.main(argv[1:])
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
