"""`.metadata` is pickled from mconv's stand-ins of DCP's classes (converter/dcp_stand_in) without
importing torch.distributed. Oracle: torch itself. The bytes equal `pickle.dumps` of the same
metadata built from torch.distributed.checkpoint's own classes (dense, MoE and VL checkpoints, one
and several writers, pickles of one and of many frames), torch's `FileSystemReader` reads the file
back equal to that object, and a `.metadata` written by `hf2mcore` is exactly the pickle of what
torch reads from it."""
import dataclasses
import enum
import pickle

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader

from mconv import Layout, hf2mcore, mcore2hf
from mconv.converter import dcp_stand_in, torch_dist, torch_dist_write
from mconv.converter.dcp_stand_in import filesystem, metadata
from tests.conftest import FIXTURES
from tests.test_torch_dist_keys import _dtype, config, flat_plan_and_args

TORCH = {metadata: dcp_metadata, filesystem: dcp_filesystem}
STAND_INS = [(module, value) for module in TORCH for value in vars(module).values()
             if isinstance(value, type) and value.__module__ == module.__name__]


def to_torch(value):
    """The same record built from DCP's own classes, through their constructors; the leaves (keys,
    file names, dtypes, sizes, ints) are the very same objects, so the memo structure is the same."""
    if dataclasses.is_dataclass(value):
        module = next(m for m in TORCH if m.__name__ == type(value).__module__)
        cls = getattr(TORCH[module], type(value).__qualname__)
        return cls(**{f.name: to_torch(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {to_torch(k): to_torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_torch(v) for v in value]
    return value


def test_stand_ins_have_dcp_names_fields_and_defaults():
    assert {cls.__qualname__ for _, cls in STAND_INS} == {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo"}
    for module, cls in STAND_INS:
        theirs = getattr(TORCH[module], cls.__qualname__)
        assert f"{theirs.__module__}.{theirs.__qualname__}" == (
            dcp_stand_in.DCP_PREFIX + cls.__module__[len(dcp_stand_in.PREFIX):] + "." + cls.__qualname__)
        if issubclass(cls, enum.Enum):
            assert [(m.name, m.value) for m in cls] == [(m.name, m.value) for m in theirs]
            continue
        described = lambda c: [(f.name, f.default, f.default_factory, f.init, f.hash, f.compare)
                               for f in dataclasses.fields(c)]
        assert described(cls) == described(theirs)
        assert cls.__dataclass_params__.frozen == theirs.__dataclass_params__.frozen
    assert filesystem.CURRENT_DCP_VERSION == dcp_filesystem.CURRENT_DCP_VERSION


def test_tensor_properties_and_index_pickle_as_torchs():
    """The records with their own pickled state: every memory format, an index with and without offsets."""
    for fmt in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        for ours in (metadata.TensorProperties(torch.float16, memory_format=fmt, requires_grad=True),
                     metadata.TensorProperties()):
            assert dcp_stand_in.dumps(ours) == pickle.dumps(to_torch(ours))
            assert pickle.loads(pickle.dumps(to_torch(ours))) == to_torch(ours)
    for ours in (metadata.MetadataIndex("a"), metadata.MetadataIndex("a", [1, 2], 3),
                 filesystem._StorageInfo("f", 1, 2), filesystem._StorageInfo("f", 1, 2, ["zstd"])):
        assert dcp_stand_in.dumps(ours) == pickle.dumps(to_torch(ours))


def checkpoint_entries(hf_config: dict, layout: Layout):
    """The entries hf2mcore writes for a model (no tensors are built)."""
    flat, args = flat_plan_and_args(hf_config, layout)
    dtypes = {t.megatron: _dtype(t.megatron) for t in flat.ranks[0].chunks[0]}
    return torch_dist.entries(flat, args, {"args": args}, lambda task, start, stop: (), dtypes)


def placements(entries, members: int):
    """Where `members` writers put the entries (their shares, one after another in each file)."""
    placed = []
    for member in range(members):
        at = 0
        for i in torch_dist_write.member_share(entries, member, members):
            entry, length = entries[i], 700 + entries[i].nbytes
            placed.append((entry.key, entry.offsets if entry.global_shape is not None else None,
                           torch_dist_write.data_file(member), at, length))
            at += length
    return placed


MOE_48 = config("qwen3-moe-tiny", mlp_only_layers=[], num_hidden_layers=48, num_experts=128, hidden_size=256,
                moe_intermediate_size=64, intermediate_size=256)
CASES = {
    "dense, tied": (config("qwen3-tiny-tied"), Layout(), 1),
    "mixed dense/moe, 3 writers": (config("qwen3-moe-tiny"), Layout(tp=2), 3),
    "vl moe": (config("qwen3-vl-moe-tiny"), Layout(), 2),
    "moe, 48 layers (many frames)": (MOE_48, Layout(), 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_metadata_bytes_equal_torchs_pickle_and_torch_reads_them(tmp_path, case):
    hf_config, layout, members = CASES[case]
    entries = checkpoint_entries(hf_config, layout)
    ours = torch_dist_write.dcp_metadata(entries, placements(entries, members), str(tmp_path), "a-save-id")
    data = dcp_stand_in.dumps(ours)
    theirs = to_torch(ours)
    assert data == pickle.dumps(theirs)
    assert any(isinstance(e, dcp_metadata.BytesStorageMetadata) for e in theirs.state_dict_metadata.values())
    assert (len(data) > 2 ** 16) == (case == "moe, 48 layers (many frames)")  # pickle frames are 64 KiB
    (tmp_path / ".metadata").write_bytes(data)
    read = FileSystemReader(tmp_path).read_metadata()
    assert type(read) is dcp_metadata.Metadata and read.storage_meta.load_id
    read.storage_meta.load_id = None
    assert read == theirs


@pytest.mark.parametrize("fixture,workers", [("qwen3-tiny", 1), ("qwen3-moe-tiny", 2), ("bailing-v3-tiny", 1)])
def test_hf2mcore_metadata_is_torchs_pickle_of_what_torch_reads(tmp_path, fixture, workers):
    """The file as written (random save_id, the staging path as checkpoint_id): torch reads DCP's
    own classes from it, and pickling what it read gives the file back, byte for byte."""
    hf2mcore(FIXTURES / fixture, tmp_path / "m", Layout(), progress=False, workers=workers)
    iter_dir = tmp_path / "m" / "release"
    read = FileSystemReader(iter_dir).read_metadata()
    read.storage_meta.load_id = None
    assert {info.relative_path for info in read.storage_data.values()} == {f"__{m}_0.distcp" for m in range(workers)}
    assert pickle.dumps(read) == (iter_dir / ".metadata").read_bytes()


def test_checkpoint_resaved_by_torchs_own_dcp_converts_back(tmp_path):
    """torch's DCP (`dcp.load`, then `dcp.save`: this torch's own `.metadata` and `.distcp` files, the
    records of whatever version is installed, 2.6 in the oldest set-up) rewrites hf2mcore's torch_dist
    output; mcore2hf of that gives the HF model back bit for bit."""
    import io

    import torch.distributed.checkpoint as dcp

    from tests.conftest import assert_hf_bits_equal, hf_tensors

    hf2mcore(FIXTURES / "qwen3-moe-tiny", tmp_path / "m", Layout(tp=2), progress=False)
    written, resaved = tmp_path / "m" / "release", tmp_path / "resaved"
    state = {key: io.BytesIO() if isinstance(item, dcp_metadata.BytesStorageMetadata)
             else torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in FileSystemReader(written).read_metadata().state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=written)  # one process, no process group
    dcp.save(state, checkpoint_id=resaved)
    for path in [written / ".metadata", *written.glob("*.distcp")]:  # common.pt and metadata.json stay
        path.unlink()
    for path in resaved.iterdir():
        path.rename(written / path.name)
    mcore2hf(tmp_path / "m", tmp_path / "hf", progress=False)
    assert_hf_bits_equal(hf_tensors(FIXTURES / "qwen3-moe-tiny"), tmp_path / "hf")
