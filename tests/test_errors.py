"""Bad input: one line naming the culprit, exit status 1, no output (and no partial output)."""
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mconv import Layout
from mconv.cli import main
from mconv.errors import MconvError
from tests.conftest import FIXTURES, load_rank_file
from tests.ranks import start_ranks

TINY = FIXTURES / "qwen3-tiny"


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def legacy(*args):
    """hf2mcore in the legacy per-rank format (these tests edit rank files)."""
    return mconv("hf2mcore", *args, "--format", "torch", "-q")


def assert_refused(result, out: Path, *fragments, status: int = 1):
    assert result.exit_code == status, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mconv: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()
    assert not out.parent.exists() or not [p for p in out.parent.iterdir() if ".mconv-partial-" in p.name]


def documented(start: str, out: Path) -> str:
    """The message docs/trust-and-errors.md quotes (a `...` span beginning with `start`), with OUT
    replaced by `out` and a line end: the tests hold what mconv says to what the docs say it says."""
    import re

    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "trust-and-errors.md").read_text().split())
    [quoted] = [q for q in re.findall(r"`([^`]+)`", text) if q.startswith(start)]
    return quoted.replace("OUT", str(out)) + "\n"


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
    """Named with the config.json file that names it (hf2mcore and inspect)."""
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf / "config.json").write_text(json.dumps(config))
    fragment = f"{hf / 'config.json'} names unsupported architecture 'GPT2LMHeadModel'"
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", fragment)
    assert_refused(mconv("inspect", hf), tmp_path / "out", fragment)


@pytest.mark.parametrize("options,fragment", [
    (["--tp", "8"], "num_attention_heads=4 is not divisible by --tp 8"),
    (["--tp", "4"], "num_key_value_heads (query groups)=2 is not divisible by --tp 4"),
    (["--pp", "3"], "4 layers cannot be split evenly over 3 pipeline stages"),
    (["--pp", "2", "--vpp", "4"], "not divisible by --vpp 4"),
    (["--pp", "2", "--first-stage-layers", "4"], "all 4 layers of the model on the first/last pipeline stages"),
    (["--tp", str(10**20)], "--tp is 100000000000000000000: give a whole number up to 65,536"),
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
    assert mconv("hf2mcore", TINY, out, "--iteration", 100, "-q").exit_code == 0  # an older output's iteration
    assert mconv("hf2mcore", TINY, out, "--overwrite", "-q").exit_code == 0
    assert not (out / "iter_0000100").exists() and (out / "release").is_dir()


@pytest.mark.parametrize("foreign", [".git", "src", "notes.txt", "train.py", "results.json", "release/notes.txt",
                                     "hf_config/thesis.tex", "iter_0000200/"])
def test_overwrite_refuses_a_directory_holding_what_no_mconv_output_holds(tmp_path, foreign):
    """A project directory that happens to hold a config.json and a tracker (marks of an mconv
    output) is not replaced when it also holds a hidden entry, a directory, a file no output has
    (at its top level or in a checkpoint's directories: remote code only where config.json names
    it), or more than one iteration (a training run's): named, nothing touched. (New-user passes: a
    project, then a Megatron-LM run's iterations, were deleted.)"""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"name": "my-app"}')
    (project / "latest_checkpointed_iteration.txt").write_text("100")
    (project / "iter_0000100").mkdir()
    path = project / foreign
    path.parent.mkdir(exist_ok=True)
    path.mkdir(exist_ok=True) if foreign.endswith("/") or "." not in foreign[1:] else path.write_text("x")
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    result = mconv("hf2mcore", TINY, project, "--overwrite", "-q")
    assert result.exit_code == 1 and "which no mconv output holds" in result.stderr, result.output
    assert foreign.rstrip("/").split("/")[-1] in result.stderr or "more than one iteration" in result.stderr
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before
    assert (project / "config.json").read_text() == '{"name": "my-app"}'


@pytest.mark.parametrize("args", [["--iteration", "12345678"], ["--format", "torch", "--tp", "2"]])
def test_overwrite_replaces_every_kind_of_checkpoint_mconv_writes(tmp_path, args):
    """hf2mcore's outputs at any iteration number (more than seven digits too) and format, and
    mcore2hf's sharded one, are replaced by --overwrite (the new-user pass found iter_12345678 refused)."""
    out = tmp_path / "out"
    for _ in range(2):
        assert mconv("hf2mcore", TINY, out, *args, "--overwrite", "-q").exit_code == 0
    for _ in range(2):
        result = mconv("mcore2hf", out, tmp_path / "hf", "--max-shard-size", "100KB", "--overwrite", "-q")
        assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1


def test_overwrite_replaces_only_what_mconv_could_have_written(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("x")
    assert_refused(mconv("hf2mcore", TINY, precious, "--overwrite", "-q"), precious / "release",
                   "holds neither a model")
    assert (precious / "thesis.txt").read_text() == "x"


def test_an_empty_output_directory_is_taken_without_overwrite(tmp_path):
    """A freshly made empty OUT is not data: no --overwrite needed (a directory with a file still needs it)."""
    out = tmp_path / "out"
    out.mkdir()
    assert mconv("hf2mcore", TINY, out, "-q").exit_code == 0
    assert (out / "latest_checkpointed_iteration.txt").is_file() and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["file", "FIFO", "character device", "dangling symlink"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_that_is_not_a_directory_is_named_at_once(tmp_path, kind, overwrite):
    """A file, a FIFO, a device or a dangling symlink as OUT: the sentence says what it is (not "already
    exists; pass --overwrite", which then only led to "exists and is not a directory"); a file, in
    every command that writes an OUT (click's own check said "Directory 'OUT' is a file", status 2)."""
    import os

    out = tmp_path / "out"
    commands = [["hf2mcore", TINY]]
    if kind == "file":
        out.write_text("notes")
        if not overwrite:
            assert legacy(TINY, tmp_path / "m").exit_code == 0  # OUT is checked before the adapters are looked for
            commands += [["mcore2hf", tmp_path / "m"], ["export-lora", tmp_path / "m", "--alpha", 8]]
    elif kind == "FIFO":
        os.mkfifo(out)
    elif kind == "character device":
        out = Path("/dev/null")
    else:
        out.symlink_to(tmp_path / "gone")
    what = {"file": "a file", "FIFO": "a FIFO", "character device": "a character device",
            "dangling symlink": f"a symlink to {tmp_path / 'gone'}, which does not exist"}[kind]
    said = documented("mconv: error: OUT is a FIFO", out).replace("a FIFO", what)
    for command in commands:
        result = mconv(*command, out, "-q", *(["--overwrite"] if overwrite else []))
        assert result.exit_code == 1 and result.stderr == said, (command, result.stderr)
        assert os.path.lexists(out) and leftovers(tmp_path) == []
    if kind == "file":
        assert out.read_text() == "notes"


WRITERS = {"hf2mcore torch_dist": lambda tmp, out: ["hf2mcore", TINY, out, "--workers", 2],
           "hf2mcore torch": lambda tmp, out: ["hf2mcore", TINY, out, "--format", "torch", "--tp", 2],
           "mcore2hf": lambda tmp, out: ["mcore2hf", legacy_checkpoint(tmp), out, "--workers", 2],
           "export-lora": lambda tmp, out: ["export-lora", lora_checkpoint(tmp), out, "--alpha", 8],
           "export-lora --merge": lambda tmp, out: ["export-lora", lora_checkpoint(tmp), out, "--alpha", 8,
                                                    "--merge", "--base-model", TINY]}


def legacy_checkpoint(tmp_path: Path) -> Path:
    assert legacy(TINY, tmp_path / "m", "--tp", 2).exit_code == 0
    return tmp_path / "m"


def lora_checkpoint(tmp_path: Path) -> Path:
    from tests.test_lora import lora_checkpoint

    return lora_checkpoint(tmp_path / "lora-source", TINY, Layout(tp=2))[0]


@pytest.mark.parametrize("writer", WRITERS)
def test_an_output_that_appears_while_mconv_writes_is_left_alone(tmp_path, monkeypatch, writer):
    """OUT made by someone else once mconv has checked it (right after the staging directory is
    made): mconv refuses to replace it, one line, status 1, its file intact and nothing left of the
    new output (mconv used to check OUT at the start only and replaced it at the end)."""
    from mconv.converter import output

    out = tmp_path / "out"
    args = WRITERS[writer](tmp_path, out)
    real = output.tempfile.mkdtemp

    def mkdtemp(*a, **k):
        made = real(*a, **k)
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return made

    monkeypatch.setattr(output.tempfile, "mkdtemp", mkdtemp)
    result = mconv(*args, "-q")
    assert result.exit_code == 1 and result.stderr == documented("mconv: error: OUT appeared", out), result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_only_the_output_found_at_the_start(tmp_path, monkeypatch):
    """With --overwrite, an output replaced by another directory while mconv ran is left alone."""
    from mconv.converter import output

    out = tmp_path / "out"
    assert mconv("hf2mcore", TINY, out, "-q").exit_code == 0
    real = output.tempfile.mkdtemp

    def mkdtemp(*a, **k):
        shutil.rmtree(out)
        out.mkdir()
        (out / "config.json").write_text("theirs")
        return real(*a, **k)

    monkeypatch.setattr(output.tempfile, "mkdtemp", mkdtemp)
    result = mconv("hf2mcore", TINY, out, "-q", "--overwrite")
    assert result.exit_code == 1 and "changed while mconv was writing it; it was left as it is" in result.stderr
    assert [p.name for p in out.iterdir()] == ["config.json"] and leftovers(tmp_path) == []


def test_a_torchrun_job_to_an_output_another_job_writes_is_refused(tmp_path):
    """Two torchrun jobs to one OUT (their ranks meet in fixed-name staging directories): the second
    one's rank 0 is refused at once and leaves the first one's staging directory alone (it used
    to empty it and write its own files there); the first job's output is the one in place."""
    import datetime

    import torch.distributed as dist

    from mconv.converter.parallel import TorchrunTeam
    from mconv.converter.pipelines import _run_team

    out = tmp_path / "out"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(minutes=5))
    errors = []

    def write(staging: Path, job: str) -> None:
        (staging / "config.json").write_text(job)
        if job == "first":
            try:
                run("second")
            except MconvError as e:
                errors.append(str(e))

    def run(job: str) -> None:
        _run_team(TorchrunTeam(0, 1, store, job), out, False, lambda staging: None, lambda _, staging: None,
                  lambda staging, report: write(staging, job), 0, job, False)

    run("first")
    assert errors == [f"rank 0: another mconv run is writing {out}; wait for it to end or choose another output "
                      "directory"]
    assert (out / "config.json").read_text() == "first" and leftovers(tmp_path) == []


def test_a_killed_runs_staging_is_removed_by_the_next_run(tmp_path):
    """A staging directory of OUT that a SIGKILLed run left is removed by the next run to OUT, which
    holds OUT's lock (so no live run uses it); another output's, and a link, are left alone."""
    stale = tmp_path / ".out.mconv-partial-k1ll3d"
    (stale / "release").mkdir(parents=True)
    (stale / "release" / "half.pt").write_bytes(b"x" * 100)
    other = tmp_path / ".out2.mconv-partial-k1ll3d"
    other.mkdir()
    (tmp_path / ".out.mconv-partial-link").symlink_to(other)
    assert legacy(TINY, tmp_path / "out").exit_code == 0
    assert not stale.exists() and other.is_dir() and (tmp_path / ".out.mconv-partial-link").is_symlink()


def test_checkpoint_args_disagree_with_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", FIXTURES / "qwen3-tiny-tied"),
                   tmp_path / "out", "num_layers=4", "implies 2")


def test_checkpoint_without_stored_config_needs_hf_config(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    shutil.rmtree(tmp_path / "m" / "hf_config")
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "--hf-config")
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", TINY, "-q").exit_code == 0


SIDE_FILE_DAMAGE = {  # a side file made into something else, and what the sentence calls it
    "tokenizer.json": (lambda p: p.symlink_to("/dev/zero"), "a character device, not a regular file"),
    "tokenizer_config.json": (os.mkfifo, "a FIFO, not a regular file"),
    "generation_config.json": (lambda p: p.mkdir(), "a directory, not a regular file"),
    "vocab.json": (lambda p: p.symlink_to(p.parent / "gone"), "gone, which does not exist"),
    "merges.txt": (lambda p: p.symlink_to(p), "merges.txt, a loop of links that ends nowhere"),
}


@pytest.mark.parametrize("name", list(SIDE_FILE_DAMAGE))
def test_a_side_file_that_is_not_a_regular_file_is_named(tmp_path, name):
    """A tokenizer or generation config file that is a device, a FIFO, a directory or a dangling link:
    hf2mcore and mcore2hf's copy back from the checkpoint's hf_config/ name it (it was left out without
    a word, from that output and every later one; the FIFO never opened), before converting any
    weight (a dry run is refused too). A link to a file is copied."""
    damage, said = SIDE_FILE_DAMAGE[name]
    hf = copy_model(tmp_path)
    (hf / name).unlink(missing_ok=True)
    damage(hf / name)
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "-q"), tmp_path / "out", f"{hf / name} is ", said)
    # before any weight: a dry run, which converts nothing, says so too
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "--dry-run"), tmp_path / "out", f"{hf / name} is ", said)
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    stored = tmp_path / "m" / "hf_config" / name
    stored.unlink(missing_ok=True)
    damage(stored)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "-q"), tmp_path / "out", f"{stored} is ", said)
    linked = Path(shutil.copytree(TINY, tmp_path / "linked"))
    (linked / name).unlink(missing_ok=True)
    (linked / name).symlink_to(TINY / "tokenizer.json")
    assert mconv("hf2mcore", linked, tmp_path / "out", "-q").exit_code == 0
    assert (tmp_path / "out" / "hf_config" / name).read_bytes() == (TINY / "tokenizer.json").read_bytes()


