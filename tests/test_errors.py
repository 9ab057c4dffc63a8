"""Bad input: one line naming the culprit, exit status 1, no output (and no partial output)."""
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mconv import Layout
from mconv.cli import main
from tests.conftest import FIXTURES

TINY = FIXTURES / "qwen3-tiny"


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def legacy(*args):
    """hf2mcore in the legacy per-rank format (these tests edit rank files)."""
    return mconv("hf2mcore", *args, "--format", "torch", "-q")


def assert_refused(result, out: Path, *fragments):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mconv: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()
    assert not out.parent.exists() or not [p for p in out.parent.iterdir() if ".mconv-partial-" in p.name]


def copy_model(tmp_path, source=TINY) -> Path:
    return Path(shutil.copytree(source, tmp_path / "hf"))


def edit_weights(hf: Path, edit):
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_missing_safetensors_file(tmp_path):
    hf = copy_model(tmp_path)
    (hf / "model.safetensors").unlink()
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model.safetensors")


def test_shard_listed_in_index_is_missing(tmp_path):
    hf = copy_model(tmp_path)
    names = load_file(hf / "model.safetensors").keys()
    (hf / "model.safetensors").unlink()  # transformers reads model.safetensors before an index
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model-00001-of-00002.safetensors")


def test_truncated_safetensors(tmp_path):
    hf = copy_model(tmp_path)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) - 1000])
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "is truncated: its header describes")


def test_garbage_safetensors(tmp_path):
    hf = copy_model(tmp_path)
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "model.safetensors is not a valid safetensors file (", "header too large")


def test_tensor_missing(tmp_path):
    hf = copy_model(tmp_path)
    edit_weights(hf, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.2.mlp.up_proj.weight", "missing")


def test_unexpected_tensor(tmp_path):
    hf = copy_model(tmp_path)
    edit_weights(hf, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(4)}))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.0.self_attn.rotary.inv_freq", "unexpected")


def test_shape_disagrees_with_config(tmp_path):
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 128
    (hf / "config.json").write_text(json.dumps(config))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out",
                   "model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]")


def test_unsupported_architecture(tmp_path):
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf / "config.json").write_text(json.dumps(config))
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", "GPT2LMHeadModel")


@pytest.mark.parametrize("options,fragment", [
    (["--tp", "8"], "num_attention_heads=4 is not divisible by --tp 8"),
    (["--tp", "4"], "num_key_value_heads (query groups)=2 is not divisible by --tp 4"),
    (["--pp", "3"], "4 layers cannot be split evenly over 3 pipeline stages"),
    (["--pp", "2", "--vpp", "4"], "not divisible by --vpp 4"),
    (["--pp", "2", "--first-stage-layers", "4"], "leave 0 of 4 layers"),
    (["--tp", str(10**20)], "tp is 100000000000000000000, not a size"),
])
def test_layout_does_not_fit(tmp_path, options, fragment):
    assert_refused(mconv("hf2mcore", TINY, tmp_path / "out", *options), tmp_path / "out", fragment)


def test_output_exists(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    result = mconv("hf2mcore", TINY, out)
    assert result.exit_code == 1 and "already exists; pass --overwrite" in result.stderr
    assert (out / "keep").read_text() == "x"


def test_overwrite_replaces_output(tmp_path):
    out = tmp_path / "out"
    assert mconv("hf2mcore", TINY, out, "-q").exit_code == 0
    (out / "stale").write_text("x")
    assert mconv("hf2mcore", TINY, out, "--overwrite", "-q").exit_code == 0
    assert not (out / "stale").exists() and (out / "release").is_dir()


def test_overwrite_replaces_only_what_mconv_could_have_written(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("x")
    assert_refused(mconv("hf2mcore", TINY, precious, "--overwrite", "-q"), precious / "release",
                   "holds neither a model")
    assert (precious / "thesis.txt").read_text() == "x"


def test_checkpoint_args_disagree_with_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", FIXTURES / "qwen3-tiny-tied"),
                   tmp_path / "out", "num_layers=4", "implies 2")


def test_checkpoint_without_stored_config_needs_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    shutil.rmtree(tmp_path / "m" / "hf_config")
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "--hf-config")
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", TINY, "-q").exit_code == 0


