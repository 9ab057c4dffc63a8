"""Corrupt inputs, every kind mconv reads (hypothesis, a bounded number of examples).

Each example copies a pristine checkpoint, damages one file (truncation, bit flips, a value of
the wrong type, a huge size, bytes that are not UTF-8, a missing file, a symlink out of the tree)
and runs the command that reads it, in-process. Whatever the damage: the exit status is 0 (the
damage was harmless, e.g. a flipped bit inside tensor data) or 1 with one line `mconv: error: ...`
naming the file; never a traceback or a hang; no output directory after a refusal; the input is
unchanged; nothing is written anywhere else (the temporary directory included). Damage that
leaves no valid reading (a truncated binary file, a missing required file, non-UTF-8 JSON, a link
to a device or a FIFO) must be refused.

MCONV_CORRUPT_EXAMPLES (default 8) sets the examples per input kind; the run is derandomized so
CI sees the same cases every time.
"""
import io
import json
import os
import pickle
import shutil
import signal
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mconv import Layout, hf2mcore
from mconv.cli import main
from tests.conftest import FIXTURES, load_rank_file

EXAMPLES = int(os.environ.get("MCONV_CORRUPT_EXAMPLES", "8"))
TEXT, JSON, SAFETENSORS, TORCH, PICKLE, BINARY, YAML = "text", "json", "safetensors", "torch", "pickle", "binary", "yaml"


@dataclass(frozen=True)
class Kind:
    tree: str  # which pristine checkpoint
    file: str  # the damaged file, relative to the tree
    format: str
    commands: tuple[str, ...]  # conversion first: it must refuse what cannot be read
    required: bool = True  # a missing one must be refused


