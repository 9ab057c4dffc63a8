"""Nothing in a checkpoint executes: every pickle-bearing file mconv reads (DCP `.metadata`,
`common.pt`, the `common_state` object and tensor chunks inside `.distcp` files, legacy rank files)
is refused with one sentence when it names a global outside the allow-list, by every command and
library call, and the payload never runs. The oracle is the payload itself: a `__reduce__` that
would create a marker file."""
import argparse
import io
import os
import pickle
import shutil
from pathlib import Path

import numpy
import pytest
import torch

from mconv import Layout, hf2mcore
from mconv.converter.lora import export_lora
from mconv.converter.describe import inspect_path
from mconv.converter.mcore2hf import mcore2hf
from mconv.errors import MconvError
from tests.conftest import FIXTURES, load_rank_file
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


def array_in_metadata(iter_dir: Path, marker: Path) -> None:
    """A NumPy array in .metadata: on the allow-list for RNG state in torch.save archives, not for
    .metadata, where it could only make the reader allocate what the file says (code review)."""
    metadata = _dcp_metadata(iter_dir)
    metadata.planner_data = numpy.zeros(4)
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def poison_common_pt(iter_dir: Path, marker: Path) -> None:
    common = load_rank_file(iter_dir / "common.pt")
    common["args"].payload = Payload(marker)
    torch.save(common, iter_dir / "common.pt")


def poison_common_state(iter_dir: Path, marker: Path) -> None:
    common = load_rank_file(iter_dir / "common.pt")
    (iter_dir / "common.pt").unlink()  # megatron-core 0.19 then reads the common_state object
    common["payload"] = Payload(marker)
    _append_object(iter_dir, _dcp_metadata(iter_dir), "common_state/shard_0_1", [common])


def poison_tensor_chunk(iter_dir: Path, marker: Path) -> None:
    _append_object(iter_dir, _dcp_metadata(iter_dir), "embedding.word_embeddings.weight", Payload(marker))


def poison_float8_chunk(iter_dir: Path, marker: Path) -> None:
    """A float8 chunk (torch.save's v3 rebuild, which the chunk reader allows) carrying the payload
    as a Python attribute."""
    tensor = torch.zeros(1, dtype=torch.float8_e4m3fn)
    tensor.payload = Payload(marker)
    _append_object(iter_dir, _dcp_metadata(iter_dir), "embedding.word_embeddings.weight", tensor)


def poison_rank_file(iter_dir: Path, marker: Path) -> None:
    path = iter_dir / "mp_rank_01" / "model_optim_rng.pt"
    state = load_rank_file(path)
    state["optimizer"] = {"payload": Payload(marker)}
    torch.save(state, path)


ARRAY_REBUILD = numpy.zeros(1).__reduce__()[0]  # (numpy._core.multiarray._reconstruct in NumPy 2)
KINDS = {
    ".metadata": ("torch_dist", poison_metadata, "posix.system"),
    "array in .metadata": ("torch_dist", array_in_metadata, f"{ARRAY_REBUILD.__module__}.{ARRAY_REBUILD.__name__}"),
    "common.pt": ("torch_dist", poison_common_pt, "posix.system"),
    "common_state in .distcp": ("torch_dist", poison_common_state, "posix.system"),
    "tensor chunk in .distcp": ("torch_dist", poison_tensor_chunk, "posix.system"),
    "float8 tensor chunk in .distcp": ("torch_dist", poison_float8_chunk, "torch._tensor._rebuild_from_type_v2"),
    "model_optim_rng.pt": ("torch", poison_rank_file, "posix.system"),
}
# A tensor chunk is unpickled only when its tensor is read: inspect reads no tensor data, and
# export-lora reads only adapter tensors (these checkpoints have none: it stops, saying so).
READS_CHUNKS = {"mcore2hf"}
CHUNKS = {"tensor chunk in .distcp", "float8 tensor chunk in .distcp"}


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
    if kind in CHUNKS and command not in READS_CHUNKS:
        assert result.exit_code == (0 if command == "inspect" else 1), result.output
    else:
        assert_refused(result, out, "refused to unpickle", KINDS[kind][2], str(ckpt))
    assert not marker.exists()
    assert unchanged(ckpt) == before