def test_missing_rank_file(tmp_path):
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    (tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "mp_rank_01", "missing")


def test_megatron_tensor_missing(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out",
                   "decoder.layers.1.mlp.linear_fc2.weight")


def test_shards_with_different_dtypes_are_refused(tmp_path):
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    state["model"][name] = state["model"][name].to(torch.float16)
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "-q"), tmp_path / "out", name,
                   "different dtypes (bfloat16, float16")


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/mconv-exploit-ran"),))


def test_legacy_reader_refuses_arbitrary_pickles(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["payload"] = Exploit()
    torch.save(state, path)
    Path("/tmp/mconv-exploit-ran").unlink(missing_ok=True)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "refused to unpickle")
    assert not Path("/tmp/mconv-exploit-ran").exists()


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(mconv("mcore2hf", tmp_path / "empty", tmp_path / "out"), tmp_path / "out", "not a Megatron checkpoint")


def test_inputs_are_not_modified(tmp_path):
    hf = copy_model(tmp_path)
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert mconv("hf2mcore", hf, tmp_path / "m", "--tp", "2", "-q").exit_code == 0
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before


# ----------------------------------------------------------------------------- usage errors (issue 10.12)

@pytest.mark.parametrize("args,fragment", [
    (["hf2mcore", TINY / "config.json", "out"], "Invalid value for 'HF_DIR|HUB_NAME': Directory"),
    (["mcore2hf", "ckpt", "out", "--max-shard-size", "3XB"], "'--max-shard-size': '3XB' is not a size"),
    (["mcore2hf", "ckpt", "out", "--max-shard-size", "0"], "'--max-shard-size': '0' is not a positive size"),
    (["hf2mcore", TINY, "out", "--tpp", "2"], "No such option '--tpp'"),
    (["hf2mcore", TINY, "out", "--tp", "two"], "'--tp': 'two' is not a valid integer"),
    (["hf2mcore", TINY], "Missing argument 'OUT_DIR'"),
    (["convert", TINY], "No such command 'convert'"),
    (["hf2mcore", TINY, "out", "--iteration", "-5"], "'--iteration': -5 is not in the range"),
    (["mcore2hf", "ckpt", "out", "--workers", "0"], "'--workers': 0 is not in the range x>=1"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, fragment):
    result = mconv(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("mconv: error: ") and fragment in result.stderr, result.stderr


def test_help_is_not_an_error():
    assert mconv("hf2mcore", "--help").exit_code == 0
    assert "Usage:" in mconv().output  # plain `mconv` still shows the help


# ----------------------------------------------------------------------------- output naming (issue 10.6)

def hf_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("model"))


def test_output_files_are_named_as_transformers_names_them(tmp_path):
    """Oracle: transformers' save_pretrained of the same model, unsharded and sharded."""
    from fixtures.make_fixtures import make_qwen3

    theirs_one = make_qwen3(tmp_path / "one", tokenizer=False)
    theirs_many = make_qwen3(tmp_path / "many", tokenizer=False, max_shard_size="100KB")
    assert mconv("hf2mcore", theirs_one, tmp_path / "m", "--format", "torch", "-q").exit_code == 0
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "ours-one", "-q", "--workers", 2).exit_code == 0
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "ours-many", "-q", "--max-shard-size", "100KB").exit_code == 0
    assert hf_files(tmp_path / "ours-one") == hf_files(theirs_one) == ["model.safetensors"]
    assert hf_files(tmp_path / "ours-many") == hf_files(theirs_many)  # model-0000i-of-0000n + index
    ours, index = (json.loads((d / "model.safetensors.index.json").read_text())
                   for d in (tmp_path / "ours-many", theirs_many))
    assert ours["metadata"] == index["metadata"] and ours["weight_map"].keys() == index["weight_map"].keys()
    assert mconv("verify", theirs_one, tmp_path / "ours-many", "-q").exit_code == 0