def test_a_remote_code_file_that_is_a_fifo_is_named(tmp_path):
    """A remote-code module config.json's auto_map names, made a FIFO: named, not read (reading it
    for its relative imports blocked hf2mcore for good)."""
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    os.mkfifo(hf / "configuration_x.py")
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "-q"), tmp_path / "out",
                   f"{hf / 'configuration_x.py'} is a FIFO, not a regular file")


def test_missing_rank_file(tmp_path):
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    (tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out", "mp_rank_01", "missing")


def test_a_rank_file_of_another_layout_is_named(tmp_path):
    """A TP2 checkpoint with an mp_rank_02 beside its two rank files (a TP4 save's leftover): named,
    not ignored."""
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    shutil.copytree(tmp_path / "m" / "release" / "mp_rank_01", tmp_path / "m" / "release" / "mp_rank_02")
    for command in (("mcore2hf", tmp_path / "m", tmp_path / "out"), ("inspect", tmp_path / "m")):
        assert_refused(mconv(*command), tmp_path / "out", "mp_rank_02/model_optim_rng.pt is not a rank file of the "
                       "layout", "(TP2 PP1): rank files of another layout are mixed in")


def test_megatron_tensor_missing(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_rank_file(path)
    del state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out",
                   "decoder.layers.1.mlp.linear_fc2.weight")


def test_shards_with_different_dtypes_are_refused(tmp_path):
    assert legacy(TINY, tmp_path / "m", "--tp", "2").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt"
    state = load_rank_file(path)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    state["model"][name] = state["model"][name].to(torch.float16)
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "-q"), tmp_path / "out", name,
                   "different dtypes (bfloat16, float16")


