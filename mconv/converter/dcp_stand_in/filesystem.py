"""Stand-ins for torch/distributed/checkpoint/filesystem.py (torch 2.11): the storage record of
each stored item and the version `FileSystemWriter.finish` stamps on the `Metadata`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

CURRENT_DCP_VERSION = "1.0.0"


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self):
        """DCP leaves the fields that are None (no transforms) out of the pickled state."""
        return {k: v for k, v in self.__dict__.items() if v is not None}
