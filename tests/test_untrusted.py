"""Nothing in a checkpoint executes: every pickle-bearing file mconv reads (DCP `.metadata`,
`common.pt`, the `common_state` object and tensor chunks inside `.distcp` files, legacy rank files)
is refused with one sentence when it names a global outside the allow-list, by every command and
library call, and the payload never runs. The oracle is the payload itself: a `__reduce__` that
would create a marker file."""
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mconv import Layout, hf2mcore
from mconv.converter.lora import export_lora
from mconv.converter.describe import inspect_path
from mconv.converter.pipelines import mcore2hf
from mconv.errors import MconvError
from tests.conftest import FIXTURES
from tests.test_errors import assert_refused, mconv

TINY = FIXTURES / "qwen3-tiny"


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    hf2mcore(TINY, root / "torch_dist", Layout(), progress=False)
    hf2mcore(TINY, root / "torch", Layout(tp=2), fmt="torch", progress=False)
    return root


def _dcp_metadata(iter_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(iter_dir)).read_metadata()  # the test's own, trusted checkpoint


def _append_object(iter_dir: Path, metadata, fqn: str, obj, offset=None) -> None:
    """Store `obj` (torch.save'd) at the end of __0_0.distcp and point `fqn`'s storage entry at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    data = io.BytesIO()
    torch.save(obj, data)
    path = iter_dir / "__0_0.distcp"
    start = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn == fqn and (offset is None or tuple(i.offset) == offset))
    metadata.storage_data[index] = _StorageInfo("__0_0.distcp", start, len(data.getvalue()))
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def poison_metadata(iter_dir: Path, marker: Path) -> None:
    metadata = _dcp_metadata(iter_dir)
    metadata.planner_data = Payload(marker)
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def poison_common_pt(iter_dir: Path, marker: Path) -> None:
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    common["args"].payload = Payload(marker)
    torch.save(common, iter_dir / "common.pt")


def poison_common_state(iter_dir: Path, marker: Path) -> None:
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    (iter_dir / "common.pt").unlink()  # megatron-core 0.19 then reads the common_state object
    common["payload"] = Payload(marker)
    _append_object(iter_dir, _dcp_metadata(iter_dir), "common_state/shard_0_1", [common])


def poison_tensor_chunk(iter_dir: Path, marker: Path) -> None:
    _append_object(iter_dir, _dcp_metadata(iter_dir), "embedding.word_embeddings.weight", Payload(marker))


def poison_rank_file(iter_dir: Path, marker: Path) -> None:
    path = iter_dir / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["optimizer"] = {"payload": Payload(marker)}
    torch.save(state, path)


KINDS = {
    ".metadata": ("torch_dist", poison_metadata, "posix.system"),
    "common.pt": ("torch_dist", poison_common_pt, "posix.system"),
    "common_state in .distcp": ("torch_dist", poison_common_state, "posix.system"),
    "tensor chunk in .distcp": ("torch_dist", poison_tensor_chunk, "posix.system"),
    "model_optim_rng.pt": ("torch", poison_rank_file, "posix.system"),
}
# A tensor chunk is unpickled only when its tensor is read: inspect reads no tensor data, and
# export-lora reads only adapter tensors (these checkpoints have none: it stops, saying so).
READS_CHUNKS = {"mcore2hf"}


def poisoned(checkpoints: Path, tmp_path: Path, kind: str) -> tuple[Path, Path]:
    fmt, poison, _ = KINDS[kind]
    ckpt = Path(shutil.copytree(checkpoints / fmt, tmp_path / "ckpt"))
    marker = tmp_path / "marker"
    poison(ckpt / "release", marker)
    return ckpt, marker


def unchanged(ckpt: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["inspect", "mcore2hf", "export-lora"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_payload_is_refused_by_the_cli(checkpoints, tmp_path, kind, command):
    ckpt, marker = poisoned(checkpoints, tmp_path, kind)
    before = unchanged(ckpt)
    out = tmp_path / "out"
    args = {"inspect": [ckpt], "mcore2hf": [ckpt, out, "-q"], "export-lora": [ckpt, out, "--alpha", 1, "-q"]}[command]
    result = mconv(command, *args)
    if kind == "tensor chunk in .distcp" and command not in READS_CHUNKS:
        assert result.exit_code == (0 if command == "inspect" else 1), result.output
    else:
        assert_refused(result, out, "refused to unpickle", KINDS[kind][2], str(ckpt))
    assert not marker.exists()
    assert unchanged(ckpt) == before


@pytest.mark.parametrize("kind", list(KINDS))
def test_payload_is_refused_by_the_library(checkpoints, tmp_path, kind):
    ckpt, marker = poisoned(checkpoints, tmp_path, kind)
    calls = [lambda: mcore2hf(ckpt, tmp_path / "hf", progress=False)]
    if kind != "tensor chunk in .distcp":
        calls += [lambda: inspect_path(ckpt), lambda: export_lora(ckpt, tmp_path / "adapter", alpha=1.0)]
    for call in calls:
        with pytest.raises(MconvError, match="refused to unpickle posix.system"):
            call()
    assert not marker.exists() and not (tmp_path / "hf").exists() and not (tmp_path / "adapter").exists()