def test_torch_dist_refuses_layers_of_different_dtypes(tmp_path):
    """torch_dist stores a parameter of every layer as one tensor: an HF model whose layers differ in
    dtype is refused naming two of them (it was an 'internal' error); the legacy rank files take it."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "mixed"
    shutil.copytree(TINY, hf)
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float16)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", f"{name} is float16",
                   "model.layers.1.mlp.down_proj.weight is bfloat16", "--dtype", "--format torch")
    assert mconv("hf2mcore", hf, tmp_path / "out", "--format", "torch", "-q").exit_code == 0


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/mconv-exploit-ran"),))


def test_legacy_reader_refuses_arbitrary_pickles(tmp_path):
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    path = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_rank_file(path)
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
    (["mcore2hf", "ckpt", "out", "--max-shard-size", "0GB"], "'--max-shard-size': '0GB' is not a size from 1 byte"),
    (["hf2mcore", TINY, "out", "--iteration", "1000000001"], "'--iteration': 1000000001 is not in the range"),
    (["hf2mcore", TINY, "out", "--tpp", "2"], "No such option '--tpp'"),
    (["hf2mcore", TINY, "out", "--tp", "two"], "'--tp': 'two' is not a valid integer"),
    (["hf2mcore", TINY], "Missing argument 'OUT_DIR'"),
    (["convert", TINY], "No such command 'convert'"),
    (["hf2mcore", TINY, "out", "--iteration", "-5"], "'--iteration': -5 is not in the range"),
    (["mcore2hf", "ckpt", "out", "--workers", "0"], "'--workers': 0 is not in the range 1<=x<=64"),
    (["hf2mcore", TINY, "out", "--workers", "1000"], "'--workers': 1000 is not in the range 1<=x<=64"),
    (["hf2mcore", TINY, "out", "--tp", "0"], "'--tp': 0 is not in the range x>=1"),
    (["hf2mcore", TINY, "out", "--pp", "2", "--first-stage-layers", "0"], "'--first-stage-layers': 0 is not in"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, fragment):
    result = mconv(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("mconv: error: ") and fragment in result.stderr, result.stderr


@pytest.mark.parametrize("args", [["inspect", "IN"], ["mcore2hf", "IN", "OUT"], ["hf2mcore", "IN", "OUT"],
                                  ["export-lora", "IN", "OUT", "--alpha", "8"], ["verify", "IN", TINY]])
def test_a_missing_input_is_said_not_to_exist(tmp_path, args):
    missing = tmp_path / "typo"
    result = mconv(*[{"IN": missing, "OUT": tmp_path / "out"}.get(a, a) for a in args])
    assert_refused(result, tmp_path / "out", f"{missing} does not exist", status=2 if args[0] == "verify" else 1)


# ----------------------------------------------------------------------------- library parameters

def test_library_parameters_are_checked_as_the_command_line_checks_them(tmp_path):
    """What the command line's click types refuse, the library refuses too, in one MconvError naming
    the parameter (before any input is read: CKPT here does not exist); --dtype's names are taken as
    strings. Once, int8 weights were written, iter_-000001 made and TypeErrors raised."""
    from mconv import hf2mcore, mcore2hf
    from mconv.converter.lora import export_lora
    from mconv.converter.options import MAX_ITERATION
    from mconv.live import save_hf_weights

    out, ckpt = tmp_path / "out", legacy_checkpoint(tmp_path)
    calls = {
        "dtype=torch.int8 is not a dtype mconv writes; available: float32, bfloat16, float16":
            [lambda: hf2mcore(TINY, out, Layout(), dtype=torch.int8), lambda: mcore2hf("CKPT", out, dtype=torch.int8),
             lambda: export_lora("CKPT", out, merge_into=True, dtype=torch.int8)],
        "dtype='bf16' is not a dtype mconv writes": [lambda: mcore2hf("CKPT", out, dtype="bf16")],
        "iteration=-1 is not an integer from 0 to 1000000000": [lambda: hf2mcore(TINY, out, Layout(), iteration=-1)],
        f"iteration={MAX_ITERATION + 1} is not an integer from 0": [
            lambda: hf2mcore(TINY, out, Layout(), iteration=MAX_ITERATION + 1)],
        "workers=0 is not an integer from 1 to 64": [lambda: hf2mcore(TINY, out, Layout(), workers=0),
                                                     lambda: mcore2hf("CKPT", out, workers=0)],
        "workers=1000 is not an integer from 1 to 64": [lambda: mcore2hf("CKPT", out, workers=1000)],
        "layout='tp2' is not a Layout": [lambda: hf2mcore(TINY, out, "tp2")],
        "max_shard_bytes=0 is not a positive number of bytes": [lambda: mcore2hf("CKPT", out, max_shard_bytes=0),
                                                                lambda: save_hf_weights([], out, TINY, max_shard_bytes=0)],
        "max_shard_bytes=-5 is not a positive number of bytes": [
            lambda: export_lora("CKPT", out, merge_into=True, max_shard_bytes=-5)],
        "max_shard_bytes='1 lb' is not a size such as 3GB": [lambda: mcore2hf("CKPT", out, max_shard_bytes="1 lb")],
        "the output path is empty": [lambda: hf2mcore(TINY, "", Layout()), lambda: mcore2hf(ckpt, "")],
        "hf_config='/nonexist' does not exist": [lambda: mcore2hf("CKPT", out, hf_config="/nonexist")],
    }
    for message, attempts in calls.items():
        for attempt in attempts:
            with pytest.raises(MconvError) as caught:
                attempt()
            assert str(caught.value).startswith(message), (message, str(caught.value))
    assert not out.exists()
    summary = hf2mcore(TINY, out, Layout(), dtype="float16", iteration=MAX_ITERATION, dry_run=True, progress=False)
    assert {task["dtype"] for file in summary.files_plan for task in file["tensors"]} == {"float16"}


def test_command_line_refusals_name_what_is_at_fault(tmp_path):
    """An empty OUT is no directory name (it was read as `.`); a missing --hf-config is named as such."""
    ckpt, lora = legacy_checkpoint(tmp_path), lora_checkpoint(tmp_path)
    for args, fragment in [(["hf2mcore", TINY, ""], "the output path is empty"),
                           (["mcore2hf", ckpt, ""], "the output path is empty"),
                           (["export-lora", lora, "", "--alpha", "8"], "the output path is empty"),
                           (["mcore2hf", ckpt, "out", "--hf-config", "/nonexist"], "--hf-config /nonexist does not exist")]:
        assert_refused(mconv(*args), tmp_path / "out", fragment)


def test_a_lora_checkpoint_given_to_mcore2hf_points_to_export_lora_and_inspect_describes_it(tmp_path, monkeypatch):
    """With or without its base weights, legacy or torch_dist: mcore2hf says in one line that
    export-lora reads it (it was an unexpected adapter tensor, or a missing embedding); inspect
    describes its adapters (it refused them too: new-user pass), the rank the test wrote, the
    modules, whether the base weights are stored, and export-lora."""
    from tests.test_lora import R as RANK
    from tests.test_lora import lora_checkpoint, save_dist_adapters

    full, _ = lora_checkpoint(tmp_path / "full", TINY, Layout(tp=2))
    only, _ = lora_checkpoint(tmp_path / "only", TINY, Layout(), adapter_only=True)
    written_here = only / "release" / "mp_rank_00" / "model_optim_rng.pt"
    adapters = load_rank_file(written_here)["model"]
    dist = save_dist_adapters(tmp_path, TINY, adapters, monkeypatch)
    for ckpt, base in ((full, "stored"), (only, "not stored"), (dist, "not stored")):
        assert_refused(mconv("mcore2hf", ckpt, tmp_path / "out", "--hf-config", TINY), tmp_path / "out",
                       "holds LoRA adapters (", "mconv export-lora")
        for args in ([], ["--hf-config", TINY]):
            shown = mconv("inspect", ckpt, *args)
            assert shown.exit_code == 0, shown.output
            [line] = [line for line in shown.stdout.splitlines() if line.strip().startswith("adapters")]
            assert f"LoRA, rank {RANK}, on linear_fc1, linear_fc2, linear_proj, linear_qkv (" in line, line
            assert f"base weights {base})" in line and "mconv export-lora" in line, line


def test_torch_dist_with_the_config_of_another_model_names_the_embedding(tmp_path):
    """A Qwen3-VL checkpoint read with a Qwen3-MoE --hf-config: the key it looked for, no Python repr."""
    from mconv import hf2mcore

    hf2mcore(FIXTURES / "qwen3-vl-tiny", tmp_path / "m", Layout(), progress=False)
    result = mconv("mcore2hf", tmp_path / "m", tmp_path / "out", "--hf-config", FIXTURES / "qwen3-moe-tiny")
    assert_refused(result, tmp_path / "out", "needs embedding.word_embeddings.weight with at least", "there is none")


def test_help_is_not_an_error():
    result = mconv("hf2mcore", "--help")
    assert result.exit_code == 0
    assert "with --format torch only" in " ".join(result.output.split())  # torch_dist, the default, refuses te
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
    """Every file every writing command makes (safetensors' save_file made export-lora's adapter 0600)."""
    import os

    hf = copy_model(tmp_path)
    (hf / "tokenizer.json").chmod(0o640)  # cp keeps a side file's own bits, less the umask
    shell = modes_made_by_the_shell(tmp_path / "shell", mask, hf)
    lora = lora_checkpoint(tmp_path)
    previous = os.umask(mask)
    try:
        for args in (["hf2mcore", hf, tmp_path / "dist"], ["hf2mcore", hf, tmp_path / "torch", "--format", "torch"],
                     ["mcore2hf", tmp_path / "torch", tmp_path / "back"],
                     ["export-lora", lora, tmp_path / "adapter", "--alpha", 8],
                     ["export-lora", lora, tmp_path / "merged", "--alpha", 8, "--merge", "--base-model", hf]):
            assert mconv(*args, "-q").exit_code == 0
    finally:
        os.umask(previous)
    for out in ("dist", "torch", "back", "adapter", "merged"):
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
    (tmp_path / "out" / "config.json").write_text("{}")
    result = mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run")
    assert result.exit_code == 1 and "already exists; pass --overwrite" in result.stderr
    assert mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run", "--overwrite").exit_code == 0


# ----------------------------------------------------------------------------- full disks, read-only outputs (10.8)

def assert_write_refused(result, out: Path, cause: str):
    assert_refused(result, out, f"cannot write {out}", cause)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("call", ["pwrite", "copy_file_range"])
def test_full_disk_while_writing_safetensors(tmp_path, monkeypatch, kernel_copies, call, fmt):
    """The failure injected at the write system calls, as a full disk raises it: os.pwrite (headers,
    tensors staged in memory) and os.copy_file_range (tensors copied file to file; the headers are
    written)."""
    import errno
    import os

    assert mconv("hf2mcore", TINY, tmp_path / "m", "--format", fmt, "-q").exit_code == 0

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, call, full)
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


def test_a_location_that_cannot_hold_the_staging_directory_names_the_output(tmp_path, monkeypatch):
    """A directory the staging sibling cannot be made in (as under /proc: ENOENT naming the sibling
    mkdtemp tried): the sentence names the output, not mconv's hidden staging path."""
    import errno
    import os
    import tempfile

    def absent(prefix=None, dir=None, **kwargs):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.path.join(dir, prefix + "x1y2z3"))

    monkeypatch.setattr(tempfile, "mkdtemp", absent)
    result = mconv("hf2mcore", TINY, tmp_path / "out")
    assert_write_refused(result, tmp_path / "out", "No such file or directory")
    assert "mconv-partial" not in result.output


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


