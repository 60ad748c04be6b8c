"""The `gpukv` command (`python -m gpukv`): `demo`, `bench`, `info`, `run`, `gpucheck`,
`cluster` and `export`."""
from __future__ import annotations

import argparse
import importlib
import os
import select
import sys

# name -> (module with a `main(argv) -> int`, one line of help)
_COMMANDS = {
    "demo": ("gpukv.tools.demo", "run the tutorial and a short data-parallel training, checked"),
    "bench": ("gpukv.tools.bench", "measure push/pull/pushpull speed against baselines"),
    "info": ("gpukv.tools.info",
             "show versions, devices, links and the strategies gpukv would pick"),
    "run": ("gpukv.launcher.launch",
            "start an MPI job with mpiexec and end all of it, in bounded time, when it fails"),
    "gpucheck": ("gpukv.tools.gpucheck.cli",
                 "check and measure gpukv on this machine's GPU in one command"),
    "cluster": ("gpukv.tools.cluster",
                "run a command on hosts emulated on this machine (network namespaces)"),
    "export": ("gpukv.tools.export",
               "write a Trainer snapshot's parameters to a safetensors file, by name"),
}

#: the commands that call no store in their own process (`run`'s ranks, `cluster`'s
#: command and `gpucheck`'s sections do, in processes of their own)
_CALLING_NO_STORE = frozenset(["run", "info", "cluster", "gpucheck", "export"])


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
    """Entry point of `gpukv` / `python -m gpukv`; returns the exit status.

    When the reader of stdout goes away (`gpukv demo | head -1`) the command stops
    quietly with status 1, as command-line tools do, instead of with a traceback.
    """
    try:
        try:
            return _run(argv)
        finally:  # also on SystemExit (--help, usage errors)
            sys.stdout.flush()  # buffered output meets a closed pipe here
    except BrokenPipeError:
        if not _stdout_is_closed():
            raise  # another pipe or socket broke: a real error
        _silence_stdout()
        return 1


def _stdout_is_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone away."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or no file behind stdout
        return False


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is
    still buffered does not fail again (the recipe of Python's `signal` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(argv: list[str] | None) -> int:
    """Parse the command name and hand the rest of `argv` to that command's `main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv[:1])  # the command name (or --help / --version)
    module_name, _ = _COMMANDS[args.command]
    if args.command in _CALLING_NO_STORE or {"-h", "--help"} & set(argv[1:]):
        # Under GPUKV_TIMELINE the processes they start write the traces; they (and a
        # command asked for its help) call no store, and an empty trace of their own,
        # named rank 0, would mislead.
        from . import timeline
        timeline.discard()
    from ._errors import BackendError
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"gpukv {args.command}: not available in this installation", file=sys.stderr)
        return 2
    except BackendError as exc:  # a library the command needs is missing (PyTorch)
        print(f"gpukv {args.command}: {exc}", file=sys.stderr)
        return 2
    status = module.main(argv[1:])
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