@pytest.mark.parametrize("kind", list(KINDS))
def test_payload_is_refused_by_the_library(checkpoints, tmp_path, kind):
    ckpt, marker = poisoned(checkpoints, tmp_path, kind)
    calls = [lambda: mcore2hf(ckpt, tmp_path / "hf", progress=False)]
    if kind not in CHUNKS:
        calls += [lambda: inspect_path(ckpt), lambda: export_lora(ckpt, tmp_path / "adapter", alpha=1.0)]
    for call in calls:
        with pytest.raises(MconvError, match=f"refused to unpickle {KINDS[kind][2]}"):
            call()
    assert not marker.exists() and not (tmp_path / "hf").exists() and not (tmp_path / "adapter").exists()


# ------------------------------------------- torch files that are not torch.save's, or in its pre-zip format

def _pre_zip(path: Path, state=None, **options) -> bytes:
    """`path`'s state (or `state`) saved again in torch's pre-zip format (torch < 1.6's default), or
    with torch.save's other `options` (`_use_new_zipfile_serialization=True`: a zip archive)."""
    data = io.BytesIO()
    torch.save(load_rank_file(path) if state is None else state, data,
               **{"_use_new_zipfile_serialization": False, **options})
    return data.getvalue()


TORCH_FILES = {  # what holds a torch.save file: (the checkpoint, the file, the command reading it)
    "common.pt": ("torch_dist", "release/common.pt", "mcore2hf"),
    "rank file": ("torch", "release/mp_rank_01/model_optim_rng.pt", "mcore2hf"),
    "pytorch_model.bin": ("hf", "pytorch_model.bin", "hf2mcore"),
}
DAMAGE = {  # the file's new bytes (from its valid ones) and what the sentence says of them
    "empty": (lambda data, path: b"", "is not a torch.save file: it is empty"),
    "a newline": (lambda data, path: b"\n", "is not a torch.save file: it is neither a zip archive nor in torch's"),
    "text": (lambda data, path: b"hi", "is not a torch.save file: it is neither a zip archive nor in torch's"),
    "zip magic, then garbage": (lambda data, path: b"PK\x03\x04garbage", "truncated or corrupt zip archive"),
    "half a zip archive": (lambda data, path: data[:len(data) // 2], "truncated or corrupt zip archive"),
    "half a pre-zip file": (lambda data, path: _pre_zip(path)[:-100], "truncated or corrupt (torch's pre-zip format"),
    "pickle protocol 4": (lambda data, path: _pre_zip(path, pickle_protocol=4, _use_new_zipfile_serialization=True),
                          "was pickled with protocol 4 or higher (pickle opcode 149), which torch's weights-only "
                          "loader does not read: save it again with torch.save's default pickle_protocol"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("where", list(TORCH_FILES))
def test_a_torch_file_that_cannot_be_read_is_one_sentence_of_mconvs(checkpoints, tmp_path, where, damage):
    """What the file is, in mconv's words: never torch's own text, which says to re-run torch.load
    with weights_only=False (turning the restricted unpickler off), or explains miniz and mmap."""
    tree, name, command = TORCH_FILES[where]
    if tree == "hf":
        ckpt = Path(shutil.copytree(TINY, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors")))
        from safetensors.torch import load_file

        torch.save(load_file(TINY / "model.safetensors"), ckpt / name)
    else:
        ckpt = Path(shutil.copytree(checkpoints / tree, tmp_path / "ckpt"))
    path = ckpt / name
    make, said = DAMAGE[damage]
    path.write_bytes(make(path.read_bytes(), path))
    before, out = unchanged(ckpt), tmp_path / "out"
    result = mconv(command, ckpt, out, "-q")
    assert_refused(result, out, f"{path} ", said)
    for torchs in ("weights_only", "Weights only", "torch.load", "miniz", "mmap", "please", "file an issue"):
        assert torchs not in result.stderr, result.stderr
    assert unchanged(ckpt) == before


def test_rank_files_in_torchs_pre_zip_format_convert_and_stay_restricted(checkpoints, tmp_path):
    """Legacy rank files saved in torch's pre-zip format (`_use_new_zipfile_serialization=False`,
    which torch cannot memory-map; torch.load and transformers read it) convert to what the zip
    originals convert to. The restricted unpickler reads that format too (torch 2.6 and 2.11 apply
    weights_only to it): a global outside the allow-list there is refused, and does not run."""
    ckpt = Path(shutil.copytree(checkpoints / "torch", tmp_path / "ckpt"))
    for path in ckpt.glob("release/mp_rank_*/model_optim_rng.pt"):
        path.write_bytes(_pre_zip(path))
        assert not path.read_bytes().startswith(b"PK")
    for source, out in ((checkpoints / "torch", tmp_path / "zip"), (ckpt, tmp_path / "pre-zip")):
        assert mconv("mcore2hf", source, out, "-q").exit_code == 0
    assert unchanged(tmp_path / "zip") == {tmp_path / "zip" / p.relative_to(tmp_path / "pre-zip"): data
                                           for p, data in unchanged(tmp_path / "pre-zip").items()}
    path, marker = ckpt / "release" / "mp_rank_01" / "model_optim_rng.pt", tmp_path / "marker"
    state = load_rank_file(checkpoints / "torch" / "release" / "mp_rank_01" / "model_optim_rng.pt")
    path.write_bytes(_pre_zip(path, {**state, "optimizer": {"payload": Payload(marker)}}))
    out = tmp_path / "out"
    assert_refused(mconv("mcore2hf", ckpt, out, "-q"), out, str(path), "refused to unpickle posix.system")
    with pytest.raises(MconvError, match="refused to unpickle posix.system"):
        inspect_path(ckpt)
    assert not marker.exists()


# ------------------------------------------- what the unpickler allows, in the wrong shape

EMBEDDING = "embedding.word_embeddings.weight"
LORA_B = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"


def _rank_files(edit, named="mp_rank_00/model_optim_rng.pt"):  # the first rank file read
    def apply(ckpt: Path) -> Path:
        for path in sorted(ckpt.glob("release/mp_rank_*/model_optim_rng.pt")):
            state = load_rank_file(path)
            edit(state)
            torch.save(state, path)
        return ckpt / "release" / named
    return apply


def _common_pt(make):
    def apply(ckpt: Path) -> Path:
        path = ckpt / "release" / "common.pt"
        torch.save(make(load_rank_file(path)), path)
        return path
    return apply


def _common_state_object(value):
    """common.pt removed, so that megatron-core 0.19's `common_state` object in the .distcp is read."""
    def apply(ckpt: Path) -> Path:
        iter_dir = ckpt / "release"
        (iter_dir / "common.pt").unlink()
        _append_object(iter_dir, _dcp_metadata(iter_dir), "common_state/shard_0_1", [value])
        return iter_dir / "__0_0.distcp"
    return apply


def _with(key, value):
    return lambda state: state.__setitem__(key, value)


def _in_model(key, value):
    return lambda state: state["model"].__setitem__(key, value(state["model"].get(key)))


def _arg(name, value):
    return lambda state: setattr(state["args"], name, value)


def _as_vpp_chunks(state):  # the one chunk as 'model0', and a second that is not a chunk
    state["model0"], state["model1"] = state.pop("model"), "x"


def _stored_dtype(ckpt: Path) -> Path:
    """.metadata says a tensor the export reads is complex64."""
    import dataclasses

    iter_dir = ckpt / "release"
    metadata = _dcp_metadata(iter_dir)
    entry = metadata.state_dict_metadata["decoder.final_layernorm.weight"]
    entry.properties = dataclasses.replace(entry.properties, dtype=torch.complex64)
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return iter_dir


def _overlapping_chunks(ckpt: Path) -> Path:
    """.metadata stores decoder.final_layernorm.weight [64] as two chunks that overlap, [0, 32) and
    [16, 48), and leave [48, 64) unstored: their sizes add up to the tensor's (code review: read so,
    its last quarter came back as whatever memory held)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    iter_dir, key = ckpt / "release", "decoder.final_layernorm.weight"
    metadata = _dcp_metadata(iter_dir)
    entry = metadata.state_dict_metadata[key]
    assert tuple(entry.size) == (64,)
    weight = torch.arange(64).to(entry.properties.dtype)
    metadata.storage_data[MetadataIndex(key, torch.Size([16]))] = None  # (pointed at its chunk below)
    entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([32])),
                    ChunkStorageMetadata(torch.Size([16]), torch.Size([32]))]
    for start in (0, 16):
        _append_object(iter_dir, metadata, key, weight[start:start + 32].clone(), offset=(start,))
    return iter_dir


ALL = ("mcore2hf", "inspect", "export-lora")
SHAPES = {  # the checkpoint, how it is edited (returns the file named), the commands refusing it, what they say
    "'model' a str": ("torch", _rank_files(_with("model", "hello")), ALL, "'model' is a str, not a dict of tensors"),
    "'model' None": ("torch", _rank_files(_with("model", None)), ALL, "'model' is None, not a dict of tensors"),
    "'model' a list": ("torch", _rank_files(_with("model", [1, 2])), ALL, "'model' is a list, not a dict of tensors"),
    "'model1' a str": ("torch", _rank_files(_as_vpp_chunks), ALL, "'model1' is a str, not a dict of tensors"),
    "a tensor a str": ("torch", _rank_files(_in_model(EMBEDDING, lambda t: "str")), ALL,
                       f"{EMBEDDING} in 'model' is a str, not a tensor"),
    "a tensor an int": ("torch", _rank_files(_in_model(EMBEDDING, lambda t: 5)), ALL,
                        f"{EMBEDDING} in 'model' is an int, not a tensor"),
    "a sparse tensor": ("torch", _rank_files(_in_model(EMBEDDING, lambda t: t.to_sparse())), ALL,
                        f"{EMBEDDING} in 'model' is a sparse, quantized, nested or meta tensor"),
    "a key not a name": ("torch", _rank_files(_in_model(5, lambda t: torch.zeros(1))), ALL,
                         "entry 5 of 'model' is not a tensor name"),
    "a dtype safetensors lacks": ("torch", _rank_files(_in_model("decoder.final_layernorm.weight",
                                                                 lambda t: t.to(torch.uint16))),
                                  ("mcore2hf", "inspect"), "decoder.final_layernorm.weight has dtype uint16"),
    "'args' a str": ("torch", _rank_files(_with("args", "x")), ALL,
                     "'args' is a str, not the training arguments (argparse.Namespace)"),
    "a size a list": ("torch", _rank_files(_arg("num_layers", [4])), ALL,
                      "the saved args give num_layers=[4], not a whole number"),
    "a VPP without PP": ("torch", _rank_files(_arg("virtual_pipeline_model_parallel_size", 2)), ALL,
                         "in the saved args, --vpp needs --pp > 1"),
    "LoRA B of r 0": ("torch", _rank_files(_in_model(LORA_B, lambda t: torch.zeros(64, 0)), ""), ("export-lora",),
                      f"{LORA_B} has shape [64, 0], not a LoRA B's [out, r] with r at least 1"),
    "LoRA B of no axes": ("torch", _rank_files(_in_model(LORA_B, lambda t: torch.tensor(1.0)), ""), ("export-lora",),
                          f"{LORA_B} has shape [], not a LoRA B's"),
    "common.pt 'args' a str": ("torch_dist", _common_pt(lambda common: {**common, "args": "x"}), ALL,
                               "'args' is a str, not the training arguments (argparse.Namespace)"),
    "common.pt a list": ("torch_dist", _common_pt(lambda common: [1, 2]), ALL,
                         "holds a list, not megatron-core's common state (a dict)"),
    "common.pt a rope name a list": ("torch_dist", _common_pt(lambda common: common["args"].__setattr__(
        "position_embedding_type", ["rope"]) or common), ALL, "position_embedding_type=['rope'], not a name"),
    "common_state a list": ("torch_dist", _common_state_object([1, 2]), ALL,
                            "(common_state/shard_0_1) holds a list, not megatron-core's common state"),
    "common_state 'args' a str": ("torch_dist", _common_state_object({"args": "x"}), ALL,
                                  "(common_state/shard_0_1): 'args' is a str, not the training arguments"),
    "stored dtype safetensors lacks": ("torch_dist", _stored_dtype, ("mcore2hf", "inspect"),
                                       "decoder.final_layernorm.weight has dtype complex64"),
    "overlapping chunks": ("torch_dist", _overlapping_chunks, ("mcore2hf",),
                           "the stored chunks of decoder.final_layernorm.weight at [0] and [16] overlap"),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_allowed_objects_of_the_wrong_shape_are_one_sentence(checkpoints, tmp_path, case):
    """Objects the restricted unpickler allows (str, list, None, int keys, sparse tensors, another
    Namespace field type) where a checkpoint holds a dict of tensors, the args Namespace or the
    common state: each command that reads it says what is wrong, naming the file and the entry,
    writes nothing and leaves the checkpoint as it was."""
    fmt, edit, commands, said = SHAPES[case]
    ckpt = Path(shutil.copytree(checkpoints / fmt, tmp_path / "ckpt"))
    named = edit(ckpt)
    before, out = unchanged(ckpt), tmp_path / "out"
    for command in commands:
        result = mconv(command, ckpt, *([] if command == "inspect" else [out, "-q"]),
                       *(["--alpha", 1] if command == "export-lora" else []))
        assert_refused(result, out, str(named), said)
    assert unchanged(ckpt) == before


def test_inspect_describes_moe_args_without_a_router_top_k(checkpoints, tmp_path):
    """Args saved by another tool may set num_experts without moe_router_topk or moe_ffn_hidden_size
    (Megatron-LM always stores them): inspect, reading the args alone (no HF config), says so."""
    ckpt = Path(shutil.copytree(checkpoints / "torch_dist", tmp_path / "ckpt"))
    shutil.rmtree(ckpt / "hf_config")
    common = load_rank_file(ckpt / "release" / "common.pt")
    common["args"].num_experts = 8
    del common["args"].moe_ffn_hidden_size
    torch.save(common, ckpt / "release" / "common.pt")
    result = mconv("inspect", ckpt)
    assert result.exit_code == 0, result.output
    assert "8 experts, top unknown, expert ffn unknown" in result.stdout


# ------------------------------------------------------- real training checkpoints still load

def training_args(stored) -> "argparse.Namespace":
    """The full args Namespace Megatron-LM stores: its own parser's defaults (enums such as
    `attention_backend`, dtypes, lists, paths) with the model's args laid over them."""
    import contextlib
    import sys

    import megatron.training.arguments as arguments

    argv, sys.argv = sys.argv, ["pretrain_gpt.py"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
    finally:
        sys.argv = argv
    for name, value in vars(stored).items():
        setattr(args, name, value)
    args.main_grads_dtype = args.main_params_dtype = args.exp_avg_dtype = args.exp_avg_sq_dtype = torch.float32
    return args


def training_state(model, args, sharded: bool) -> dict:
    """What Megatron-LM's save_checkpoint adds beside the model, built with megatron-core: Adam's
    state (sharded like the parameters, through megatron-core's optim_state_to_sharding_state, for
    torch_dist), the LR scheduler's and rerun state machine's state dicts, RNG state with NumPy's."""
    import random

    import numpy as np
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine, initialize_rerun_state_machine

    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    adam = torch.optim.Adam(params, lr=0.0)  # state as after a step, weights unchanged
    adam.step()
    scheduler = OptimizerParamScheduler(adam, init_lr=0.0, max_lr=1e-4, min_lr=1e-5, lr_warmup_steps=10,
                                        lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=100, wd_incr_style="constant")
    from megatron.core import rerun_state_machine

    if rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None:
        initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}
    optimizer = adam.state_dict()
    if sharded:
        optim_state_to_sharding_state(optimizer, get_param_id_to_sharded_param_map(model.sharded_state_dict(), params),
                                      exclude_keys="step")
        rng = ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=0)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 100, "optimizer": optimizer,
            "opt_param_scheduler": scheduler.state_dict(), "rng_state": rng if sharded else [rng],
            "rerun_state_machine": get_rerun_state_machine().state_dict(None, "torch_dist" if sharded else "torch"),
            "num_floating_point_operations_so_far": 1.5e15}


@pytest.mark.slow
def test_training_checkpoints_with_optimizer_and_rng_state_convert_bit_exactly(checkpoints, tmp_path, monkeypatch):
    """A torch_dist checkpoint saved by megatron-core's dist_checkpointing.save and legacy rank files
    (torch.save), each with Megatron-LM's full args, Adam state, LR scheduler, rerun state and RNG
    state (NumPy's too), convert to the original HF weights bit for bit; the unpickler refuses none
    of it."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.megatron_dist_oracle import core_config, megatron_process_group, sharded_parameters
    from mconv.converter.torch_dist_io import TorchDistReader
    from tests.test_roundtrip import assert_bit_identical, read_all

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    reader = TorchDistReader(checkpoints / "torch_dist" / "release")
    stored = reader.args
    args = training_args(stored)
    theirs = tmp_path / "dist" / "iter_0000100"
    theirs.mkdir(parents=True)
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("100")
    with megatron_process_group():
        config = core_config(stored, torch.bfloat16)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=stored.padded_vocab_size,
                         max_sequence_length=stored.max_position_embeddings, position_embedding_type="rope",
                         share_embeddings_and_output_weights=not stored.untie_embeddings_and_output_weights,
                         rotary_base=stored.rotary_base)
        stored_dtypes = {name: reader.tensors[entries[0].key].dtype for name, entries in sharded_parameters(model).items()}
        for name, param in model.named_parameters():  # as stored (bf16 weights, fp32 norms), as a trainer's
            param.data = param.data.to(stored_dtypes[name])
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                         str(checkpoints / "torch_dist" / "release"))
        model.load_state_dict(loaded["model"], strict=True)
        state = training_state(model, args, sharded=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), **state}, str(theirs))
    assert not (theirs / "common.pt").exists()  # 0.19 keeps the common state inside the .distcp files
    common = TorchDistReader(theirs).common  # through the restricted unpickler, without megatron-core's classes
    assert {"optimizer", "opt_param_scheduler", "rerun_state_machine"} <= common.keys()
    assert type(common["args"].attention_backend).__name__ == "AttnBackend"
    mcore2hf(tmp_path / "dist", tmp_path / "hf-dist", hf_config=TINY, progress=False)
    assert_bit_identical(read_all(TINY), read_all(tmp_path / "hf-dist"))

    legacy = Path(shutil.copytree(checkpoints / "torch", tmp_path / "legacy"))
    for path in legacy.glob("release/mp_rank_*/model_optim_rng.pt"):
        rank = load_rank_file(path)
        with megatron_process_group():
            extra = training_state(torch.nn.Linear(2, 2), training_args(rank["args"]), sharded=False)
        torch.save({**rank, **extra, "iteration": 0}, path)
    from mconv.converter import megatron_io

    rank = megatron_io.load_rank_file(next(legacy.glob("release/mp_rank_*/model_optim_rng.pt")))
    assert rank["rng_state"][0]["np_rng_state"][1].dtype.name == "uint32" and "exp_avg" in str(rank["optimizer"])
    mcore2hf(legacy, tmp_path / "hf-legacy", progress=False)
    assert_bit_identical(read_all(TINY), read_all(tmp_path / "hf-legacy"))


def test_a_bucket_request_maps_only_bucket_files(tmp_path):
    """An engine maps the file an update request names (vLLM's mconv_shm backend, ParameterReceiver):
    only a bucket file `SharedBuffer.create` made, not any file the request's sender names."""
    from mconv.transport.shm import SHM_DIR, SharedBuffer

    made = SharedBuffer.create(64)
    try:
        SharedBuffer.attach(made.path).close()
        (tmp_path / "mconv-bucket-x").write_bytes(b"0" * 64)
        elsewhere = os.path.join(SHM_DIR or str(tmp_path), "not-a-bucket")
        for path in ("/etc/passwd", str(tmp_path / "mconv-bucket-x"), made.path + "/../" + os.path.basename(elsewhere)):
            with pytest.raises(ValueError, match="is not an mconv bucket file"):
                SharedBuffer.attach(path)
    finally:
        made.close()