def test_merged_lora_output_is_named_as_transformers_names_it(tmp_path):
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path, TINY, Layout(tp=2))
    for shard, files in (("3GB", ["model.safetensors"]),
                         ("100KB", ["model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
                                    "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
                                    "model-00005-of-00005.safetensors", "model.safetensors.index.json"])):
        out = tmp_path / f"merged-{shard}"
        result = mconv("export-lora", lora, out, "--merge", "--base-model", TINY, "--alpha", 8, "--max-shard-size",
                       shard, "-q")
        assert result.exit_code == 0, result.output
        assert hf_files(out) == files


# ----------------------------------------------------------------------------- permissions (issue 10.7)

def modes_made_by_the_shell(where: Path, mask: int, side_files: Path) -> dict[str, int]:
    """Oracle: the modes `mkdir`, a shell redirection and `cp` give under this umask."""
    import subprocess

    where.mkdir()
    subprocess.run(["sh", "-c", f"umask {mask:03o} && mkdir dir && : > file && cp {side_files}/*.json ."],
                   cwd=where, check=True)
    return {p.name: p.stat().st_mode & 0o7777 for p in where.iterdir()}


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027])
def test_outputs_get_the_permissions_of_the_callers_umask(tmp_path, mask):
    import os

    hf = copy_model(tmp_path)
    (hf / "tokenizer.json").chmod(0o640)  # cp keeps a side file's own bits, less the umask
    shell = modes_made_by_the_shell(tmp_path / "shell", mask, hf)
    previous = os.umask(mask)
    try:
        for args in (["hf2mcore", hf, tmp_path / "dist"], ["hf2mcore", hf, tmp_path / "torch", "--format", "torch"],
                     ["mcore2hf", tmp_path / "torch", tmp_path / "back"]):
            assert mconv(*args, "-q").exit_code == 0
    finally:
        os.umask(previous)
    for out in ("dist", "torch", "back"):
        for path in [tmp_path / out, *(tmp_path / out).rglob("*")]:
            expected = shell["dir"] if path.is_dir() else shell.get(path.name, shell["file"])
            assert path.stat().st_mode & 0o7777 == expected, (path, oct(path.stat().st_mode), oct(expected))


# ----------------------------------------------------------------------------- safetensors headers (issue 11)

def rewrite_safetensors(path: Path, edit) -> None:
    """Rewrite a safetensors file with edit(header dict, data bytes) -> (header, data or raw header bytes)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + length]), raw[8 + length:])
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _tensors(header) -> list[dict]:
    return sorted((e for n, e in header.items() if n != "__metadata__"), key=lambda e: e["data_offsets"][0])


def _first_two(header):
    return _tensors(header)[:2]


def _share_bytes(header, data):
    """The second tensor reuses the first one's bytes; everything else is consistent."""
    first, second = _first_two(header)
    second.update(dtype=first["dtype"], shape=first["shape"])
    start, stop = second["data_offsets"]
    for entry in _tensors(header):
        if entry["data_offsets"][0] >= stop:
            entry["data_offsets"] = [o - (stop - start) for o in entry["data_offsets"]]
    second["data_offsets"] = list(first["data_offsets"])
    return header, data[:start] + data[stop:]


def _gap(header, data):
    for entry in _tensors(header):
        entry["data_offsets"] = [o + 8 for o in entry["data_offsets"]]
    return header, bytes(8) + data


def _past_the_end(header, data):
    first, _ = _first_two(header)
    first["data_offsets"] = [len(data) + 64, len(data) + 64 + first["data_offsets"][1] - first["data_offsets"][0]]
    return header, data


def _wrong_size(header, data):
    first, _ = _first_two(header)
    first["shape"] = [first["shape"][0] + 1] + first["shape"][1:]
    return header, data