# ----------------------------------------------------------------------------- interrupts (Ctrl-C, SIGTERM)

def start_mconv(*args, cwd: Path, stderr=None):
    """A real `mconv` process (signals go to it, not to pytest)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "mconv.cli", *[str(a) for a in args]], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def wait_for(condition, process) -> bool:
    """Poll until `condition()` holds (True) or the process has ended (False)."""
    import time

    while process.poll() is None:
        if condition():
            return True
        time.sleep(0.002)
    return False


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "mconv-" in p.name)


def test_ctrl_c_while_the_command_starts_is_one_line_and_status_130(tmp_path):
    """A real SIGINT while the command imports torch (before any conversion code runs): one line,
    exit status 130, nothing written (click alone prints "Aborted!" and exits 1)."""
    import signal

    process = start_mconv("hf2mcore", TINY, tmp_path / "out", cwd=tmp_path)
    torch_loading = lambda: "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()  # noqa: E731
    assert wait_for(torch_loading, process), process.communicate(timeout=300)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert stderr == documented("mconv: interrupted; nothing", tmp_path / "out") and stdout == ""
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_ctrl_c_swallowed_inside_the_torch_import_still_stops_the_command(tmp_path):
    """torch's C module imports numpy and carries on without it when that import fails, so a Ctrl-C
    landing there raised a KeyboardInterrupt that torch swallowed, and the conversion ran to the end
    (seen with a real SIGINT about half a second after start). A stand-in torch that swallows one
    the same way: the command still stops with one line and status 130."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    sum(range(10000))\n"
        "except KeyboardInterrupt:\n"
        "    pass\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "mconv.cli", "hf2mcore", str(TINY), str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{root}"})
    assert done.returncode == 130, done.stderr
    assert done.stderr == f"mconv: interrupted; nothing was written to {tmp_path / 'out'}\n" and done.stdout == ""
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


EARLY_SIGNAL = """
import os, signal, sys

class SignalOnClick:  # sends the signal as `click` is first imported: while the command line is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), getattr(signal, sys.argv.pop(1)))

sys.meta_path.insert(0, SignalOnClick())
from mconv.program import main
main()
"""


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_command_line_is_imported_is_one_line(tmp_path, signame):
    """Importing the command line takes a few tenths of a second; a signal then met Python's
    defaults (a KeyboardInterrupt traceback, or a silent kill by SIGTERM). The mconv program
    (`mconv.program`, its console script and `python -m mconv`) takes its signals first: one line,
    128 + the signal, nothing written."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", EARLY_SIGNAL, signame, "hf2mcore", str(TINY), str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    what = "terminated" if signame == "SIGTERM" else "interrupted"
    assert done.returncode == 128 + getattr(signal, signame), done.stderr
    assert done.stderr == f"mconv: {what} before it started; nothing was written\n" and done.stdout == ""
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["hf2mcore torch_dist", "hf2mcore torch", "mcore2hf"])
def test_interrupt_while_writing_leaves_nothing(tmp_path, command, signame):
    """A real SIGINT / SIGTERM while the output is being written by 2 worker threads: the process
    is stopped (SIGSTOP) while its staging directory exists and the output does not, signalled and
    resumed; it exits 128 + the signal with one line, and nothing is left (no output, no staging
    directory, also with --overwrite: the old output intact)."""
    import os
    import signal

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an old output that --overwrite may replace
    if command == "mcore2hf":
        assert legacy(TINY, tmp_path / "m", "--tp", 2).exit_code == 0
        args = ["mcore2hf", tmp_path / "m", out, "--max-shard-size", "50KB"]
    else:
        args = ["hf2mcore", TINY, out, "--format", command.split()[1], "--tp", 2]
    signum = getattr(signal, signame)
    for _ in range(5):  # until the signal lands while the output is being written (not after it)
        process = start_mconv(*args, "--workers", 2, "--overwrite", cwd=tmp_path)
        staging = lambda: any(".mconv-partial-" in p.name for p in tmp_path.iterdir())  # noqa: E731
        if not wait_for(staging, process):
            pytest.fail(process.communicate(timeout=300)[1])
        process.send_signal(signal.SIGSTOP)
        if staging() and (out / "config.json").is_file():
            break
        process.send_signal(signal.SIGCONT)
        process.communicate(timeout=300)
    os.kill(process.pid, signum)
    process.send_signal(signal.SIGCONT)
    stdout, stderr = process.communicate(timeout=300)
    what = "interrupted" if signame == "SIGINT" else "terminated"
    assert process.returncode == 128 + signum, stderr
    assert stderr == documented("mconv: interrupted; nothing", out).replace("interrupted", what), stderr
    assert (out / "config.json").read_text() == "{}" and [p.name for p in out.iterdir()] == ["config.json"]
    assert leftovers(tmp_path) == []


INTERRUPTED_IMPORT = """
import importlib.abc, importlib.machinery, signal, sys, threading, time
from mconv.cli import process

signal.signal(signal.SIGINT, process._on_signal)
process._command.update(out=None, done=False)


class Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.value = 1


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "interrupted_import":
            signal.raise_signal(signal.SIGINT)  # its handler runs here, called from importlib's frames
            return importlib.machinery.ModuleSpec(name, Loader())


sys.meta_path.insert(0, Finder())
try:
    import interrupted_import
    print("imported", interrupted_import.value, flush=True)
    time.sleep(10)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after it:", "interrupted_import" in sys.modules)
    imported = []
    thread = threading.Thread(target=lambda: imported.append(__import__("json.tool")))
    thread.start()
    thread.join(10)
    print("a thread imports:", bool(imported))
"""


def test_a_signal_inside_an_import_is_raised_after_it(tmp_path):
    """mconv's SIGINT handler does not raise while the main thread is in importlib's code (an
    exception raised between its `_imp.acquire_lock()` and its `try` leaves the import lock held,
    and every later import in any thread waits forever: an interrupted hf2mcore hung so, its worker
    threads importing): the interrupt comes once the import has finished, and a thread can import
    after it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.stdout.splitlines() == ["imported 1", "interrupted after it: True", "a thread imports: True"], \
        done.stderr[-2000:]


