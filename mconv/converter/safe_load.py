"""The one restricted unpickler every pickle mconv reads goes through: nothing in a checkpoint executes.

Megatron checkpoints hold pickles in four places: torch.distributed.checkpoint's `.metadata` (a
plain pickle of DCP's metadata dataclasses), `common.pt` and the `common_state` object inside
`.distcp` files (torch.save archives of Megatron-LM's args Namespace, optimizer/scheduler/RNG/rerun
state), and legacy `model_optim_rng.pt` rank files (torch.save archives). A pickle may name any
importable callable, so each is unpickled against ONE explicit allow-list (`ALLOWED`): plain pickles
by a `pickle.Unpickler` whose `find_class` refuses every other global (the pickle module's own
"restricting globals" rule; torch's weights-only unpickler cannot read them, it lacks protocol 4's
opcodes), torch.save archives by `torch.load(weights_only=True)` with the same list as its
`safe_globals` (tensors, storages, dtypes and `torch.Size` are built into it).

The allow-list is megatron-core's own (`megatron/core/safe_globals.py`, 0.19.2: what Megatron-LM's
`save_checkpoint` stores) plus DCP's metadata types. Megatron's enums and `OptimizerConfig`, and
DCP's metadata classes, are mapped to light stand-ins (`StoredObject`) so that reading a checkpoint
imports neither megatron-core nor torch.distributed.checkpoint (seconds of imports each); mconv
reads only plain fields of them.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import pickletools
import re
import signal
import types
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import IO

import torch

from mconv.errors import MconvError


class StoredObject:
    """Stands in for a class a checkpoint names that mconv reads without importing it: a Megatron
    enum member or dataclass (e.g. the args' `attention_backend`), or one of DCP's metadata
    dataclasses (importing torch.distributed.checkpoint costs seconds: it pulls in DTensor and
    sympy). It holds what the pickle gave it: `args` (an enum's value), `state` (and the state's
    fields as attributes when it is a dict)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        value = self.args[0] if len(self.args) == 1 else self.args
        return f"{type(self).__module__}.{type(self).__qualname__}({value!r})"


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2 without backward hooks or Python attributes (a bare tensor)."""
    if hooks or metadata:
        raise pickle.UnpicklingError("Unsupported global: GLOBAL torch._utils._rebuild_tensor_v2 with hooks")
    return torch._utils._rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    """torch._utils._rebuild_tensor_v3 (what torch.save writes for dtypes without a legacy typed
    storage: float8, uint16/32/64) without backward hooks or Python attributes (a bare tensor)."""
    if hooks or metadata or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("Unsupported global: GLOBAL torch._utils._rebuild_tensor_v3 with hooks")
    untyped = storage._untyped_storage
    return torch.empty((0,), dtype=dtype, device=untyped.device).set_(untyped, storage_offset, size, stride)


def _stand_in(path: str) -> tuple[type, str]:
    module, _, name = path.rpartition(".")
    return type(name, (StoredObject,), {"__module__": module, "__qualname__": name}), path


# megatron-core 0.19.2 safe_globals.SAFE_GLOBALS names these (plus the stdlib, NumPy and torch types
# below); the enum modules' other enums are listed too, as older Megatron-LM args stored them.
MEGATRON_NAMES = (
    "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe", "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType", "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.AttnType", "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


def _numpy_globals() -> list[tuple[object, str]]:
    """NumPy's RNG state (`np.random.get_state()`, in Megatron-LM's rng_state) is an ndarray: its
    reconstructor, class and dtypes, under NumPy 1's and NumPy 2's module names."""
    import numpy
    from numpy import dtypes

    reconstruct = numpy._core.multiarray._reconstruct if hasattr(numpy, "_core") else numpy.core.multiarray._reconstruct
    entries = [(reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct"),
               (numpy.ndarray, "numpy.ndarray"), (numpy.dtype, "numpy.dtype")]
    scalar = getattr(getattr(numpy, "_core", None) or numpy.core, "multiarray").scalar
    entries += [(scalar, "numpy.core.multiarray.scalar"), (scalar, "numpy._core.multiarray.scalar")]
    entries += [(cls, f"numpy.dtypes.{name}") for name, cls in vars(dtypes).items()
                if isinstance(cls, type) and issubclass(cls, numpy.dtype) and name != "StringDType"]
    return entries


# torch.distributed.checkpoint's `.metadata` (torch 2.11): its dataclasses and memory-format enum.
DCP_NAMES = tuple(f"torch.distributed.checkpoint.metadata.{name}" for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")) + ("torch.distributed.checkpoint.filesystem._StorageInfo",)


def _allowed() -> list[tuple[object, str]]:
    entries = [(cls, f"{cls.__module__}.{cls.__qualname__}") for cls in (
        argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO, signal.Signals, OrderedDict)]
    entries += [(torch._C.Generator, "torch._C.Generator"), (torch.Size, "torch.Size")]
    entries += [(value, f"torch.{name}") for name, value in vars(torch).items() if isinstance(value, torch.dtype)]
    entries += [_stand_in(name) for name in MEGATRON_NAMES + DCP_NAMES]
    entries += [(torch.serialization._get_layout, "torch.serialization._get_layout")]
    # A tensor in a torch.save archive (built into torch's weights-only unpickler; listed for DCP chunk headers).
    entries += [(_rebuild_tensor, "torch._utils._rebuild_tensor_v2")]
    entries += [(getattr(torch, name), f"torch.{name}") for name in dir(torch)
                if name.endswith("Storage") and isinstance(getattr(torch, name), type)
                and issubclass(getattr(torch, name), torch.storage._LegacyStorage)]
    return entries + _numpy_globals()


ALLOWED: dict[str, object] = {}  # "module.qualname" -> the object a pickle naming it gets


def _allow_list() -> dict[str, object]:
    if not ALLOWED:
        ALLOWED.update({name: obj for obj, name in _allowed()})
    return ALLOWED


class _RestrictedUnpickler(pickle.Unpickler):
    extra: dict[str, object] = {}

    def find_class(self, module: str, name: str):
        found = self.extra.get(f"{module}.{name}") or _allow_list().get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


class _MetadataUnpickler(_RestrictedUnpickler):
    """DCP's `.metadata`: its dataclasses over plain values (dtypes, torch.Size, a layout, the
    checkpoint's path). The rest of the allow-list (storages, NumPy arrays, which a torch.save
    archive's tensors and RNG state need) would only let a crafted file allocate memory here."""

    def find_class(self, module: str, name: str):
        found = _allow_list().get(f"{module}.{name}")
        if not (f"{module}.{name}" in _METADATA_NAMES or isinstance(found, torch.dtype)):
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