def _unknown_dtype(header, data):
    _first_two(header)[0]["dtype"] = "F24"
    return header, data


def _duplicate_name(header, data):
    first, second = _first_two(header)
    text = json.dumps(header)
    name = next(n for n, e in header.items() if e is second)
    other = next(n for n, e in header.items() if e is first)
    return text.replace(json.dumps(name) + ":", json.dumps(other) + ":", 1).encode(), data


@pytest.mark.parametrize("edit", [_share_bytes, _gap, _past_the_end, _wrong_size, _unknown_dtype, _duplicate_name],
                         ids=lambda f: f.__name__.strip("_"))
def test_safetensors_headers_are_refused_as_the_library_refuses_them(tmp_path, edit):
    """Oracle: the safetensors library itself refuses each of these files."""
    from safetensors import SafetensorError, safe_open

    hf = copy_model(tmp_path)
    rewrite_safetensors(hf / "model.safetensors", edit)
    with pytest.raises(SafetensorError):
        with safe_open(hf / "model.safetensors", "pt"):
            pass
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", str(hf / "model.safetensors"))


# ----------------------------------------------------------------------------- symlinks (issue 10.10)

@pytest.mark.parametrize("dry_run", [False, True])
def test_output_inside_an_input_reached_through_a_symlink_is_refused(tmp_path, dry_run):
    hf = copy_model(tmp_path)
    (tmp_path / "link").symlink_to(hf)  # the input named through a link, the output inside the real one
    (tmp_path / "outlink").symlink_to(hf)  # the output's parent is a link into the input
    extra = ["--dry-run"] if dry_run else []
    before = sorted(p.name for p in hf.iterdir())
    assert_refused(mconv("hf2mcore", tmp_path / "link", hf / "out", *extra), hf / "out", "overlaps the input")
    assert_refused(mconv("hf2mcore", hf, tmp_path / "outlink" / "out", *extra), hf / "out", "overlaps the input")
    assert sorted(p.name for p in hf.iterdir()) == before
    assert legacy(hf, tmp_path / "m").exit_code == 0
    (tmp_path / "mlink").symlink_to(tmp_path / "m")
    assert_refused(mconv("mcore2hf", tmp_path / "mlink", tmp_path / "m" / "hf"), tmp_path / "m" / "hf",
                   "overlaps the input")


def test_dry_run_checks_the_output_like_a_run(tmp_path):
    (tmp_path / "out").mkdir()
    result = mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run")
    assert result.exit_code == 1 and "already exists; pass --overwrite" in result.stderr
    assert mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run", "--overwrite").exit_code == 0


# ----------------------------------------------------------------------------- full disks, read-only outputs (10.8)

def assert_write_refused(result, out: Path, cause: str):
    assert_refused(result, out, f"cannot write {out}", cause)


def test_full_disk_while_writing_safetensors(tmp_path, monkeypatch):
    """The failure injected at the write system call (os.pwrite), as a full disk raises it."""
    import errno
    import os

    assert legacy(TINY, tmp_path / "m").exit_code == 0

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    assert_write_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--workers", 1), tmp_path / "out",
                         "No space left on device")


def test_full_disk_while_torch_saves_a_rank_file(tmp_path, monkeypatch):
    """torch's zip writer reports a short write as "unexpected pos" (seen on a full tmpfs: the message
    below is the one it gave); injected here at torch.save."""
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 307072 vs 306960")

    monkeypatch.setattr(torch, "save", full)
    assert_write_refused(legacy(TINY, tmp_path / "out"), tmp_path / "out", "no space left on device?")


