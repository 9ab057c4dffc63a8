"""Parallel conversion: worker processes and torchrun ranks write the same bytes as one process;
a conversion killed at any moment leaves nothing at the final path and an existing output intact."""
import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mconv import Layout, hf2mcore, mcore2hf
from tests.conftest import FIXTURES, ROOT

MOE = FIXTURES / "qwen3-moe-tiny"


def assert_same_tree(a: Path, b: Path):
    comparison = filecmp.dircmp(a, b)
    assert not comparison.left_only and not comparison.right_only and not comparison.diff_files, comparison.report()
    for sub in comparison.common_dirs:
        assert_same_tree(a / sub, b / sub)


@pytest.mark.parametrize("fmt,model,layout", [("torch", MOE, Layout(tp=2, pp=2, ep=2)),
                                               ("torch_dist", MOE, Layout(tp=2, pp=2, ep=2)),
                                               ("torch", FIXTURES / "qwen3-5-tiny", Layout(tp=2, pp=2))],
                         ids=["torch", "torch_dist", "qwen3_5-torch"])
def test_workers_write_the_same_bytes(tmp_path, fmt, model, layout):
    hf2mcore(model, tmp_path / "one", layout, fmt=fmt, progress=False)
    hf2mcore(model, tmp_path / "three", layout, fmt=fmt, progress=False, workers=3)
    if fmt == "torch":  # torch_dist is written by one process either way
        assert_same_tree(tmp_path / "one", tmp_path / "three")
    mcore2hf(tmp_path / "one", tmp_path / "hf-one", max_shard_bytes=100_000, progress=False)
    mcore2hf(tmp_path / "one", tmp_path / "hf-three", max_shard_bytes=100_000, progress=False, workers=3)
    assert_same_tree(tmp_path / "hf-one", tmp_path / "hf-three")


def torchrun(*args):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29000 + os.getpid() % 1000), "-m", "mconv.cli", *map(str, args), "-q"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_torchrun_ranks_write_the_same_bytes(tmp_path):
    hf2mcore(MOE, tmp_path / "one", Layout(tp=2, ep=2), fmt="torch", progress=False)
    torchrun("hf2mcore", MOE, tmp_path / "two", "--tp", "2", "--ep", "2", "--format", "torch")
    assert_same_tree(tmp_path / "one", tmp_path / "two")
    mcore2hf(tmp_path / "one", tmp_path / "hf-one", max_shard_bytes=100_000, progress=False)
    torchrun("mcore2hf", tmp_path / "one", tmp_path / "hf-two", "--max-shard-size", "100KB")
    assert_same_tree(tmp_path / "hf-one", tmp_path / "hf-two")
    assert not [p for p in tmp_path.iterdir() if "mconv-partial" in p.name]


def kill_midway(args, staging_parent: Path):
    """Start `mconv ARGS`, SIGKILL it (and its workers) once it has written its first bytes into its
    staging directory (not after a fixed delay: on a fast, idle machine the whole conversion can
    end within one, and then nothing is killed midway)."""
    earlier = set(staging_parent.iterdir())  # (a killed run's staging, if left)
    process = subprocess.Popen([sys.executable, "-m", "mconv.cli", *map(str, args), "-q"], cwd=ROOT,
                               start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not _written(staging_parent, earlier):
        assert process.poll() is None and time.monotonic() < deadline, "finished before it could be killed"
        time.sleep(0.005)
    assert process.poll() is None, "finished before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _written(staging_parent: Path, earlier: set) -> bool:
    """Whether a file in a new staging directory under `staging_parent` (not in `earlier`) holds bytes."""
    for staging in (p for p in staging_parent.iterdir() if "mconv-partial" in p.name and p not in earlier):
        try:
            if any(f.is_file() and f.stat().st_size for f in staging.rglob("*")):
                return True
        except FileNotFoundError:
            pass  # renamed or removed meanwhile
    return False


@pytest.mark.slow
@pytest.mark.parametrize("command", ["hf2mcore", "mcore2hf"])
def test_sigkill_leaves_no_output_and_rerun_succeeds(tmp_path, command):
    from transformers import Qwen3Config

    from fixtures.make_fixtures import make_synthetic

    big = make_synthetic(tmp_path / "big", Qwen3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]))
    if command == "hf2mcore":
        args = ["hf2mcore", big, tmp_path / "out", "--format", "torch", "--tp", "2", "--workers", "2"]
    else:
        hf2mcore(big, tmp_path / "ckpt", Layout(tp=2), progress=False)
        args = ["mcore2hf", tmp_path / "ckpt", tmp_path / "out", "--max-shard-size", "50MB", "--workers", "2"]
    kill_midway(args, tmp_path)
    assert not (tmp_path / "out").exists()
    subprocess.run([sys.executable, "-m", "mconv.cli", *map(str, args), "-q"], cwd=ROOT, check=True)
    assert (tmp_path / "out").is_dir()

    # Killed while replacing it with --overwrite: the existing output is untouched.
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*")}
    kill_midway(args + ["--overwrite"], tmp_path)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*")} == before