def test_of_two_runs_to_one_output_one_wins_and_the_other_says_so(tmp_path):
    """A second run to an OUT that a real mconv process is writing (stopped while its staging
    directory exists) is refused at once, with or without --overwrite; the first one's output is
    the one in place. Both used to print `wrote`, and the first output silently disappeared."""
    import signal

    out = tmp_path / "out"
    for _ in range(5):  # until the first run is stopped while it writes (not after)
        process = start_mconv("hf2mcore", TINY, out, "-q", cwd=tmp_path)
        staging = lambda: any(".mconv-partial-" in p.name for p in tmp_path.iterdir())  # noqa: E731
        if not wait_for(staging, process):
            pytest.fail(process.communicate(timeout=300)[1])
        process.send_signal(signal.SIGSTOP)
        if staging() and not out.exists():
            break
        process.send_signal(signal.SIGCONT)
        process.communicate(timeout=300)
        shutil.rmtree(out, ignore_errors=True)
    try:
        second = [mconv("hf2mcore", TINY, out, "-q", *overwrite) for overwrite in ([], ["--overwrite"])]
    finally:
        process.send_signal(signal.SIGCONT)
    stdout, stderr = process.communicate(timeout=300)
    refusal = documented("mconv: error: another mconv run", out)
    assert [(r.exit_code, r.stderr) for r in second] == [(1, refusal)] * 2
    assert (process.returncode, stdout, stderr) == (0, "", "")
    assert (out / "latest_checkpointed_iteration.txt").is_file() and leftovers(tmp_path) == []


def test_an_interrupt_during_the_final_rename_is_held_back(tmp_path, monkeypatch):
    """Ctrl-C arriving while the finished output is renamed into place (or a failed run's staging
    directory removed) cannot stop either halfway: the output is complete, or nothing is left."""
    import os
    import signal

    from mconv.converter import output

    real_rename = Path.rename

    def rename(self, target):  # the signal arrives inside the rename
        if Path(target) == tmp_path / "out":
            os.kill(os.getpid(), signal.SIGINT)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    try:
        with output.staged_directory(tmp_path / "out", overwrite=False) as staging:
            (staging / "config.json").write_text("{}")
    except KeyboardInterrupt:
        pytest.fail("the interrupt stopped the rename")
    assert (tmp_path / "out" / "config.json").read_text() == "{}" and leftovers(tmp_path) == []
    monkeypatch.setattr(Path, "rename", real_rename)
    real_rmtree = output.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(output.shutil, "rmtree", rmtree)
    try:
        with output.staged_directory(tmp_path / "other", overwrite=False) as staging:
            raise MemoryError
    except KeyboardInterrupt:  # delivered once the clean-up is done
        pass
    except MemoryError:
        pytest.fail("the interrupt was lost")
    assert not (tmp_path / "other").exists() and leftovers(tmp_path) == []


def test_an_interrupt_once_the_output_is_in_place_says_so_and_exits_0(tmp_path):
    """Ctrl-C right after the output was renamed into place (landing as the conversion returns)
    does not claim that nothing was written: one line saying the output is complete, status 0;
    with --overwrite the new output is the one in place."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    script = ("import os, signal\n"
              "from mconv.converter import hf2mcore as module\n"
              "real = module.hf2mcore\n"
              "def hf2mcore(*args, **kwargs):\n"
              "    summary = real(*args, **kwargs)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    return summary\n"
              "module.hf2mcore = hf2mcore\n"
              "from mconv.cli import entry\n"
              "entry()\n")
    done = subprocess.run([sys.executable, "-c", script, "hf2mcore", str(TINY), str(out), "--overwrite", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert (done.returncode, done.stdout, done.stderr) == (0, "", f"mconv: interrupted after {out} was complete; "
                                                                  "it is in place\n")
    assert (out / "latest_checkpointed_iteration.txt").is_file() and leftovers(tmp_path) == []


# The mconv program, stopping itself (SIGSTOP) at the 1st, 2nd, 4th, 8th... Python function start or
# return after the closing line is out, down to the end of the process (sys.monitoring: it keeps
# counting where a signal handler raises in its callback; sys.setprofile would stop there).
STOPS_AFTER_THE_CLOSING_LINE = """
import os, signal, sys
import mconv.cli as cli

count = {"events": 0, "next": 1}
monitoring = sys.monitoring

def stop(*args):
    count["events"] += 1
    if count["events"] == count["next"]:
        count["next"] *= 2
        os.kill(os.getpid(), signal.SIGSTOP)

report = cli.report

def reported(*args, **kwargs):
    report(*args, **kwargs)
    sys.stdout.flush()
    monitoring.use_tool_id(monitoring.PROFILER_ID, "stops")
    for event in (monitoring.events.PY_START, monitoring.events.PY_RETURN):
        monitoring.register_callback(monitoring.PROFILER_ID, event, stop)
    monitoring.set_events(monitoring.PROFILER_ID, monitoring.events.PY_START | monitoring.events.PY_RETURN)

cli.report = reported
cli.entry()
"""


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (T: stopped, Z: exited), None once the process is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.parametrize("signame,fmt", [("SIGINT", "torch_dist"), ("SIGTERM", "torch")])
def test_a_signal_after_the_closing_line_exits_0_and_says_so(tmp_path, signame, fmt):
    """A real SIGINT / SIGTERM at each of several points after the closing `wrote ...` line, down
    to the process's end (the process stopped there): status 0 and one line saying the output is
    complete (later signals are ignored). The mconv program used to put SIGTERM back to its default
    as `main` returned (killed: status 143), and a SIGINT then was silent or a traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", STOPS_AFTER_THE_CLOSING_LINE, "hf2mcore", str(TINY), str(out),
                                "--format", fmt], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    signum, sent, deadline = getattr(signal, signame), 0, time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if process_state(process.pid) in ("T", "t"):
            os.kill(process.pid, signum)
            sent += 1
            os.kill(process.pid, signal.SIGCONT)
        time.sleep(0.001)
    stdout, stderr = process.communicate(timeout=10)
    what = "interrupted" if signame == "SIGINT" else "terminated"
    said = documented("mconv: interrupted after", out).replace("interrupted", what)
    assert (process.returncode, stderr) == (0, said), stderr
    assert stdout.startswith(f"wrote {out} ({fmt})") and sent >= 3, (stdout, sent)
    assert (out / "latest_checkpointed_iteration.txt").is_file() and leftovers(tmp_path) == []


@pytest.mark.slow
def test_signals_at_random_times_leave_a_complete_output_or_nothing(tmp_path):
    """Stress: 8 runs of `hf2mcore --workers 2` (both formats) on a 20 MB model, each sent 1 to 3
    SIGINT / SIGTERM a few milliseconds apart at a random time: while torch is imported, while the
    threads write the staging directory, or once the output is in place. Every run ends with
    status 130 / 143, one line, and nothing left, or status 0, a complete output and at most the
    line saying so; never a traceback nor a thread alive at exit ("terminate called without an
    active exception", status 134, once seen after a SIGTERM during a run)."""
    import random
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from fixtures.make_fixtures import make_qwen3

    hf = make_qwen3(tmp_path / "hf", tokenizer=False, hidden_size=256, intermediate_size=1024, vocab_size=8192,
                    head_dim=64)
    libtorch = lambda pid: "libtorch" in Path(f"/proc/{pid}/maps").read_text()  # noqa: E731

    def run(i: int) -> None:
        rng, where = random.Random(i), tmp_path / f"run{i}"
        where.mkdir()
        out = where / "out"
        process = start_mconv("hf2mcore", hf, out, "--workers", 2, "--format", ["torch", "torch_dist"][i % 2],
                              cwd=where)
        when = rng.choice(["importing", "writing", "writing", "in place"])
        condition = {"importing": lambda: libtorch(process.pid), "in place": out.exists,
                     "writing": lambda: any(".mconv-partial-" in p.name for p in where.iterdir())}[when]
        wait_for(condition, process)
        time.sleep(rng.uniform(0, 1.0 if when == "importing" else 0.05))
        sent = []
        for _ in range(rng.randint(1, 3)):
            sent.append(rng.choice([signal.SIGINT, signal.SIGTERM]))
            process.send_signal(sent[-1])
            time.sleep(rng.uniform(0, 0.005))
        stdout, stderr = process.communicate(timeout=240)
        words = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
        case = (i, when, [words[s] for s in sent], process.returncode, stderr)
        if process.returncode == 0:
            assert stderr in {"", *(f"mconv: {words[s]} after {out} was complete; it is in place\n" for s in sent)}, case
            assert (out / "latest_checkpointed_iteration.txt").is_file(), case
        else:
            signum = process.returncode - 128
            assert signum in sent and stderr == f"mconv: {words[signum]}; nothing was written to {out}\n", case
            assert not out.exists(), case
        assert leftovers(where) == [], case

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, range(8)))


