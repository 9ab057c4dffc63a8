"""Hub model names, offline: a hub cache laid out as huggingface_hub leaves it (blobs named by
their git or LFS hash, snapshots/COMMIT/* relative symlinks to them, refs/BRANCH holding the
commit) in a temporary HF_HOME with HF_HUB_OFFLINE=1.

Oracles: huggingface_hub's own cache scanner accepts the cache, and transformers'
`from_pretrained` of the same name (offline) finds the same model; every command given the hub
name writes byte-for-byte what it writes given the directory."""
import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mconv.cli import main
from tests.conftest import FIXTURES, ROOT

REPO = "tiny-org/qwen3-tiny"
MAIN, TIED = "a" * 40, "b" * 40  # commit hashes of two revisions


def add_snapshot(hub: Path, repo_id: str, source: Path, commit: str, ref: str | None = None) -> Path:
    """Put `source`'s files into the cache as one commit of `repo_id`, as snapshot_download does."""
    storage = hub / ("models--" + repo_id.replace("/", "--"))
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        # LFS files (the weights) are stored under their sha256, plain git files under their git blob sha1.
        etag = (hashlib.sha256(data).hexdigest() if file.suffix == ".safetensors" else
                hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (storage / "blobs" / etag).write_bytes(data)
        (snapshot / file.name).symlink_to(f"../../blobs/{etag}")
    if ref:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it verbatim
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fresh HF_HOME with REPO at MAIN (refs/main, qwen3-tiny) and at TIED (tag v-tied,
    qwen3-tiny-tied), offline. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported,
    so its constants are set to what those variables give."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    add_snapshot(cache, REPO, FIXTURES / "qwen3-tiny", MAIN, "main")
    add_snapshot(cache, REPO, FIXTURES / "qwen3-tiny-tied", TIED, "v-tied")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def same_tree(a: Path, b: Path) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, mismatch


def test_cache_is_what_huggingface_hub_and_transformers_read(hub):
    from huggingface_hub import scan_cache_dir
    from transformers import AutoConfig

    info = scan_cache_dir(hub)
    assert not info.warnings
    [repo] = info.repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {MAIN, TIED}
    assert not AutoConfig.from_pretrained(REPO).tie_word_embeddings
    assert AutoConfig.from_pretrained(REPO, revision="v-tied").tie_word_embeddings


def test_every_command_takes_a_hub_name(hub, tmp_path):
    # hf2mcore: the same checkpoint as from the directory (metadata aside: it records no path).
    assert mconv("hf2mcore", REPO, tmp_path / "hub", "--format", "torch", "--tp", "2", "-q").exit_code == 0
    assert mconv("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "dir", "--format", "torch", "--tp", "2",
                 "-q").exit_code == 0
    same_tree(tmp_path / "hub", tmp_path / "dir")
    # --revision picks the tagged snapshot (the tied model) and by commit hash too.
    for revision in ("v-tied", TIED):
        out = tmp_path / f"tied-{revision[:6]}"
        assert mconv("hf2mcore", REPO, out, "--revision", revision, "--format", "torch", "-q").exit_code == 0
        assert json.loads((out / "hf_config" / "config.json").read_text())["tie_word_embeddings"]

    # mcore2hf --hf-config NAME, for a checkpoint that stores no config.
    import shutil
    shutil.rmtree(tmp_path / "dir" / "hf_config")
    (tmp_path / "dir" / "mconv.json").unlink()
    result = mconv("mcore2hf", tmp_path / "dir", tmp_path / "back", "--hf-config", REPO, "-q")
    assert result.exit_code == 0, result.output
    assert mconv("verify", tmp_path / "back", REPO, "-q").exit_code == 0  # verify takes names too
    assert mconv("verify", tmp_path / "back", FIXTURES / "qwen3-tiny", "-q").exit_code == 0
    # verify --revision: applies to the hub name (the tied snapshot differs from the untied model)
    assert mconv("verify", tmp_path / "back", REPO, "--revision", "v-tied", "-q").exit_code == 1
    assert mconv("verify", REPO, REPO, "--revision", TIED, "-q").exit_code == 0
    result = mconv("verify", tmp_path / "back", FIXTURES / "qwen3-tiny", "--revision", "v-tied")
    assert result.exit_code == 2 and (f"{tmp_path / 'back'} and {FIXTURES / 'qwen3-tiny'} are local directories; a "
                                      "revision applies only to hub model names") in result.stderr, result.output
    # inspect NAME and inspect CKPT --hf-config NAME
    result = mconv("inspect", REPO, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["model"]["name"] == "Qwen3ForCausalLM"
    result = mconv("inspect", tmp_path / "dir", "--hf-config", REPO, "--json")
    assert json.loads(result.output)["model"]["name"] == "Qwen3ForCausalLM", result.output


def test_export_lora_merges_into_a_hub_model(hub, tmp_path):
    from mconv import Layout
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path, FIXTURES / "qwen3-tiny", Layout(tp=2))
    by_name, by_dir = tmp_path / "by-name", tmp_path / "by-dir"
    assert mconv("export-lora", lora, by_name, "--alpha", 8, "--merge", "--base-model", REPO, "-q").exit_code == 0
    assert mconv("export-lora", lora, by_dir, "--alpha", 8, "--merge", "--base-model", FIXTURES / "qwen3-tiny",
                 "-q").exit_code == 0
    same_tree(by_name, by_dir)
    adapter = tmp_path / "adapter"
    assert mconv("export-lora", lora, adapter, "--alpha", 8, "--base-model", REPO, "--hf-config", REPO,
                 "-q").exit_code == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO


def test_a_local_directory_wins(hub, tmp_path, monkeypatch):
    import shutil
    monkeypatch.chdir(tmp_path)
    shutil.copytree(FIXTURES / "qwen3-tiny-tied", tmp_path / REPO)  # ./tiny-org/qwen3-tiny, the tied model
    info = json.loads(mconv("inspect", REPO, "--json").output)
    assert info["model"]["tied_embeddings"] is True  # the hub's main revision is untied


def test_a_missing_model_names_the_cache(hub, tmp_path):
    out = tmp_path / "out"
    for args in (("hf2mcore", "tiny-org/absent", out), ("hf2mcore", REPO, out, "--revision", "v9"),
                 ("inspect", "tiny-org/absent"), ("verify", "tiny-org/absent", FIXTURES / "qwen3-tiny")):
        result = mconv(*args)
        assert result.exit_code == (2 if args[0] == "verify" else 1)  # (verify's 1: the models differ)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("mconv: error: ") and str(hub) in line and "HF_HUB_OFFLINE" in line, line
        assert not out.exists()
    # a path (./, ../, /, ~ or more than one /) cannot be a hub name: every command that resolves models says so
    tiny = FIXTURES / "qwen3-tiny"
    for path, args in [("./not/a/dir", ("hf2mcore", "./not/a/dir", out)), ("../absent", ("inspect", "../absent")),
                       ("./no-such-dir", ("verify", "./no-such-dir", tiny)), ("~/absent", ("verify", tiny, "~/absent")),
                       ("a/b/c", ("inspect", "a/b/c")), ("--hf-config /absent", ("mcore2hf", tiny, out, "--hf-config", "/absent"))]:
        result = mconv(*args)
        assert result.exit_code == (2 if args[0] == "verify" else 1)
        assert result.stderr == f"mconv: error: {path} does not exist\n", result.stderr


def test_environment_variables_as_users_set_them(tmp_path):
    """No patching: HF_HOME and HF_HUB_OFFLINE set before the process starts, as a user would."""
    home = tmp_path / "hf-home"
    add_snapshot(home / "hub", REPO, FIXTURES / "qwen3-tiny", MAIN, "main")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "mconv.cli", "inspect", REPO, "--json"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["size"]["tensors"] == 47
    done = subprocess.run([sys.executable, "-m", "mconv.cli", "inspect", "tiny-org/absent"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1 and str(home / "hub") in done.stderr and len(done.stderr.splitlines()) == 1


def test_remote_code_is_fetched_when_auto_map_names_it(hub, tmp_path, monkeypatch):
    """A hub model with remote code: what the allow patterns mconv gives snapshot_download select
    (huggingface_hub's own filter_repo_objects over the repository's files) includes the modules
    auto_map names and what they import, and nothing else of the code; mcore2hf --hf-config NAME
    then carries it into the output."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from mconv.converter.hub import resolve_model
    from tests.test_remote_code import CODE, with_remote_code

    snapshot = add_snapshot(hub, "tiny-org/bailing", with_remote_code(tmp_path), "c" * 40, "main")
    patterns, real = [], huggingface_hub.snapshot_download

    def recording(*args, allow_patterns=None, **kwargs):
        patterns.append(allow_patterns)
        return real(*args, allow_patterns=allow_patterns, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    files = [p.name for p in snapshot.iterdir()]
    for weights in (False, True):
        patterns.clear()
        assert resolve_model("tiny-org/bailing", weights=weights, progress=False) == snapshot
        fetched = {name for allow in patterns for name in filter_repo_objects(files, allow_patterns=allow)}
        assert {name for name in fetched if name.endswith(".py")} == set(CODE)
        assert ("model.safetensors" in fetched) == weights
    ckpt = tmp_path / "ckpt"
    assert mconv("hf2mcore", snapshot, ckpt, "-q").exit_code == 0
    shutil.rmtree(ckpt / "hf_config")
    (ckpt / "mconv.json").unlink()
    result = mconv("mcore2hf", ckpt, tmp_path / "back", "--hf-config", "tiny-org/bailing", "-q")
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "back").glob("*.py")} == set(CODE)