def test_read_only_output_location(tmp_path, monkeypatch):
    """EROFS injected at mkdir (a root test process cannot be refused by permission bits)."""
    import errno
    import os

    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if Path(path).is_relative_to(tmp_path / "ro"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "mkdir", read_only)
    assert_write_refused(mconv("hf2mcore", TINY, tmp_path / "ro" / "out"), tmp_path / "ro" / "out",
                         "Read-only file system")
    assert_write_refused(mconv("hf2mcore", TINY, tmp_path / "ro" / "a" / "out"), tmp_path / "ro" / "a" / "out",
                         f"{tmp_path / 'ro' / 'a'}: Read-only file system")
    assert list((tmp_path / "ro").iterdir()) == []


SMALL_FS = """
set -e
mount -t tmpfs -o size=300k tmpfs {full}
mount -t tmpfs -o size=64k,ro tmpfs {ro}
exec {python} -c '
import json, os, subprocess, sys
results = {{}}
for name, args in json.loads(sys.argv[1]).items():
    # A real process each: its exit status and all of its stderr, through interpreter shutdown
    # (a buffer left exported by a failed write once crashed it there, after the error line).
    result = subprocess.run([sys.executable, "-m", "mconv.cli", *args], capture_output=True, text=True)
    results[name] = [result.returncode, result.stderr, os.listdir("{full}") + os.listdir("{ro}")]
json.dump(results, open(sys.argv[2], "w"))
' '{cases}' {report}
"""


def small_filesystems(tmp_path: Path, cases: dict) -> dict | None:
    """Run CLI cases in a private mount namespace with a 300 KB tmpfs at tmp_path/full and a
    read-only one at tmp_path/ro; None where namespaces or mounts are not allowed."""
    import shutil as sh
    import subprocess
    import sys

    (tmp_path / "full").mkdir()
    (tmp_path / "ro").mkdir()
    if not sh.which("unshare") or subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", str(tmp_path / "ro")],
                                                 capture_output=True).returncode:
        return None
    script = SMALL_FS.format(full=tmp_path / "full", ro=tmp_path / "ro", python=sys.executable,
                             cases=json.dumps({k: [str(a) for a in v] for k, v in cases.items()}),
                             report=tmp_path / "report.json")
    subprocess.run(["unshare", "-m", "sh", "-c", script], check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.slow
def test_full_and_read_only_file_systems(tmp_path):
    """Real ENOSPC and EROFS: a 300 KB tmpfs (every output of the tiny model is larger, so the
    disk fills mid-write) and a read-only tmpfs, mounted in a private mount namespace; each case
    a real `mconv` process that exits 1 with the one error line."""
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    assert mconv("hf2mcore", TINY, tmp_path / "d", "-q").exit_code == 0
    full, ro = tmp_path / "full" / "out", tmp_path / "ro" / "sub" / "out"
    cases = {"hf2mcore torch_dist": ["hf2mcore", TINY, full],
             "hf2mcore torch": ["hf2mcore", TINY, full, "--format", "torch"],
             "hf2mcore torch, 2 workers": ["hf2mcore", TINY, full, "--format", "torch", "--tp", 2, "--workers", 2],
             "mcore2hf": ["mcore2hf", tmp_path / "m", full, "--workers", 1],
             "mcore2hf, 2 workers": ["mcore2hf", tmp_path / "m", full, "--workers", 2, "--max-shard-size", "100KB"],
             "mcore2hf torch_dist": ["mcore2hf", tmp_path / "d", full, "--workers", 1],
             "read-only": ["mcore2hf", tmp_path / "m", ro]}
    results = small_filesystems(tmp_path, {k: v + ["-q"] for k, v in cases.items()})
    if results is None:
        pytest.skip("no mount namespaces here (needs root); the injected-failure tests above still run")
    for name, (status, stderr, left) in results.items():
        out, cause = (ro, f"{ro.parent}: Read-only file system") if name == "read-only" else (full, "o space left")
        assert status == 1 and stderr.count("\n") == 1 and "SystemError" not in stderr, (name, stderr)
        assert stderr.startswith(f"mconv: error: cannot write {out}: ") and cause in stderr, (name, stderr)
        assert left == [], (name, left)  # nothing left behind on either file system