_METADATA_NAMES = frozenset(DCP_NAMES + ("torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath"))


class _TensorHeaderUnpickler(_RestrictedUnpickler):
    # A tensor of a dtype without a legacy typed storage names an untyped one (its persistent id,
    # which `load_tensor_header` allocates on the meta device) and the v3 rebuild.
    extra = {"torch.storage.UntypedStorage": torch.UntypedStorage, "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3}


def _refused_global(path: Path, error: Exception) -> MconvError | None:
    refused = re.search(r"GLOBAL ([\w.]+)", str(error))
    if refused:
        return MconvError(f"{path}: refused to unpickle {refused.group(1)} (not on mconv's allow-list; "
                          "nothing in a checkpoint is executed)")
    return None


# The opcodes pickle protocols 4 and 5 added, which torch.save(..., pickle_protocol=4) writes and torch's
# weights-only unpickler refuses (torch 2.6 to 2.11).
_PROTOCOL_4_OPCODES = {ord(op.code) for op in pickletools.opcodes if op.proto >= 4}


def _detail(error: Exception) -> str:
    """torch's or pickle's reason, short: its first sentence only, as torch's later ones are advice that
    must not be shown (re-run torch.load with weights_only=False, file an issue, how zips get corrupt)."""
    text = str(error).split("WeightsUnpickler error:")[-1]  # after torch's weights-only preamble
    text = text.replace("PytorchStreamReader failed reading zip archive: ", "").replace("Unsupported operand",
                                                                                        "unsupported pickle opcode")
    first = re.split(r"\.\s|\n", text.strip())[0].strip().rstrip(".")
    return type(error).__name__ if not first or isinstance(error, KeyError) else first  # a KeyError's text: a key


def _refusal(path: Path, error: Exception, what: str) -> MconvError:
    return _refused_global(path, error) or MconvError(
        f"{path} is not a readable {what}: it is truncated or corrupt ({_detail(error)})")


def load_pickle(path: Path, data: bytes | None = None) -> object:
    """Unpickle DCP's `.metadata` (a plain pickle) from `data` or the file at `path`, refusing every
    global but its own part of the allow-list (_MetadataUnpickler). Raises MconvError naming the
    file (and the refused global)."""
    try:
        if data is None:
            data = path.read_bytes()
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except MconvError:
        raise
    except Exception as e:  # corrupt pickles raise assorted types (EOFError, ValueError, KeyError...)
        raise _refusal(path, e, "pickle") from None


ZIP_MAGIC = b"PK\x03\x04"  # how torch.load tells its zip archive (torch >= 1.6's default) from its older format
LEGACY_MAGIC = torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")  # what the older format's first pickle holds


def load_torch(path: Path, source: IO[bytes] | None = None, mmap: bool = False) -> object:
    """torch.load with weights_only=True and the allow-list as safe globals, from `source` or the
    file at `path` (memory-mapped with `mmap`: tensors are read on access). A file in torch's older
    pre-zip format (`torch.save(..., _use_new_zipfile_serialization=False)`, torch < 1.6's default,
    which transformers reads too) cannot be mapped: it is read whole into memory, through the same
    weights-only unpickler (torch 2.6 to 2.11 apply weights_only and the allow-list to that format).
    Raises MconvError; its sentence says what the file is by its first bytes, as torch's own text may
    be paragraphs of advice (such as re-running torch.load without weights_only)."""
    where = f"an object stored in {path}" if source is not None else f"{path}"
    try:
        if source is None:
            with open(path, "rb") as f:
                head = f.read(32)
        else:
            start, head = source.tell(), source.read(32)
            source.seek(start)
    except OSError as e:
        raise MconvError(f"{path} cannot be read: {e.strerror or e}") from None
    zipped = head.startswith(ZIP_MAGIC)
    if not zipped and LEGACY_MAGIC not in head:  # torch's unpickler is not started on what is no torch.save
        raise MconvError(f"{where} is not a torch.save file: " + (
            "it is neither a zip archive nor in torch's older pre-zip format" if head else "it is empty"))
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in _allow_list().items()]), \
                warnings.catch_warnings():
            # torch's warnings while loading are advice to torch's users (file an issue about a pickle
            # protocol above 2; sparse invariant checks, for a sparse tensor mconv refuses): what matters
            # is told in mconv's one line
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            return torch.load(path if source is None else source, map_location="cpu", weights_only=True,
                              mmap=mmap and zipped)
    except Exception as e:  # UnpicklingError for refused globals; RuntimeError/EOFError/... for corrupt files
        opcode = re.search(r"Unsupported operand (\d+)", str(e))
        reason = ("it is a TorchScript archive (torch.jit.save), not a torch.save one" if "TorchScript" in str(e) else
                  f"it was pickled with protocol 4 or higher (pickle opcode {opcode[1]}), which torch's weights-only "
                  "loader does not read: save it again with torch.save's default pickle_protocol"
                  if opcode and int(opcode[1]) in _PROTOCOL_4_OPCODES else
                  f"it is a truncated or corrupt zip archive ({_detail(e)})" if zipped else
                  f"it is truncated or corrupt (torch's pre-zip format: {_detail(e)})")
        raise _refused_global(path, e) or MconvError(f"{where} is not a readable torch.save file: {reason}") from None


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor torch.load gave is a dense CPU one: it also rebuilds sparse, quantized, nested
    and meta tensors, none of which is a weight whose bytes can be read or mapped as one."""
    return (tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested
            and tensor.device.type == "cpu")


def load_tensor_header(path: Path, data: bytes) -> tuple[torch.Tensor, str]:
    """The tensor a torch.save archive's `data.pkl` describes, on the meta device (no bytes read),
    and the name of its storage record. Raises MconvError."""
    records = []

    def persistent_load(pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
                and isinstance(pid[4], int) and (pid[1] is torch.UntypedStorage or isinstance(pid[1], type)
                                                 and issubclass(pid[1], torch.storage._LegacyStorage))):
            raise pickle.UnpicklingError(f"a persistent id that is not a tensor storage: {str(pid)[:80]}")
        records.append(pid[2])
        dtype = (torch.uint8 if pid[1] is torch.UntypedStorage  # its size is in bytes
                 else torch.storage._get_dtype_from_pickle_storage_type(pid[1].__name__))
        storage = torch.UntypedStorage(pid[4] * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    try:
        unpickler = _TensorHeaderUnpickler(io.BytesIO(data))
        unpickler.persistent_load = persistent_load
        tensor = unpickler.load()
        if not isinstance(tensor, torch.Tensor) or len(records) != 1:
            raise pickle.UnpicklingError("it is not one tensor")
    except Exception as e:  # refused globals and corrupt pickles alike
        raise _refusal(path, e, "tensor archive") from None
    return tensor, records[0]
