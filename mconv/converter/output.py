"""Outputs appear at their final path only when complete, with the permissions the caller's
umask gives, and a failed write (full disk, read-only or forbidden location) is one sentence."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mconv.converter.options import option
from mconv.errors import MconvError

# errnos that only a write can raise: whatever file they name, the output is at fault.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def output_path(out: str | Path) -> Path:
    """The absolute output path with its parent's symlinks resolved: where the staging sibling is
    made and the finished output renamed to."""
    out = Path(os.path.abspath(out))
    return out.parent.resolve() / out.name


def check_output_path(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> None:
    """Refuse an output that overlaps an input (paths compared with every symlink resolved, so an
    input reached through a link is still the input), that exists without `overwrite`, or whose
    nearest existing parent is not a directory.

    Raises MconvError naming both paths."""
    out = output_path(out)
    above = next((p for p in out.parents if os.path.lexists(p)), None)  # None for the root
    if above is not None and not above.is_dir():
        raise MconvError(f"cannot write {out}: {above} is not a directory")
    real = out.resolve()
    for source in inputs:
        source = Path(source).resolve()
        if real == source or source.is_relative_to(real) or real.is_relative_to(source):
            raise MconvError(f"output {out} overlaps the input {source}; choose another output directory")
    if os.path.lexists(out) and not overwrite:
        raise MconvError(f"{out} already exists; pass {option('overwrite', True)} to replace it")
    if os.path.lexists(out) and not out.is_dir():
        raise MconvError(f"{out} exists and is not a directory")
    if os.path.lexists(out) and not _replaceable(out):
        raise MconvError(f"{out} holds neither a model, an adapter nor a Megatron checkpoint; "
                         f"{option('overwrite', True)} replaces only those (or an empty directory), so remove it yourself if it must go")


# What --overwrite may replace: a directory that an mconv command could have written.
_OUTPUT_MARKERS = ("config.json", "adapter_config.json", "latest_checkpointed_iteration.txt", "mconv.json")


def _replaceable(out: Path) -> bool:
    return not any(out.iterdir()) or any((out / marker).is_file() for marker in _OUTPUT_MARKERS)


def umask() -> int:
    """The process's umask (read without changing it where Linux allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def copy_file(source: Path, destination: Path) -> None:
    """Copy as a plain `cp` does: the bytes, and the source's permission bits less the umask."""
    shutil.copyfile(source, destination)
    os.chmod(destination, source.stat().st_mode & 0o777 & ~umask())


def write_failure(error: BaseException, out: Path, staging: Path | None = None) -> MconvError | None:
    """The one-sentence error for a failed write of `out` (through `staging`), or None if `error`
    is not one: an OSError naming the output, the staging directory or a directory above them, or
    one only a write raises (full disk, read-only file system); torch's zip writer's short write
    ("unexpected pos")."""
    if isinstance(error, OSError):
        name = Path(os.path.abspath(error.filename)) if isinstance(error.filename, (str, Path)) else None
        # mconv's own siblings of `out` (the staging directory being made, a replaced output set aside)
        sibling = name is not None and name.parent == out.parent and name.name.startswith(f".{out.name}.mconv-")
        ours = sibling or name is not None and any(name == p or name.is_relative_to(p) or p.is_relative_to(name)
                                                   for p in (out, staging) if p is not None)
        if not ours and error.errno not in WRITE_ERRNOS:
            return None
        cause = os.strerror(error.errno) if error.errno else str(error)
        staged = sibling or staging is not None and name is not None and name.is_relative_to(staging)
        where = f"{name}: " if name is not None and name != out and not staged else ""
        return MconvError(f"cannot write {out}: {where}{cause}; nothing was written")
    if isinstance(error, RuntimeError) and ("unexpected pos" in str(error) or "PytorchStreamWriter" in str(error)):
        return MconvError(f"cannot write {out}: torch's writer could not write all its bytes "
                          f"(no space left on device?); nothing was written")
    return None


@contextmanager
def write_errors(out: Path, staging: Path | None = None) -> Iterator[None]:
    """Raise `write_failure`'s sentence instead of a failed write's exception."""
    try:
        yield
    except MconvError:
        raise
    except BaseException as e:
        failure = write_failure(e, out, staging)
        if failure is None:
            raise
        raise failure from None


def _make_parents(directory: Path) -> list[Path]:
    """mkdir -p; returns the directories it created, deepest first."""
    created = []
    for parent in [directory, *directory.parents]:
        if parent.exists():
            break
        created.append(parent)
    for parent in reversed(created):
        parent.mkdir(exist_ok=True)
    return created


_finished: set[Path] = set()  # outputs this process has put in place (see `finished`)


def finished(out: str | Path) -> bool:
    """Whether this process has renamed a complete `out` into place (`staged_directory`): an
    interrupt after that stopped nothing."""
    return output_path(out) in _finished


# Signals whose Python handlers `uninterrupted` holds back (Ctrl-C, and the SIGTERM the CLI and
# torchrun's agent send): a rename or a clean-up stopped halfway would leave a partial output.
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def uninterrupted(deliver: bool = True) -> Iterator[None]:
    """Hold back SIGINT and SIGTERM (where Python handles them) while a step that must not stop
    halfway runs: moving the finished output into place, removing a staging directory. A signal
    that arrives meanwhile is delivered when the step ends (`deliver`), or dropped: once the output
    is in place, the command has done its work. Only the main thread can be interrupted (Python
    runs signal handlers there), so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for signum in HELD_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = handler
            signal.signal(signum, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught and deliver:
            previous[caught[0]](caught[0], None)


def remove_staging(staging: Path | None, created: list[Path]) -> None:
    """Remove a failed run's staging directory and the parent directories it created."""
    with uninterrupted():
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for parent in created:
            try:
                parent.rmdir()
            except OSError:
                break


@contextmanager
def staged_directory(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out` in one rename.

    An interrupted or failed run leaves `out` untouched (an existing one is replaced only after
    the new one is complete) and removes the staging directory and the parents it created; an
    interrupt (SIGINT, SIGTERM) during that clean-up or during the final rename is held back until
    it is done (see `uninterrupted`). The output gets the permissions a plain mkdir would give
    under the caller's umask (mkdtemp's 0700 is not kept). A failed write raises MconvError naming `out` and the cause.
    """
    out = output_path(out)
    check_output_path(out, overwrite, inputs)
    created: list[Path] = []
    staging = None
    try:
        with write_errors(out), uninterrupted():  # what is made here is known to the clean-up below
            created = _make_parents(out.parent)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.mconv-partial-", dir=out.parent))
            os.chmod(staging, 0o777 & ~umask())
        with write_errors(out, staging):
            yield staging
            with uninterrupted(deliver=False):
                commit(staging, out)
                _finished.add(out)
    except BaseException:
        remove_staging(staging, created)
        raise


def commit(staging: Path, out: Path) -> None:
    """Rename the finished `staging` to `out`, replacing an existing `out` (and removing it)."""
    if os.path.lexists(out):
        retired = out.with_name(f".{out.name}.mconv-old-{os.getpid()}")
        out.rename(retired)
        try:
            staging.rename(out)
        except BaseException:
            retired.rename(out)
            raise
        if retired.is_symlink():  # the output was a link to a directory: the link is replaced
            retired.unlink()
        else:
            shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(out)
