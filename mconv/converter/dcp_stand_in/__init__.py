"""DCP's `.metadata` written without importing torch.distributed.checkpoint, which pulls in DTensor,
dynamo and sympy (half a second on 2 cores, more where Triton is installed) for a file that is one
pickle of a few dataclasses.

`metadata` and `filesystem` mirror torch.distributed.checkpoint's modules of those names (torch
2.11): the same classes with the same fields and pickled state. A pickle names a class by its
module and qualified name, and the pickler checks the name by importing it, so `dumps` pickles the
stand-ins with the standard pickler, under this package's module names, then writes DCP's module
names in their place. The two prefixes have the same length (29 characters), so no other byte
changes: pickle frames are cut by length and memo references by count. The result is the bytes
`pickle.dump` writes for DCP's own classes (torch's `FileSystemWriter.finish`), which DCP's
`FileSystemReader` and megatron-core's `dist_checkpointing.load` read; `tests/test_dcp_metadata.py`
compares them with torch's, byte for byte.
"""
from __future__ import annotations

import pickle

from mconv.converter.dcp_stand_in import filesystem, metadata
from mconv.errors import MconvError

PREFIX = __name__ + "."
DCP_PREFIX = "torch.distributed.checkpoint."
assert len(PREFIX) == len(DCP_PREFIX)


def _name_record(module: str) -> bytes:
    """How a pickle (protocol 4 or 5) writes a module name: a short string, under 256 bytes."""
    name = module.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(name)]) + name


def dumps(record: metadata.Metadata) -> bytes:
    """`pickle.dumps` of `record` as if built from DCP's classes (the default protocol, as DCP's
    `pickle.dump`)."""
    data = pickle.dumps(record)
    for module in (metadata, filesystem):
        ours = _name_record(module.__name__)
        # A module's name is written once, with its first class: later ones refer to it by memo.
        if data.count(ours) > 1:
            raise MconvError(f"internal: {module.__name__} is named more than once in a .metadata pickle")
        data = data.replace(ours, _name_record(DCP_PREFIX + module.__name__[len(PREFIX):]))
    return data