# ----------------------------------------------------------------------------- damaged torch_dist checkpoints

def test_truncated_distcp_is_reported_by_inspect_and_refused_by_mcore2hf(tmp_path):
    assert mconv("hf2mcore", TINY, tmp_path / "d", "-q").exit_code == 0
    data = tmp_path / "d" / "release" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 5000)  # into the last tensor, output_layer.weight, before the common state
    for args in (["inspect", tmp_path / "d"], ["inspect", tmp_path / "d", "--json"],
                 ["mcore2hf", tmp_path / "d", tmp_path / "out"], ["export-lora", tmp_path / "d", tmp_path / "out"]):
        assert_refused(mconv(*args), tmp_path / "out", f"{data} is truncated: it ends at byte {size - 5000:,}",
                       "stores output_layer.weight at bytes", "the checkpoint is damaged")
    data.unlink()
    assert_refused(mconv("inspect", tmp_path / "d"), tmp_path / "out", f"{data} is missing, but .metadata stores")


# ----------------------------------------------------------------------------- -q, progress bars in logs

def tied_model_with_a_redundant_head(tmp_path) -> Path:
    """A model hf2mcore converts with a note (the tied head's copy is not converted)."""
    hf = copy_model(tmp_path, FIXTURES / "qwen3-tiny-tied")
    edit_weights(hf, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    return hf


def test_quiet_means_the_same_for_every_command(tmp_path):
    """-q: no progress bars, no informational lines (notes, "wrote ...", "identical ..."); the
    output a command is asked for (inspect's description, --dry-run's plan, --json) and errors are
    still printed. Every command says so in its --help."""
    from mconv.cli import QUIET_HELP
    from tests.test_lora import lora_checkpoint

    for command in ("hf2mcore", "mcore2hf", "inspect", "verify", "export-lora"):
        assert " ".join(QUIET_HELP.split()) in " ".join(mconv(command, "--help").output.split()), command
    hf = tied_model_with_a_redundant_head(tmp_path)
    assert "mconv: note: lm_head.weight equals" in mconv("hf2mcore", hf, tmp_path / "noted").stderr
    lora, _ = lora_checkpoint(tmp_path, TINY, Layout(tp=2))
    quiet_runs = [["hf2mcore", hf, tmp_path / "m", "--format", "torch"], ["mcore2hf", tmp_path / "m", tmp_path / "back"],
                  ["verify", TINY, TINY], ["export-lora", lora, tmp_path / "adapter", "--alpha", 8]]
    for args in quiet_runs:
        result = mconv(*args, "-q")
        assert result.exit_code == 0 and result.stdout == "" and result.stderr == "", (args, result.output)
    assert mconv("inspect", tmp_path / "m", "-q").stdout.startswith(f"{tmp_path / 'm'}: Megatron checkpoint")
    assert "total: " in mconv("hf2mcore", TINY, tmp_path / "plan", "--dry-run", "-q").stdout
    plan = json.loads(mconv("hf2mcore", TINY, tmp_path / "plan", "--dry-run", "--json", "--tp", 2, "--format", "torch").stdout)
    assert plan["files"] == 2 and plan["plan"][0]["file"] == "mp_rank_00" and plan["plan"][0]["chunks"] == 1
    assert json.loads(mconv("mcore2hf", tmp_path / "m", tmp_path / "back2", "--json", "-q").stdout)["tensors"] > 0
    for args in quiet_runs[:2] + quiet_runs[3:]:  # errors are still printed: every output exists now
        result = mconv(*args, "-q")
        assert result.exit_code == 1 and result.stderr.startswith("mconv: error: "), (args, result.output)
    result = mconv("verify", TINY, FIXTURES / "qwen3-tiny-tied", "-q")
    assert result.exit_code == 1 and "mconv: error: " in result.stderr


def test_no_progress_bar_fragments_in_a_log_file(tmp_path):
    """stderr redirected to a file (not a terminal): no tqdm bar, so no carriage returns in the log."""
    with open(tmp_path / "log", "w") as log:
        process = start_mconv("hf2mcore", TINY, tmp_path / "out", cwd=tmp_path, stderr=log)
        stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0 and stdout.startswith(f"wrote {tmp_path / 'out'}")
    assert (tmp_path / "log").read_text() == ""


# ----------------------------------------------------------------------------- mconv.live.save_hf_weights

@pytest.mark.slow
def test_live_save_failures_are_one_sentence_and_leave_nothing(tmp_path):
    """save_hf_weights on a megatron-core GPTModel (one gloo process) with the failure injected as the
    system raises it: ENOSPC at os.pwrite, EROFS at os.mkdir, EACCES at os.open. Each raises
    MconvError `cannot write OUT: <cause>; nothing was written`, leaves no `.OUT.mconv-partial-live`,
    and an existing output stays as it was. An output that appears while the model is saved, and a
    directory no mconv command wrote, are refused and left as they are; so is a second save to an
    output a save is writing. The saved files get the modes mkdir / cp give under the umask."""

    from tests.megatron_oracle import MegatronRun, read_config

    run = MegatronRun(tmp_path, read_config(TINY), padded_vocab=384)
    start_ranks(_live_save_worker, args=(run, tmp_path), nprocs=1)
    results = json.loads((tmp_path / "results.json").read_text())
    for case, cause in (("pwrite", "No space left on device"), ("mkdir", "Read-only file system"),
                        ("open", "Permission denied")):
        out = tmp_path / case
        assert results[case] == ["MconvError", f"cannot write {out}: {cause}; nothing was written"], case
        assert leftovers(tmp_path) == [] and not out.exists()
    assert results["existing"][0] == "MconvError" and results["existing"][1].startswith(f"cannot write {tmp_path / 'saved'}")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == results["saved files"]
    shell = modes_made_by_the_shell(tmp_path / "shell", results["umask"], TINY)
    assert results["modes"] == {name: shell["dir"] if name == "." else shell.get(name, shell["file"])
                                for name in results["modes"]}
    busy = tmp_path / "busy"
    assert results["busy"] == ["MconvError", f"another mconv run is writing {busy}; wait for it to end or choose "
                                             "another output directory"]
    assert mconv("verify", busy, TINY, "-q").exit_code == 0  # the first save went on
    assert mconv("verify", tmp_path / "saved", TINY, "-q").exit_code == 0  # the earlier save, intact
    appeared, foreign = tmp_path / "appeared", tmp_path / "foreign"  # nor is any other directory replaced
    assert results["appeared"] == ["MconvError", f"{appeared} appeared while mconv was writing it; it was left as it "
                                                 "is and the new output was removed"]
    assert results["foreign"][0] == "MconvError" and "holds neither a model" in results["foreign"][1]
    assert [(p / "notes.txt" if p == appeared else p / "thesis.txt").read_text() for p in (appeared, foreign)] == \
        ["mine", "mine"] and len(list(appeared.iterdir())) == len(list(foreign.iterdir())) == 1
    assert leftovers(tmp_path) == []


def _live_save_worker(rank, run, where: Path):
    import errno
    import os
    import warnings
    from unittest import mock

    warnings.filterwarnings("ignore")
    import mconv.live
    from mconv.converter.output import umask as output_umask
    from tests.megatron_oracle import one_process_gpt

    with one_process_gpt(run) as model:
        model = model.to(torch.bfloat16)
        mconv.live.load_hf_weights([model], TINY)

        def failing(name, code, real):
            def call(path, *args, **kwargs):
                writing = name != "open" or args[0] & (os.O_WRONLY | os.O_RDWR)  # not rmtree's reads
                if name != "pwrite" and (".mconv-partial-live" not in str(path) or not writing):
                    return real(path, *args, **kwargs)
                raise OSError(code, os.strerror(code), *([] if name == "pwrite" else [str(path)]))
            return call

        results = {}
        cases = {"pwrite": errno.ENOSPC, "mkdir": errno.EROFS, "open": errno.EACCES}
        for case, code in cases.items():
            with mock.patch.object(os, case, failing(case, code, getattr(os, case))):
                try:
                    mconv.live.save_hf_weights([model], where / case, TINY)
                    results[case] = ["saved"]
                except Exception as e:
                    results[case] = [type(e).__name__, str(e)]
        mconv.live.save_hf_weights([model], where / "saved", TINY)
        results["saved files"] = sorted(p.name for p in (where / "saved").iterdir())
        results["umask"] = output_umask()
        results["modes"] = {"." if p == where / "saved" else p.name: p.stat().st_mode & 0o7777
                            for p in [where / "saved", *(where / "saved").iterdir()]}
        with mock.patch.object(os, "pwrite", failing("pwrite", errno.ENOSPC, os.pwrite)):
            try:
                mconv.live.save_hf_weights([model], where / "saved", TINY)
                results["existing"] = ["saved"]
            except Exception as e:
                results["existing"] = [type(e).__name__, str(e)]
        from mconv.converter import hf_config

        real_copy = hf_config.copy_side_files  # (what HF outputs copy their side files with: hf_write.finish)

        def appearing(*args):  # another program makes the output while the model is saved
            (where / "appeared").mkdir()
            (where / "appeared" / "notes.txt").write_text("mine")
            return real_copy(*args)

        def second_save(*args):  # another save to the output this one is writing
            try:
                mconv.live.save_hf_weights([model], where / "busy", TINY)
                results["busy"] = ["saved"]
            except Exception as e:
                results["busy"] = [type(e).__name__, str(e)]
            return real_copy(*args)

        with mock.patch.object(hf_config, "copy_side_files", second_save):
            mconv.live.save_hf_weights([model], where / "busy", TINY)
        (where / "foreign").mkdir()
        (where / "foreign" / "thesis.txt").write_text("mine")
        for case in ("appeared", "foreign"):
            with mock.patch.object(hf_config, "copy_side_files", appearing if case == "appeared" else real_copy):
                try:
                    mconv.live.save_hf_weights([model], where / case, TINY)
                    results[case] = ["saved"]
                except Exception as e:
                    results[case] = [type(e).__name__, str(e)]
        (where / "results.json").write_text(json.dumps(results))


# ----------------------------------------------------------------------------- a new user's mistakes

@pytest.mark.parametrize("case", ["checkpoint as HF input", "iteration dir as HF input", "output under a file",
                                  "dry run, output under a file", "hf-config without config.json", "neither",
                                  "lora dtype without merge", "lora shard size without merge", "lora alpha nan",
                                  "lora alpha 0", "lora alpha negative", "revision of a local directory",
                                  "revision with no hub name", "output is the root", "inspect an HF model with --hf-config"])
def test_a_new_users_mistakes_are_one_line(tmp_path, case):
    """Each mistake: exit status 1, one line saying what is wrong (not a raw OSError naming a staging
    directory, not a missing config.json of the wrong thing), nothing written."""
    assert legacy(TINY, tmp_path / "m").exit_code == 0
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    args, fragment = {
        "checkpoint as HF input": (["hf2mcore", tmp_path / "m", out], "m is a Megatron checkpoint; hf2mcore reads HF"),
        "iteration dir as HF input": (["hf2mcore", tmp_path / "m" / "release", out], "is a Megatron checkpoint"),
        "output under a file": (["mcore2hf", tmp_path / "m", TINY / "config.json" / "out"],
                                f"cannot write {TINY / 'config.json' / 'out'}: {TINY / 'config.json'} is not a directory"),
        "dry run, output under a file": (["hf2mcore", TINY, TINY / "config.json" / "out", "--dry-run"],
                                         f"{TINY / 'config.json'} is not a directory"),
        "hf-config without config.json": (["mcore2hf", tmp_path / "m", out, "--hf-config", tmp_path / "empty"],
                                          f"--hf-config {tmp_path / 'empty'} has no config.json"),
        "neither": (["inspect", tmp_path / "empty"], "is neither an HF model (no config.json) nor a Megatron checkpoint"),
        "lora dtype without merge": (["export-lora", tmp_path / "m", out, "--dtype", "float32"],
                                     "--dtype applies only with --merge"),
        "lora shard size without merge": (["export-lora", tmp_path / "m", out, "--max-shard-size", "1GB"],
                                          "--max-shard-size applies only with --merge"),
        "lora alpha nan": (["export-lora", tmp_path / "m", out, "--alpha", "nan"], "--alpha must be a positive number"),
        "lora alpha 0": (["export-lora", tmp_path / "m", out, "--alpha", "0"], "--alpha must be a positive number"),
        "lora alpha negative": (["export-lora", tmp_path / "m", out, "--alpha", "-2"],
                                "--alpha must be a positive number (scale = alpha / r), got -2"),
        "revision of a local directory": (["hf2mcore", TINY, out, "--revision", "main"],
                                          f"{TINY} is a local directory; a revision applies only to hub model names"),
        "revision with no hub name": (["mcore2hf", tmp_path / "m", out, "--revision", "main"],
                                      "a revision applies only to hub model names, and no hub name was given"),
        "output is the root": (["hf2mcore", TINY, "/", "--overwrite"], "output / overlaps the input"),
        "inspect an HF model with --hf-config": (["inspect", TINY, "--hf-config", FIXTURES / "qwen3-moe-tiny"],
                                                 "is an HF model, which has its own config.json; --hf-config is for"),
    }[case]
    assert_refused(mconv(*args, "-q"), out, fragment)
    assert leftovers(TINY) == []


def stopped_group(leader: int) -> bool:
    """Whether every process of the process group `leader` leads is stopped (state T in /proc)."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended meanwhile
            continue
        if int(fields[2]) == leader:
            states.append(fields[0])
    return bool(states) and all(state in "Tt" for state in states)


@pytest.mark.slow
def test_ctrl_c_stops_every_torchrun_rank_and_leaves_nothing(tmp_path):
    """Ctrl-C in a terminal signals torchrun and its 2 ranks (one process group) while the ranks
    write (all stopped with SIGSTOP while the staging directory exists): every process ends, a rank
    waiting for the other at a barrier included (a blocking TCPStore wait ran no signal handler),
    and nothing is left. Rank 0 may be inside the final rename when the signal comes; then the
    output is complete and in place, and no rank says that nothing was written (only rank 0,
    which made the rename, speaks about the output)."""
    import os
    import signal
    import subprocess
    import sys

    assert legacy(TINY, tmp_path / "m", "--tp", 2).exit_code == 0
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29000 + os.getpid() % 1000 + 500), "-m", "mconv.cli", "mcore2hf", tmp_path / "m", out,
               "--max-shard-size", "50KB"]
    for _ in range(5):
        process = subprocess.Popen([str(a) for a in command], cwd=Path(__file__).resolve().parents[1],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        staging = lambda: (tmp_path / ".out.mconv-partial-torchrun").exists()  # noqa: E731
        if not wait_for(staging, process):
            pytest.fail(process.communicate(timeout=300)[1][-3000:])
        os.killpg(process.pid, signal.SIGSTOP)  # delivered asynchronously: wait until every process has stopped
        assert wait_for(lambda: stopped_group(process.pid), process)
        if staging() and not out.exists():
            break
        os.killpg(process.pid, signal.SIGCONT)
        process.communicate(timeout=300)
        shutil.rmtree(out, ignore_errors=True)
    os.killpg(process.pid, signal.SIGINT)
    os.killpg(process.pid, signal.SIGCONT)
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("a rank did not stop")
    assert process.returncode != 0, stderr[-3000:]  # torchrun's own status after a Ctrl-C
    if out.exists():
        assert f"mconv: interrupted after {out} was complete; it is in place" in stderr, stderr[-3000:]
        assert "nothing was written" not in stderr, stderr[-3000:]
    else:
        assert f"mconv: interrupted; nothing was written to {out}" in stderr, stderr[-3000:]
    assert leftovers(tmp_path) == []


TEAM_SCRIPT = """
import datetime, signal, sys
import torch.distributed as dist
from mconv.converter.parallel import TorchrunTeam
from mconv.errors import MconvError

store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(hours=1))
first, second = TorchrunTeam(0, 2, store, "job"), TorchrunTeam(1, 2, store, "job")

