"""The ground floor's error types, and how every command line reports a user mistake.

Every package above imports these (``pretrain``, ``launch``); nothing here imports upwards.

* ``ConfigError``: a user mistake (config key, file, value); the message is one line and names
  the key or file at fault. ``DataError`` (shards, manifests) and the transfer harness's
  ``TransferError`` subclass it, so ``cli_errors`` prints any of them as one line, exit 2.
* ``Unavailable``: a service the job needs (the shard store) stayed unreachable past the bound the
  config states. Not a mistake and nothing to fix: one line and exit 69 (``EXIT_UNAVAILABLE``,
  sysexits' EX_UNAVAILABLE), a code ``vit-launch --max-restarts`` restarts and the sbatch script of
  ``vit-launch slurm --requeue`` requeues; the same command resumes once the service is back.
* ``cli_errors(prog)``: the context manager each CLI's ``main`` runs its work in.
* ``Parser``: argparse whose usage mistakes are one line (``prog: error: ...``), exit 2.
* ``path_arg``: the argparse ``type`` of every option or argument that names a file, folder or URL.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
from typing import Callable, Optional

EXIT_USAGE = 2  # a user mistake: one line on stderr, no traceback
EXIT_UNAVAILABLE = 69  # a service the job needs stayed away past its bound: start again later


class ConfigError(ValueError):
    """A user mistake in a config file, an override or a command-line value; one line."""


class DataError(ConfigError):
    """A user-level data mistake: no shards match, manifest missing or inconsistent, remote URL
    without ``data.allow_remote``. The message is one line and names the file or key."""


class TooManyCorruptSamples(DataError):
    """The share of bad samples in an epoch exceeded ``data.max_corrupt_rate``; the message names
    the worst shards."""


class Unavailable(RuntimeError):
    """A service the job needs stayed unreachable past the bound the config gives it (the shard
    store past ``data.remote_retry_s``); the message is one line naming it and the bound."""


def is_user_error(e: BaseException, *user_errors: type) -> bool:
    """Whether ``cli_errors(prog, *user_errors)`` reports ``e`` as a user mistake (exit 2)."""
    return isinstance(e, (ConfigError, FileNotFoundError, *user_errors))


def exit_code(e: BaseException, *user_errors: type) -> int:
    """The code ``cli_errors(prog, *user_errors)`` ends with for ``e``: 2 for a user mistake, 69 for
    an unavailable service, 1 for anything else."""
    return EXIT_USAGE if is_user_error(e, *user_errors) else EXIT_UNAVAILABLE if isinstance(e, Unavailable) else 1


@contextlib.contextmanager
def cli_errors(prog: str, *user_errors: type, voice: Optional[Callable[[BaseException], Optional[str]]] = None):
    """Turn user mistakes (ConfigError, FileNotFoundError and ``user_errors``) into one line on
    stderr and exit code 2, an ``Unavailable`` service into one line and exit code 69; no traceback.
    ``voice``: for a command run as many processes (the ranks of a job), the words this process puts
    before the message, or None when another process says it (the exit code stays the same)."""
    try:
        try:
            yield
            sys.stdout.flush()  # a reader gone early (`| head`) shows here, not as a traceback at exit
        except BrokenPipeError:
            if not _stdout_gone():
                raise  # a connection of the command's own: as any error
            # nobody reads what is left to print: nothing to report (Python's documented recipe)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
    except (ConfigError, FileNotFoundError, Unavailable, *user_errors) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        who = "" if voice is None else voice(e)
        if who is not None:
            print(f"{prog}: error: {who}{msg}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(e, *user_errors)) from None


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on it),
    so a BrokenPipeError was this process's own output, not a connection it opened."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no fd (captured), a closed stream
        return False


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (``prog: error: ...``) and exit 2, without the
    usage block argparse prints by default."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def path_arg(text: str) -> str:
    """argparse ``type`` for an option naming a file, folder or URL: an empty value (``''``, an
    unset shell variable) would be read as the current folder, so it is a usage mistake, one line
    naming the option (``argument --log-dir: empty; ...``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; name a file or folder")
    return text
