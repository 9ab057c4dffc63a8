"""How the `mconv` program runs as a process: user errors as one line and an exit status,
usage errors as one line (click's 2), interrupts (Ctrl-C, SIGTERM) as one line and 128 + the
signal with nothing written, and the program's signal handlers from start to end."""
from __future__ import annotations

import os
import signal
import sys
import threading

import click

from mconv.converter.parallel import speaks_for_itself, torchrun_rank
from mconv.errors import MconvError


def one_line(message: str) -> str:
    """Every error is one line: `mconv: error: ...`."""
    return "mconv: error: " + " ".join(message.split())


def fail(message: str, status: int = 1):
    """Print the error (under torchrun: once for the job, see parallel.speaks_for_itself); exit with
    `status`."""
    if speaks_for_itself(one_line(message)):
        click.echo(one_line(message), err=True)
    sys.exit(status)


def run(action, status: int = 1):
    """Turn user errors into one line on stderr and exit `status` (1; verify's 2, as cmp's: its 1
    says the inputs differ). Tracebacks are for bugs only.

    An OSError that reaches here (a file that cannot be read, a full or read-only disk) is the
    environment's, not a bug: its path and cause are the sentence."""
    try:
        return action()
    except MconvError as e:
        fail(str(e), status)
    except OSError as e:
        fail(f"{e.filename}: {e.strerror or e}" if e.filename else str(e), status)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, torchrun's agent stopping its workers), raised as Ctrl-C is, so that an
    output being written is cleaned up the same way."""


def _terminate(signum, frame):
    raise Terminated()


# the running command's output directory ("out"), whether it has done its work ("done"), the first signal ("signal")
_command: dict = {}


def _on_signal(signum, frame):
    """The mconv program's SIGINT and SIGTERM handler. The first signal decides and later ones are
    ignored, so that none cuts short the clean-up the first one started (worker threads joined,
    the staging directory removed) or the exit that follows: before the output is in place it
    stops the command (raised as Ctrl-C is, see `Command`); once it is, it says so and the command
    carries on to status 0; once a command that writes nothing has done its work, it is ignored."""
    if "signal" in _command:  # a later one, landing even while this handler runs (Python re-enters it)
        return
    if _in_importlib(frame):
        # An exception raised there can leave the interpreter's import lock held (between importlib's
        # `_imp.acquire_lock()` and its `try`): every later import, in any thread, then waits
        # forever, the worker threads the clean-up joins among them (seen: hf2mcore hung). So the
        # signal is sent again in a moment, outside the import.
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
        return
    _command["signal"] = signum  # (not SIG_IGN: CPython reports a signal pending meanwhile as a "race condition")
    from mconv.converter.output import finished

    out = _command.get("out")
    if out and finished(out):  # os.write: the handler may run while sys.stderr is being written
        os.write(2, f"mconv: {_stopped(signum)} after {out} was complete; it is in place\n".encode())
    elif not _command.get("done"):
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _in_importlib(frame) -> bool:
    """Whether the interrupted `frame`, or one of its callers, is importlib's own code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _stopped(signum: int) -> str:
    return "terminated" if signum == signal.SIGTERM else "interrupted"


class Command(click.Command):
    """An mconv command: an interrupt (Ctrl-C, SIGTERM) at any point, the imports included, is one
    line and exit status 128 + the signal; the output being written has been removed by then
    (`output.staged_directory`), so nothing was written. Once the output is in place the command
    has done its work: an interrupt then says so and the status is 0 (in the mconv program the
    command carries on, see `_on_signal`). Bad MCONV_* settings are refused before any work."""

    def invoke(self, ctx):
        from mconv.converter.output import uninterrupted

        _command.update(out=ctx.params.get("out_dir"), done=False)
        try:
            # torch's C module imports numpy and carries on without it if that import fails, so a
            # KeyboardInterrupt raised in there is swallowed and the command would run on: held
            # back, it is delivered as soon as torch is imported.
            with uninterrupted():
                import torch  # noqa: F401
            from mconv.converter import file_io

            run(file_io.check_settings)
            result = super().invoke(ctx)
            _command["done"] = True
            return result
        except KeyboardInterrupt as e:
            interrupted(e, ctx.params.get("out_dir"))


def interrupted(error: KeyboardInterrupt, out: str | None = None):
    from mconv.converter.output import finished

    signum = signal.SIGTERM if isinstance(error, Terminated) else signal.SIGINT
    if torchrun_rank()[0] != 0:  # only rank 0 knows whether the output went into place, so it speaks for the job
        sys.exit(128 + signum)
    what = _stopped(signum)
    if out and finished(out):
        click.echo(f"mconv: {what} after {out} was complete; it is in place", err=True)
        sys.exit(0)
    click.echo(f"mconv: {what}" + (f"; nothing was written to {out}" if out else ""), err=True)
    sys.exit(128 + signum)


class UsageLine(click.ClickException):
    """A click usage error shown as one line; exit status stays click's 2."""

    def __init__(self, error: click.UsageError):
        super().__init__(error.format_message())
        self.exit_code = error.exit_code
        self.command = error.ctx.command_path if error.ctx else None

    def show(self, file=None) -> None:
        see = f" (see '{self.command} --help')" if self.command else ""
        if speaks_for_itself(one_line(self.format_message() + see)):
            click.echo(one_line(self.format_message() + see), err=True)


class Group(click.Group):
    """The `mconv` group: usage errors (unknown option, a file where a directory is expected, a bad
    value) are one line like every other error, instead of click's usage block; interrupts are
    one line too (see `Command`), never click's "Aborted!"."""

    command_class = Command

    def main(self, *args, **kwargs):
        # SIGTERM stops a command as Ctrl-C does, where nobody else handles it (the mconv program: `entry`)
        # and only while `main` runs (handlers are the main thread's).
        handle = (threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        if handle:
            signal.signal(signal.SIGTERM, _terminate)
        try:
            return super().main(*args, **kwargs)
        finally:
            if handle:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise  # plain `mconv` prints the help
        except click.UsageError as e:
            raise UsageLine(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise UsageLine(e) from None
        except KeyboardInterrupt as e:  # while the command line was parsed
            interrupted(e)