def interrupted():
    raise KeyboardInterrupt

try:  # rank 0 is interrupted in its step: it leaves a note and counts as arrived
    first.step("written", interrupted)
except KeyboardInterrupt:
    pass
try:  # so rank 1 does not wait for it
    second.step("written", lambda: None)
except MconvError as e:
    print(e)
signal.signal(signal.SIGALRM, lambda *a: interrupted())
signal.setitimer(signal.ITIMER_REAL, 0.5)
try:  # a rank waiting for a rank that never comes still takes Ctrl-C
    second.barrier("finished")
except KeyboardInterrupt:
    print("interrupted while waiting")
"""


def test_a_torchrun_rank_is_interruptible_and_never_waits_for_a_stopped_one():
    """TorchrunTeam on a real TCPStore: a rank stopped by an interrupt leaves a note the others stop
    with, and a rank waiting at a barrier takes Ctrl-C (a blocking TCPStore wait ran no Python
    signal handler: Ctrl-C or torchrun's SIGTERM left the rank waiting for hours)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", TEAM_SCRIPT], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.splitlines() == ["rank 0 stopped (KeyboardInterrupt)", "interrupted while waiting"], \
        result.stdout + result.stderr[-2000:]


def test_library_paths_that_are_no_paths(tmp_path):
    """The library's path arguments given None or a number: one MconvError naming the argument
    (a TypeError from pathlib before; hf2mcore looked the name 'None' up on the Hub)."""
    from mconv import hf2mcore, inspect_path, mcore2hf

    for call, named in ((lambda: hf2mcore(None, tmp_path / "a", Layout(), progress=False), "the HF model"),
                        (lambda: hf2mcore(TINY, None, Layout(), progress=False), "the output path"),
                        (lambda: mcore2hf(3, tmp_path / "b", progress=False), r"ckpt_dir is 3 \(int\)"),
                        (lambda: inspect_path(None), "path is None")):
        with pytest.raises(MconvError, match=rf"^{named}.*: give a path \(a str or pathlib.Path\)$"):
            call()
    assert not any(tmp_path.iterdir())


def test_a_vocab_divisor_that_more_than_doubles_the_vocabulary_is_noted(tmp_path):
    """--vocab-divisor is taken as given, but where it pads the vocabulary to more than twice its size
    (a 300-token vocabulary to 1024 rows) the plan says so and what it costs; the default's padding
    (to 384) says nothing; a divisor whose product with TP passes the bound is named as given, with
    the bound at that TP (the product was named as if given)."""
    noted = mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run", "--vocab-divisor", "1024")
    assert noted.exit_code == 0 and ("mconv: note: --vocab-divisor 1024 (times TP 1) pads the 300-token vocabulary "
                                     "to 1024 rows, more than twice its size: 724 zero rows in each vocabulary-sized "
                                     "tensor") in noted.stderr
    plain = mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run")
    assert plain.exit_code == 0 and "zero rows" not in plain.stderr
    huge = mconv("hf2mcore", TINY, tmp_path / "out", "--dry-run", "--tp", "2", "--vocab-divisor", str(2**31))
    assert_refused(huge, tmp_path / "out", "--vocab-divisor is 2,147,483,648: at --tp 2 the vocabulary is padded to "
                                           "a multiple of 4,294,967,296; give a divisor up to 1,073,741,824")


def test_a_config_field_the_table_needs_is_named_with_its_file(tmp_path):
    """config.json without a field the architecture's table reads: hf2mcore and inspect name the
    file and the field (the sentence said only "config.json", whichever directory it was)."""
    hf = copy_model(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    del config["num_attention_heads"]
    (hf / "config.json").write_text(json.dumps(config))
    said = f"{hf / 'config.json'} has no 'num_attention_heads', which Qwen3ForCausalLM needs"
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "-q"), tmp_path / "out", said)
    result = mconv("inspect", hf)
    assert result.exit_code == 1 and said in result.stderr
    # in a vision-language model's nested blocks, the field is named with its block
    vl = Path(shutil.copytree(FIXTURES / "qwen3-vl-tiny", tmp_path / "vl"))
    config = json.loads((vl / "config.json").read_text())
    del config["text_config"]["num_attention_heads"]
    config["vision_config"]["depth"] = None
    (vl / "config.json").write_text(json.dumps(config))
    said = f"{vl / 'config.json'} has no 'text_config.num_attention_heads', which Qwen3VLForConditionalGeneration needs"
    assert_refused(mconv("hf2mcore", vl, tmp_path / "out", "-q"), tmp_path / "out", said)
    config["text_config"]["num_attention_heads"] = 4
    (vl / "config.json").write_text(json.dumps(config))
    assert_refused(mconv("hf2mcore", vl, tmp_path / "out", "-q"), tmp_path / "out",
                   f"{vl / 'config.json'} gives 'vision_config.depth' as null, which Qwen3VLForConditionalGeneration needs")


