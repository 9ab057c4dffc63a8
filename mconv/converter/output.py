"""Outputs appear at their final path only when complete."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mconv.errors import MconvError


def check_output_path(out: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    out = Path(out).absolute()
    for source in inputs:
        source = Path(source).absolute()
        if out == source or source.is_relative_to(out) or out.is_relative_to(source):
            raise MconvError(f"output {out} overlaps the input {source}; choose another output directory")
    if out.exists() and not overwrite:
        raise MconvError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise MconvError(f"{out} exists and is not a directory")


@contextmanager
def staged_directory(out: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out` in one rename.

    An interrupted or failed run leaves `out` untouched (an existing one is replaced only after
    the new one is complete).
    """
    out = Path(out).absolute()
    check_output_path(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.mconv-partial-", dir=out.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        retired = out.with_name(f".{out.name}.mconv-old-{os.getpid()}")
        out.rename(retired)
        staging.rename(out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        staging.rename(out)
