"""Outputs appear at their final path only when complete, with the permissions the caller's
umask gives, and a failed write (full disk, read-only or forbidden location) is one sentence."""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from mconv.converter.options import check_path, option
from mconv.errors import MconvError

# errnos that only a write can raise: whatever file they name, the output is at fault.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def output_path(out: str | Path) -> Path:
    """The absolute output path with its parent's symlinks resolved: where the staging sibling is
    made and the finished output renamed to. MconvError for an empty path, which is no directory
    name (os.path would read it as the current directory)."""
    check_path(out, "the output path")
    if not os.fspath(out):
        raise MconvError("the output path is empty; name the directory to write")
    out = Path(os.path.abspath(out))
    return out.parent.resolve() / out.name


def check_output_path(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> None:
    """Refuse an output that overlaps an input (paths compared with every symlink resolved, so an
    input reached through a link is still the input), that is not a directory (a file, a FIFO, a
    device, a dangling symlink), that exists without `overwrite` (an empty directory is not data:
    it is taken without), that `overwrite` may not replace (`_refusal`), or whose nearest existing
    parent is not a directory.

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
    refusal = _refusal(out, overwrite)
    if refusal:
        raise MconvError(refusal)


# What --overwrite may replace: a directory that an mconv command could have written (one of these files in it,
# and nothing an mconv output never holds: _foreign).
_OUTPUT_MARKERS = ("config.json", "adapter_config.json", "latest_checkpointed_iteration.txt", "mconv.json")
# What an mconv output holds (_foreign): HF weights and their index, configs and tokenizer files
# (hf_config.SIDE_FILES), remote code (what a config's auto_map names), a PEFT adapter, mconv.json; a
# Megatron checkpoint's tracker, its one iteration's directory (rank directories, or torch_dist's files)
# and its copy of the HF config (megatron_io.HF_CONFIG_DIR: configs, tokenizer files, remote code)
_OUTPUT_FILES = re.compile(r".+\.safetensors|.+\.safetensors\.index\.json|adapter_config\.json|mconv\.json")
_ITERATION = re.compile(r"release|iter_\d{7,}")
_ITERATION_ENTRIES = re.compile(r"mp_rank_\d+(_\d+)*|.+\.distcp|\.metadata|common\.pt|metadata\.json")


def _refusal(out: Path, overwrite: bool) -> str | None:
    """Why what is at `out` now may not be replaced (None: nothing is there, an empty directory, or
    with `overwrite` a directory an mconv command could have written, or a link to one)."""
    if not os.path.lexists(out) or _empty_directory(out):
        return None
    if not out.is_dir():
        return f"{out} is {file_kind(out)}, not a directory; remove it or choose another output directory"
    if not overwrite:
        return f"{out} already exists; pass {option('overwrite', True)} to replace it"
    if not any((out / marker).is_file() for marker in _OUTPUT_MARKERS) and any(out.iterdir()):
        return (f"{out} holds neither a model, an adapter nor a Megatron checkpoint; {option('overwrite', True)} replaces only "
                "those (or an empty directory), so remove it yourself if it must go")
    foreign = _foreign(out)
    if foreign is not None:
        return (f"{out} holds {foreign}, which no mconv output holds; {option('overwrite', True)} replaces only a directory "
                "an mconv command could have written, so remove it yourself if it must go")
    return None


def _foreign(out: Path) -> str | None:
    """The first entry of directory `out` that an mconv output never holds at its top level (a
    hidden one such as .git, a directory but a Megatron checkpoint's, a file of another kind), as
    a message names it; None if there is none."""
    from mconv.converter.hf_config import SIDE_FILES  # (hf_config imports this module)
    from mconv.converter.megatron_io import HF_CONFIG_DIR, TRACKER
    from mconv.converter.remote_code import remote_code_files

    def config_files(directory: Path) -> set[str]:
        try:
            return {*SIDE_FILES, *remote_code_files(directory, SIDE_FILES)}
        except MconvError:  # (a config.json that is not one: its remote code is no output's)
            return set(SIDE_FILES)

    iterations = 0
    for entry in sorted(out.iterdir()):
        name, directory = entry.name, entry.is_dir() and not entry.is_symlink()
        if name.startswith("."):
            return name
        if directory and _ITERATION.fullmatch(name):
            iterations += 1
            inside = next((e.name for e in sorted(entry.iterdir()) if not _ITERATION_ENTRIES.fullmatch(e.name)), None)
        elif directory and name == HF_CONFIG_DIR:
            kept = config_files(entry)
            inside = next((e.name for e in sorted(entry.iterdir()) if e.name not in kept or e.is_dir()), None)
        elif directory:
            return f"the directory {name}"
        else:
            inside = None
            if not (_OUTPUT_FILES.fullmatch(name) or name == TRACKER or name in config_files(out)):
                return name
        if inside is not None:
            return f"{name}/{inside}"
        if iterations > 1:
            return f"more than one iteration ({name} among them)"
    return None


def _empty_directory(path: Path) -> bool:
    try:
        return not path.is_symlink() and path.is_dir() and not any(path.iterdir())
    except OSError:  # unreadable: it may hold anything
        return False


def file_kind(path: Path) -> str:
    """What a path that is not a directory is, in words."""
    if not path.exists():
        looped = False
        try:
            path.resolve(strict=True)
        except RuntimeError:  # pathlib's word for a loop up to Python 3.12
            looped = True
        except OSError as e:  # ELOOP from 3.13
            looped = e.errno == errno.ELOOP
        end = "a loop of links that ends nowhere" if looped else "which does not exist"
        return f"a symlink to {os.readlink(path)}, {end}"
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a file")


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


class Claim:
    """This process's hold on an output path, from before its staging directory is made until the
    finished output is in place (`commit`) or the run has failed (`release`): an exclusive lock on
    `.NAME.mconv-lock` beside OUT, so that a second mconv run to the same OUT is refused at once
    (MconvError) instead of one output silently replacing the other; and what was at OUT when the
    claim was made (checked by `check_output_path` under the lock), the only thing `commit` may
    replace. OUT's parent directory must exist. An OSError (no permission...) is raised as it is."""

    def __init__(self, out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()):
        self.out = output_path(out)
        self.overwrite = overwrite
        self._lock, locked = _lock(self.out)
        try:
            check_output_path(self.out, overwrite, inputs)
            self.found = _identity(self.out)
            if locked:  # no other mconv run is writing OUT: a staging directory of OUT is a killed run's
                _remove_stale_staging(self.out)
        except BaseException:
            self.release()
            raise

    def commit(self, staging: Path) -> None:
        """Rename the finished `staging` to OUT and release the claim. Where OUT is absent or an empty
        directory this is one rename, and the kernel itself refuses to replace anything else (a
        directory with files, a file, a link); with `overwrite`, the output found when the claim
        was made is replaced if it is still there and still one --overwrite may replace. Anything
        else now at OUT (made while mconv ran) is left as it is: MconvError, and the caller
        removes `staging`. An interrupt meanwhile is dropped (`uninterrupted`)."""
        with uninterrupted(deliver=False):
            try:
                os.rename(staging, self.out)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                if not self.overwrite or self.found is None or _identity(self.out) != self.found \
                        or _refusal(self.out, True):
                    what = "appeared" if self.found is None else "changed"
                    raise MconvError(f"{self.out} {what} while mconv was writing it; it was left as it is and "
                                     "the new output was removed") from None
                _replace(staging, self.out)
            _finished.add(self.out)
            self.release()

    def release(self) -> None:
        """Remove the lock file and unlock (in that order: a run that opened it meanwhile sees that
        it is gone, see `_lock`)."""
        if self._lock is not None:
            with uninterrupted():
                try:
                    with suppress(FileNotFoundError):
                        os.unlink(_lock_path(self.out))
                finally:
                    os.close(self._lock)
                    self._lock = None


def _lock_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.mconv-lock")


def _lock(out: Path) -> tuple[int, bool]:
    """Take the exclusive lock beside `out`: its file descriptor, and whether it is locked (False on a
    file system without locks). MconvError if another process holds it."""
    path = _lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MconvError(f"another mconv run is writing {out}; wait for it to end or choose another "
                             "output directory") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):  # a file system without locks: none to take
                os.close(fd)
                raise
            locked = False
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd, locked
        except FileNotFoundError:
            pass
        os.close(fd)  # locked after its holder removed it: take the new one


def _remove_stale_staging(out: Path) -> None:
    """Remove the staging directories of `out` (`.NAME.mconv-partial-*`) that a killed run (SIGKILL,
    a machine that stopped) left; called under OUT's lock, so none is in use."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.mconv-partial-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What is at `path`, a link itself not followed (None: nothing): its device and inode, and its
    ctime, which tells a directory made anew in a freed inode, or one whose entries changed."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino, found.st_ctime_ns


def _replace(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`, replacing (and removing) the output there."""
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


def remove_staging(staging: Path | None, created: list[Path], claim: Claim | None = None) -> None:
    """Remove a failed run's staging directory, release its claim on the output, and remove the
    parent directories it created."""
    with uninterrupted():
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if claim is not None:
            claim.release()
        for parent in created:
            try:
                parent.rmdir()
            except OSError:
                break


@contextmanager
def staged_directory(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out` in one rename.

    An interrupted or failed run leaves `out` untouched (an existing one is replaced only after
    the new one is complete, and only the one found when the run began: `Claim`) and removes the
    staging directory and the parents it created; an interrupt (SIGINT, SIGTERM) during that
    clean-up or during the final rename is held back until it is done (see `uninterrupted`). The
    output gets the permissions a plain mkdir would give under the caller's umask (mkdtemp's 0700
    is not kept). A failed write raises MconvError naming `out` and the cause; so does another
    mconv run writing `out`, and an output that appears at `out` meanwhile.
    """
    out = output_path(out)
    check_output_path(out, overwrite, inputs)
    created: list[Path] = []
    staging = claim = None
    try:
        with write_errors(out), uninterrupted():  # what is made here is known to the clean-up below
            created = _make_parents(out.parent)
            claim = Claim(out, overwrite, inputs)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.mconv-partial-", dir=out.parent))
            os.chmod(staging, 0o777 & ~umask())
        with write_errors(out, staging):
            yield staging
            claim.commit(staging)
    except BaseException:
        remove_staging(staging, created, claim)
        raise


class SharedStaging:
    """The staging directory of a job whose ranks all write into it (torchrun's ranks, a live
    model's): its name, `.NAME.mconv-partial-KIND`, is fixed so that every rank knows it without
    talking. Rank 0 claims OUT and makes it (`make`), then puts it in place (`commit`) or removes
    it (`remove`); a claim refused (another run writing OUT) leaves that run's directory alone."""

    def __init__(self, out: str | Path, kind: str, overwrite: bool):
        self.out = output_path(out)
        self.path = self.out.with_name(f".{self.out.name}.mconv-partial-{kind}")
        self.overwrite = overwrite
        self.claim: Claim | None = None

    def make(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.claim = Claim(self.out, self.overwrite)
        shutil.rmtree(self.path, ignore_errors=True)  # a killed run's: the claim says no run is using it
        self.path.mkdir()

    def commit(self) -> None:
        self.claim.commit(self.path)

    def remove(self) -> None:
        if self.claim is not None:
            remove_staging(self.path, [], self.claim)
