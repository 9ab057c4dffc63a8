"""The `mconv` program's first code (its console script and `python -m mconv`).

Importing the command line (click, the option tables) takes a few tenths of a second, and a
SIGINT or SIGTERM arriving meanwhile would meet Python's defaults: a KeyboardInterrupt traceback,
or a silent kill. So the program's handlers go in before anything else is imported; a signal
that lands before the command line is ready is recorded here and answered by `cli.entry` as
an interrupt of a command that has written nothing. Only Python's own start-up comes before this
module runs."""
import signal

_early: list[int] = []


def _record(signum, frame) -> None:
    _early.append(signum)


def main() -> None:
    """Take SIGINT and SIGTERM where they are at their defaults (a SIGINT a shell set to be
    ignored stays ignored), then run the command line (`cli.entry`), which ends the process."""
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) is default:
            signal.signal(signum, _record)
    from mconv.cli import entry

    entry(_early)