def torchrun_output(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29000 + os.getpid() % 1000 + 250), "-m", "mconv.cli", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_rank_0_speaks_for_a_torchrun_job(tmp_path):
    """One `wrote` line for the job (not one per rank, rank 1's saying `0 safetensors shards`), and
    an error every rank meets (the output exists) printed once."""
    result = torchrun_output("hf2mcore", MOE, tmp_path / "ckpt", "--tp", "2", "--format", "torch")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("wrote")] == [
        line for line in result.stdout.splitlines() if line.startswith(f"wrote {tmp_path / 'ckpt'} (torch): ")]
    assert result.stdout.count("wrote ") == 1
    result = torchrun_output("mcore2hf", tmp_path / "ckpt", tmp_path / "back", "--max-shard-size", "100KB")
    assert result.returncode == 0 and result.stdout.count("wrote ") == 1 and " 0 safetensors" not in result.stdout
    result = torchrun_output("mcore2hf", tmp_path / "ckpt", tmp_path / "back")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("mconv: error: ")]
    assert errors == [f"mconv: error: {tmp_path / 'back'} already exists; pass --overwrite to replace it"], result.stderr


def test_only_what_rank_0_does_not_say_is_said_again(monkeypatch):
    """Another rank prints its error only if rank 0 posted a different one (through the job's store)."""
    import datetime

    import torch.distributed as dist

    from mconv.converter import parallel

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setattr(parallel, "SAME_ERROR_WAIT_SECONDS", 0.5)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "1")
    assert parallel.speaks_for_itself("mconv: error: rank 1 alone")  # rank 0 said nothing
    monkeypatch.setenv("RANK", "0")
    assert parallel.speaks_for_itself("mconv: error: the same for all")
    monkeypatch.setenv("RANK", "1")
    assert not parallel.speaks_for_itself("mconv: error: the same for all")
    assert parallel.speaks_for_itself("mconv: error: something of its own")
    monkeypatch.delenv("RANK")
    assert parallel.speaks_for_itself("mconv: error: not under torchrun")


def test_a_library_call_on_one_rank_of_a_torchrun_job_converts_alone(tmp_path, monkeypatch):
    """A trainer's rank 0 of a torchrun job calls hf2mcore and mcore2hf, its other ranks do not (the
    new-user pass: the calls waited forever, through torchrun's store, for ranks that never came):
    they convert in this process alone; only the command line (`torchrun -m mconv.cli`, above)
    shares the work between the ranks."""
    import datetime

    import torch.distributed as dist

    from mconv.converter.pipelines import compare_hf

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))  # the job's
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2",
                       "RANK": "0", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(key, value)
    hf2mcore(MOE, tmp_path / "ckpt", Layout(tp=2, ep=2), progress=False)
    mcore2hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    assert compare_hf(MOE, tmp_path / "back")[2] == []