@pytest.mark.parametrize("command", [["hf2mcore", "", "OUT"], ["hf2mcore", str(TINY), ""], ["mcore2hf", "", "OUT"],
                                     ["export-lora", "", "OUT"], ["inspect", ""], ["verify", "", str(TINY)]],
                         ids=["hf2mcore in", "hf2mcore out", "mcore2hf", "export-lora", "inspect", "verify"])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, command):
    """An empty argument (an unset shell variable) is named, not taken as "." (new-user pass: hf2mcore
    "" read the current directory)."""
    result = mconv(*[str(tmp_path / "out") if part == "OUT" else part for part in command], "-q")
    assert result.exit_code == (2 if command[0] == "verify" else 1) and "is empty: give a path" in result.stderr
    # (verify's 1 says the models differ)
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_export_lora_refuses_to_record_a_local_base_model_of_another_shape(tmp_path):
    """--base-model without --merge is only recorded in adapter_config.json, but a local one that is
    not the model the adapters were trained on (another architecture, other sizes) is refused by
    name (new-user pass: a MoE base was recorded for a dense adapter); a hub name is recorded as given."""
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path / "lora", TINY, Layout())
    for base, fragment in ((FIXTURES / "qwen3-moe-tiny", "is a Qwen3MoeForCausalLM, the adapter is for Qwen3ForCausalLM"),
                           (FIXTURES / "qwen3-tiny-tied", "has layers 2, the model the adapter was trained on 4")):
        assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", 8, "--base-model", base), tmp_path / "out",
                       fragment, "give --base-model the model it was trained on")
    assert mconv("hf2mcore", TINY, tmp_path / "megatron", "-q").exit_code == 0
    assert_refused(mconv("export-lora", lora, tmp_path / "out", "--alpha", 8, "--base-model", tmp_path / "megatron"),
                   tmp_path / "out", "is a Megatron checkpoint; --base-model names the HF model")
    for base in (TINY, "Qwen/Qwen3-8B", "/models/not-on-this-machine"):
        assert mconv("export-lora", lora, tmp_path / "out", "--alpha", 8, "--base-model", base, "--overwrite",
                     "-q").exit_code == 0
        assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)


def test_a_merge_that_fp8_cannot_quantize_names_the_adapter(tmp_path):
    """export-lora --merge --quantize fp8 of an adapter holding a NaN: one line naming the merged
    weight, the base model and the adapter's A and B (new-user pass: it named the weight alone, as
    if the base were at fault), nothing written."""
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path / "lora", TINY, Layout())
    rank_file = lora / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_rank_file(rank_file)
    key = next(k for k in state["model"] if "self_attention.linear_qkv.adapter.linear_in" in k)
    state["model"][key][0, 0] = float("nan")
    torch.save(state, rank_file)
    result = mconv("export-lora", lora, tmp_path / "out", "--alpha", 8, "--merge", "--base-model", TINY,
                   "--quantize", "fp8")
    assert_refused(result, tmp_path / "out", "with its adapter merged (the weight of", "check the adapter's A and B")


@pytest.mark.parametrize("command", [["mcore2hf", "CKPT", "OUT", "--hf-config", ""], ["inspect", "CKPT", "--hf-config", ""],
                                     ["export-lora", "CKPT", "OUT", "--alpha", "8", "--base-model", ""],
                                     ["hf2mcore", str(TINY), "OUT", "--revision", ""]],
                         ids=["mcore2hf --hf-config", "inspect --hf-config", "export-lora --base-model", "--revision"])
def test_an_empty_option_value_is_a_usage_error_not_the_option_left_out(tmp_path, command):
    """--hf-config "", --base-model "" or --revision "" (unset shell variables) were taken as not
    given, and --base-model "" was recorded in adapter_config.json (second new-user pass)."""
    parts = {"CKPT": str(tmp_path / "ckpt"), "OUT": str(tmp_path / "out")}
    result = mconv(*[parts.get(part, part) for part in command])
    assert result.exit_code == 2 and "is empty: give a value, or leave the option out" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