CONVERT = {"hf": "hf2mcore", "hf-sharded": "hf2mcore", "legacy": "mcore2hf", "dist": "mcore2hf", "lora": "export-lora"}
KINDS = {
    "safetensors single file": Kind("hf", "model.safetensors", SAFETENSORS, ("hf2mcore", "inspect")),
    "safetensors shard": Kind("hf-sharded", "model-00001-of-00003.safetensors", SAFETENSORS, ("hf2mcore",)),
    "safetensors index": Kind("hf-sharded", "model.safetensors.index.json", JSON, ("hf2mcore", "inspect")),
    "config.json": Kind("hf", "config.json", JSON, ("hf2mcore", "inspect")),
    "legacy rank file": Kind("legacy", "release/mp_rank_01/model_optim_rng.pt", TORCH, ("mcore2hf", "inspect")),
    "latest_checkpointed_iteration.txt": Kind("legacy", "latest_checkpointed_iteration.txt", TEXT,
                                              ("mcore2hf", "inspect")),
    "mconv.json": Kind("legacy", "mconv.json", JSON, ("mcore2hf", "inspect"), required=False),
    "stored HF config": Kind("legacy", "hf_config/config.json", JSON, ("mcore2hf",)),
    "DCP .metadata": Kind("dist", "release/.metadata", PICKLE, ("mcore2hf", "inspect")),
    ".distcp": Kind("dist", "release/__0_0.distcp", BINARY, ("mcore2hf",)),
    "common.pt": Kind("dist", "release/common.pt", TORCH, ("mcore2hf", "inspect"), required=False),  # also in .distcp
    "metadata.json": Kind("dist", "release/metadata.json", JSON, ("mcore2hf", "inspect")),
    "adapter rank file": Kind("lora", "release/mp_rank_00/model_optim_rng.pt", TORCH, ("export-lora",)),
    "run_config.yaml": Kind("lora", "run_config.yaml", YAML, ("export-lora",)),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The undamaged checkpoints, one of each tree."""
    from fixtures.make_fixtures import make_qwen3
    from tests.test_lora import lora_checkpoint

    root = tmp_path_factory.mktemp("pristine")
    hf = Path(shutil.copytree(FIXTURES / "qwen3-tiny", root / "hf"))
    make_qwen3(root / "hf-sharded", tokenizer=False, max_shard_size="150KB")  # transformers writes index and shards
    hf2mcore(hf, root / "legacy", Layout(tp=2), fmt="torch", progress=False)
    hf2mcore(hf, root / "dist", Layout(), progress=False)
    lora, _ = lora_checkpoint(root / "lora-work", hf, Layout(tp=2), adapter_only=True)
    shutil.move(lora, root / "lora")
    shutil.rmtree(root / "lora-work")
    (root / "lora" / "run_config.yaml").write_text("peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 4\n"
                                                   "  alpha: 8\n")
    for kind in KINDS.values():
        assert (root / kind.tree / kind.file).is_file(), kind
    return root


# ----------------------------------------------------------------------------- damage

WRONG_VALUES = st.sampled_from([None, "x", "", -1, 0, 2**63, 10**30, 1.5, float("inf"), True, [], {}, [1, "a"],
                                {"a": 1}])


def _paths(value, prefix=()):
    """Every place in a JSON-like value (dict keys / list indices / attributes), depth first."""
    yield prefix
    items = (vars(value).items() if hasattr(value, "__dict__") and not isinstance(value, type) else
             value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ())
    for key, child in list(items)[:200]:
        if not isinstance(child, torch.Tensor):
            yield from _paths(child, prefix + (key,))


def _replace(value, path, new):
    if not path:
        return new
    *parents, last = path
    target = value
    for key in parents:
        target = getattr(target, key) if hasattr(target, "__dict__") and not isinstance(target, dict) else target[key]
    if hasattr(target, "__dict__") and not isinstance(target, dict):
        setattr(target, last, new)
    else:
        target[last] = new
    return value


@st.composite
def wrong_type(draw, value):
    """`value` with one place (possibly the whole) replaced by a value of another type."""
    path = draw(st.sampled_from(list(_paths(value))))
    return _replace(value, path, draw(WRONG_VALUES))


def _torch_load(path: Path):
    return load_rank_file(path, map_location="cpu")  # our own pristine file


def structured(fmt: str, data: bytes, path: Path):
    """A strategy for damaged contents that still parse at the outer level: wrong types, huge sizes."""
    if fmt == JSON:
        return wrong_type(json.loads(data)).map(lambda v: json.dumps(v).encode())
    if fmt == YAML:
        return wrong_type(yaml.safe_load(data)).map(lambda v: yaml.safe_dump(v).encode())
    if fmt == TEXT:
        return st.one_of(st.text(max_size=30), st.sampled_from(["-1", "99999999999999999999999", "iter_1", "1e3",
                                                                 "release\x00", "7"])).map(str.encode)
    if fmt == SAFETENSORS:
        (length,) = struct.unpack("<Q", data[:8])
        header, rest = json.loads(data[8:8 + length]), data[8 + length:]

        def pack(h):
            raw = json.dumps(h).encode()
            raw += b" " * (-len(raw) % 8)
            return struct.pack("<Q", len(raw)) + raw + rest

        huge = st.sampled_from([2**63 - 1, 2**40, 2**64 - 8]).map(lambda n: struct.pack("<Q", n) + data[8:])
        return st.one_of(wrong_type(header).map(pack), huge)
    if fmt == TORCH:
        state = _torch_load(path)

        def save(value):
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer.getvalue()

        return wrong_type(state).map(save)
    if fmt == PICKLE:
        metadata = pickle.loads(data)
        return wrong_type(metadata).map(pickle.dumps)
    return st.nothing()


@st.composite
def damage(draw, kind: Kind, data: bytes, path: Path):
    """(description, must_refuse, apply(path, outside)) for one damage to `path`."""
    how = draw(st.sampled_from(["truncate", "flip", "missing", "not utf-8", "symlink", "structured"]))
    text = kind.format in (JSON, TEXT, YAML)
    if how == "truncate":
        at = draw(st.integers(0, max(0, len(data) - 1)))
        refuse = not text or data[at:].strip() != b""
        return f"truncated at {at}", refuse, lambda p, o: p.write_bytes(data[:at])
    if how == "flip":
        limit = min(len(data), 4096) if draw(st.booleans()) else len(data)  # headers are near the start
        bit = draw(st.integers(0, limit * 8 - 1))
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        return f"bit {bit} flipped", False, lambda p, o: p.write_bytes(bytes(flipped))
    if how == "missing":
        return "missing", kind.required, lambda p, o: p.unlink()
    if how == "not utf-8":
        at = draw(st.integers(0, len(data)))
        return f"\\xff\\xfe at {at}", text, lambda p, o: p.write_bytes(data[:at] + b"\xff\xfe" + data[at:])
    if how == "symlink":
        target = draw(st.sampled_from(["/dev/zero", "/etc/hostname", "/", "dangling", "fifo", "loop", "valid copy"]))

        def link(p: Path, outside: Path):
            where = {"/dev/zero": Path("/dev/zero"), "/etc/hostname": Path("/etc/hostname"), "/": Path("/"),
                     "dangling": outside / "nothing-here", "loop": p, "fifo": outside / "fifo",
                     "valid copy": outside / "copy"}[target]
            if target == "fifo":
                os.mkfifo(where)
            if target == "valid copy":
                where.write_bytes(data)
            p.unlink()
            p.symlink_to(where)

        refuse = target in ("/dev/zero", "/", "dangling", "fifo", "loop") and kind.required
        return f"symlink to {target}", refuse, link
    contents = draw(structured(kind.format, data, path))
    return "wrong type or huge value", False, lambda p, o: p.write_bytes(contents)


# ----------------------------------------------------------------------------- the property

def snapshot(root: Path) -> dict[str, object]:
    """Every entry under root: file bytes, link targets, directories."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                found[rel] = "dir"
            elif p.is_file():
                found[rel] = p.read_bytes()
            else:
                found[rel] = "special"
    return found


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("no answer in 120 s")


@pytest.mark.parametrize("name", list(KINDS))
def test_corrupt_input_is_refused_in_one_line(pristine, name, tmp_path_factory):
    kind = KINDS[name]
    data = (pristine / kind.tree / kind.file).read_bytes()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(case=damage(kind, data, pristine / kind.tree / kind.file), command=st.sampled_from(kind.commands))
    def check(case, command):
        description, must_refuse, apply = case
        work = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
        try:
            tree, outside, temp = work / kind.tree, work / "outside", work / "tmp"
            shutil.copytree(pristine / kind.tree, tree, symlinks=True)
            outside.mkdir()
            temp.mkdir()
            apply(tree / kind.file, outside)
            before, others = snapshot(tree), snapshot(outside)
            out = work / "out"
            args = [command, tree] if command == "inspect" else [command, tree, out, "-q"]
            if command == "mcore2hf":
                args += ["--workers", "1"]
            previous = signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(120)
            tempdir, tempfile.tempdir = tempfile.tempdir, str(temp)
            try:
                result = CliRunner().invoke(main, [str(a) for a in args])
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
                tempfile.tempdir = tempdir
            where = f"{name}, {description}, {command}"
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                raise AssertionError(f"{where}: crashed") from result.exception
            assert result.exit_code in (0, 1), (where, result.exit_code, result.output)
            if result.exit_code == 1:
                lines = result.stderr.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("mconv: error: "), (where, result.stderr)
                rank_dir = Path(kind.file).parent.name  # "...: X is missing from mp_rank_00" names a rank file
                named = (str(tree / kind.file), Path(kind.file).name, str((tree / kind.file).parent),
                         *([rank_dir] if rank_dir.startswith("mp_rank_") else []))
                assert any(n in lines[0] for n in named), (where, lines[0])
                assert not out.exists(), where
            else:
                assert not (must_refuse and command != "inspect"), (where, "accepted", result.output)
                assert command == "inspect" or out.is_dir(), where
            assert snapshot(tree) == before, (where, "the input changed")
            assert snapshot(outside) == others and not os.listdir(temp), (where, "wrote elsewhere")
            assert sorted(os.listdir(work)) == sorted(["outside", "tmp", kind.tree] + (["out"] if out.exists() else [])), \
                (where, os.listdir(work))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    check()
