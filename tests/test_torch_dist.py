"""torch_dist: written by mconv and loaded by megatron-core at another layout; written by
megatron-core and read by mconv; bit-exact round trips."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.make_fixtures import make_qwen3, make_qwen3_moe
from mconv import Layout, hf2mcore, mcore2hf
from tests.conftest import FIXTURES, ROOT
from tests.megatron_oracle import MegatronRun, hf_logits, megatron_logits, read_config
from tests.test_roundtrip import assert_bit_identical, read_all

TOKENS = list(range(5, 70, 5))


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes", [
    ("qwen3-tiny", dict(tp=2, pp=2)),
    ("qwen3-tiny-tied", dict(tp=2, pp=2)),
    ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1)),
    ("qwen3-moe-tiny", dict(pp=2, vpp=2, ep=2)),  # (EP4 here made 8 gloo ranks on 2 cores: 171 s)
])
def test_megatron_core_loads_mconv_torch_dist_at_another_layout(tmp_path, fixture, sizes):
    hf_dir = FIXTURES / fixture
    # mconv writes layout-independent global tensors; only the vocabulary padding follows --tp.
    summary = hf2mcore(hf_dir, tmp_path / "megatron", Layout(tp=sizes.get("tp", 1)), fmt="torch_dist", progress=False)
    run = MegatronRun(tmp_path / "megatron", read_config(hf_dir), **sizes, fmt="torch_dist",
                      padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
    ours = megatron_logits(run, tmp_path)
    assert (ours - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("fixture,sizes,padded", [
    ("qwen3-tiny", dict(tp=2), 512),
    ("qwen3-moe-tiny", dict(ep=2), 384),
    ("qwen3-tiny-tied", dict(pp=2), 384),
])
def test_mconv_reads_torch_dist_written_by_megatron_core(tmp_path, fixture, sizes, padded):
    hf_dir = FIXTURES / fixture
    iter_dir = tmp_path / "ckpt" / "iter_0000007"
    iter_dir.mkdir(parents=True)
    run = MegatronRun(tmp_path / "ckpt", read_config(hf_dir), **sizes, padded_vocab=padded, tokens=TOKENS,
                      save_to=iter_dir)
    theirs = megatron_logits(run, tmp_path)
    mcore2hf(iter_dir, tmp_path / "hf", hf_config=hf_dir, progress=False)
    ours = hf_logits(tmp_path / "hf", TOKENS)
    assert theirs.abs().max() > 1e-3  # random weights give non-trivial logits
    assert (ours - theirs).abs().max().item() < 1e-4


@st.composite
def model_case(draw):
    moe = draw(st.booleans())
    common = dict(num_hidden_layers=draw(st.integers(1, 3)), hidden_size=32, head_dim=8,
                  vocab_size=draw(st.integers(30, 300)), tie_word_embeddings=draw(st.booleans()),
                  dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])))
    if moe:
        common.update(num_experts=draw(st.sampled_from([2, 4])), moe_intermediate_size=16, intermediate_size=16,
                      mlp_only_layers=[0] if draw(st.booleans()) else [])
    return moe, common, draw(st.sampled_from([1, 2]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=model_case(), seed=st.integers(0, 1000))
def test_torch_dist_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    moe, model, tp = case
    tmp = tmp_path_factory.mktemp("dist")
    make = make_qwen3_moe if moe else make_qwen3
    hf = make(tmp / "hf", seed=seed, tokenizer=False, **model)
    hf2mcore(hf, tmp / "megatron", Layout(tp=tp), fmt="torch_dist", progress=False)
    with pytest.MonkeyPatch.context() as patch:  # load one tensor group at a time, as a large model would
        patch.setattr("mconv.converter.mcore2hf.LOAD_BATCH_BYTES", 1)
        mcore2hf(tmp / "megatron", tmp / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp / "back"))


def test_torch_dist_is_the_default_and_te_is_refused(tmp_path):
    from tests.test_errors import assert_refused, mconv

    assert mconv("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "m", "-q").exit_code == 0
    assert (tmp_path / "m" / "release" / "metadata.json").is_file()
    assert_refused(mconv("hf2mcore", FIXTURES / "qwen3-tiny", tmp_path / "te", "--spec", "te"), tmp_path / "te",
                   "--format torch_dist", "--spec local")


@pytest.mark.slow
def test_torch_dist_written_by_threads_and_torchrun_ranks(tmp_path):
    """Several writers (threads with --workers, ranks under torchrun) each write their own .distcp
    file and one .metadata: megatron-core loads it at another layout (logits equal transformers'),
    and it reads back to the same HF bytes as a one-process checkpoint."""
    from tests.test_parallel import torchrun

    hf_dir = FIXTURES / "qwen3-moe-tiny"
    summary = hf2mcore(hf_dir, tmp_path / "one", Layout(tp=2), progress=False)
    hf2mcore(hf_dir, tmp_path / "threads", Layout(tp=2), progress=False, workers=3)
    torchrun("hf2mcore", hf_dir, tmp_path / "ranks", "--tp", "2")
    expected = None
    for name, files in (("one", 1), ("threads", 3), ("ranks", 2)):
        assert len(list((tmp_path / name / "release").glob("*.distcp"))) == files
        mcore2hf(tmp_path / name, tmp_path / f"hf-{name}", progress=False)
        tensors = read_all(tmp_path / f"hf-{name}")
        expected = expected or tensors
        assert_bit_identical(expected, tensors)
    for name, sizes in (("threads", dict(tp=2, ep=2, etp=1)), ("ranks", dict(pp=2, ep=4))):
        run = MegatronRun(tmp_path / name, read_config(hf_dir), **sizes, fmt="torch_dist",
                          padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
        assert (megatron_logits(run, tmp_path) - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4


def test_metadata_is_parsed_once_per_process(tmp_path, monkeypatch):
    """Reading a torch_dist checkpoint in many batches, then inspecting it, opens and unpickles
    `.metadata` once in the process."""
    from mconv.converter import safe_load, torch_dist_io
    from mconv.converter.describe import inspect_path

    hf2mcore(FIXTURES / "qwen3-moe-tiny", tmp_path / "m", Layout(), progress=False)
    parsed = []
    real = safe_load.load_pickle
    monkeypatch.setattr(safe_load, "load_pickle", lambda path, *a: parsed.append(path.name) or real(path, *a))
    monkeypatch.setattr("mconv.converter.mcore2hf.LOAD_BATCH_BYTES", 1)  # one tensor group per batch
    before = torch_dist_io.metadata_reads
    mcore2hf(tmp_path / "m", tmp_path / "hf", progress=False)
    assert parsed == [".metadata"] and torch_dist_io.metadata_reads == before + 1
    inspect_path(tmp_path / "m")
    assert parsed == [".metadata"]


@pytest.mark.slow
def test_mconv_reads_all_moe_torch_dist_with_per_layer_keys(tmp_path):
    """Issue 10.1, reading: megatron-core gives an all-MoE model configured with `moe_layer_freq` as a
    list (as the oracle's config does: [1, 1, 1, 1]) per-layer keys, not the stacked ones of the int 1;
    mconv reads such a checkpoint megatron-core saved (logits of our HF output equal megatron-core's)."""
    from mconv.converter.torch_dist_io import TorchDistReader

    hf_dir = make_qwen3_moe(tmp_path / "hf", mlp_only_layers=[], tokenizer=False)
    iter_dir = tmp_path / "theirs" / "iter_0000003"
    iter_dir.mkdir(parents=True)
    run = MegatronRun(tmp_path / "theirs", read_config(hf_dir), ep=2, padded_vocab=384, tokens=TOKENS,
                      save_to=iter_dir)
    theirs = megatron_logits(run, tmp_path)
    assert any(key.startswith("decoder.layers.0.") for key in TorchDistReader(iter_dir).tensors)
    mcore2hf(iter_dir, tmp_path / "back", hf_config=hf_dir, progress=False)
    assert (hf_logits(tmp_path / "back", TOKENS) - theirs).abs().max().item() < 1e-4


OLD_MEGATRON = Path(sys.prefix) / "mcore-0.14"  # scripts/install.sh: megatron-core 0.14.0 in its own target dir
OLDEST_PYTHON = ROOT / ".venv-oldest" / "bin" / "python"  # scripts/install-oldest.sh: Python 3.10, torch 2.6.0


def megatron_core_load(iter_dirs: list[Path], hf_dir: Path, megatron_path: Path | None,
                       tmp_path: Path) -> tuple[str, list[torch.Tensor]]:
    """(version, logits of each checkpoint) of the megatron-core at `megatron_path` (the main venv's
    if None) loading each of `iter_dirs` with its own `dist_checkpointing.load` (strict), one process."""
    from mconv.converter.torch_dist_io import TorchDistReader

    out = tmp_path / "logits.pt"
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("old_megatron_load.py")), str(hf_dir),
                             str(TorchDistReader(iter_dirs[0]).args.padded_vocab_size), str(out), *map(str, iter_dirs)],
                            env={**os.environ, "PYTHONPATH": str(megatron_path or "")},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(megatron_path or sys.prefix) in result.stdout
    vocab = read_config(hf_dir)["vocab_size"]
    return result.stdout.split()[0], [logits[..., :vocab] for logits in torch.load(out)]


def write_with_oldest_torch(hf_dir: Path, out: Path) -> None:
    """hf2mcore --format torch_dist run by .venv-oldest's Python (torch 2.6.0, no megatron-core)."""
    assert OLDEST_PYTHON.exists(), "no .venv-oldest: .ci/run runs scripts/install-oldest.sh before the tests"
    site = ROOT / ".venv-oldest" / "lib" / "python3.10" / "site-packages"
    assert next(importlib.metadata.distributions(name="torch", path=[str(site)])).version.startswith("2.6.0")
    assert not importlib.metadata.version("torch").startswith("2.6.")  # the loaders' torch is another
    result = subprocess.run([str(OLDEST_PYTHON), "-m", "mconv", "hf2mcore", str(hf_dir), str(out), "--format",
                             "torch_dist", "-q"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
# Skipped only outside CI: scripts/install.sh and scripts/install-oldest.sh (which .ci/run runs first)
# install them, so in CI their absence is a failure, not a skip.
@pytest.mark.skipif(not OLD_MEGATRON.is_dir() and not os.environ.get("CI"),
                    reason=f"no older megatron-core at {OLD_MEGATRON} (scripts/install.sh installs 0.14.0 there)")
def test_older_megatron_core_loads_mconv_torch_dist(tmp_path):
    """Issue 10.2: megatron-core 0.14.0 (the oldest release with a wheel for this Python; releases
    before 0.19 read the common state only from `common.pt`) loads what mconv writes with its own
    `dist_checkpointing.load` (strict), and its forward pass equals transformers'. Issue 25: so do
    0.14.0 and 0.19 for the checkpoint mconv writes under the oldest supported torch (2.6.0,
    `.venv-oldest`), both in one launch per megatron-core."""
    hf_dir = FIXTURES / "qwen3-moe-tiny"
    hf2mcore(hf_dir, tmp_path / "main", Layout(), progress=False)
    oldest = OLDEST_PYTHON.exists() or bool(os.environ.get("CI"))
    if oldest:
        write_with_oldest_torch(hf_dir, tmp_path / "oldest")
    expected = hf_logits(hf_dir, TOKENS)
    for version, megatron_path, writers in (("0.14.0", OLD_MEGATRON, ["main", "oldest"][:1 + oldest]),
                                            ("0.19.", None, ["oldest"][:oldest])):
        if writers:
            loaded, logits = megatron_core_load([tmp_path / name / "release" for name in writers], hf_dir,
                                                megatron_path, tmp_path)
            assert loaded.startswith(version) and len(logits) == len(writers)
            for name, each in zip(writers, logits):
                assert (each - expected).abs().max().item() < 1e-4, name
    if not oldest:
        pytest.skip(f"only the main writer checked: no oldest set-up at {OLDEST_PYTHON} (scripts/install-oldest.sh)")


@pytest.mark.slow
def test_all_moe_torch_dist_loads_in_a_model_built_from_its_stored_args(tmp_path):
    """Issue 10.1, writing: mconv's all-MoE torch_dist stores `moe_layer_freq=1`, so the model a
    Megatron-LM job builds from the stored args (its parse_args defaults + the stored args,
    validate_args, core_transformer_config_from_args) asks for the stacked keys the checkpoint holds:
    megatron-core's dist_checkpointing.load (strict) at TP2/EP2, logits equal transformers'."""
    from mconv.converter.torch_dist_io import TorchDistReader
    from tests.megatron_oracle import trainer_args

    hf_dir = make_qwen3_moe(tmp_path / "hf", mlp_only_layers=[], tokenizer=False)
    summary = hf2mcore(hf_dir, tmp_path / "m", Layout(tp=2), progress=False)
    stored = TorchDistReader(tmp_path / "m" / "release").args
    assert stored.moe_layer_freq == 1
    run = MegatronRun(tmp_path / "m", read_config(hf_dir), tp=2, ep=2, etp=1, fmt="torch_dist",
                      padded_vocab=summary.plan.padded_vocab, tokens=TOKENS)
    run.args = trainer_args(stored, run)
    assert (megatron_logits(run, tmp_path) - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4


def test_reading_metadata_and_inspect_import_neither_megatron_nor_dcp(tmp_path):
    """The reader's metadata, common state and `inspect` of a torch_dist checkpoint need neither
    megatron-core nor torch.distributed.checkpoint (seconds of imports each)."""
    hf2mcore(FIXTURES / "qwen3-moe-tiny", tmp_path / "m", Layout(), progress=False)
    code = ("import sys; from mconv.converter.describe import inspect_path; from mconv.converter.torch_dist_io "
            f"import TorchDistReader; inspect_path({str(tmp_path / 'm')!r}); "
            f"r = TorchDistReader({str(tmp_path / 'm' / 'release')!r}); r.read_box('embedding.word_embeddings.weight'); "
            "assert r.args.num_layers == 4; "
            "print(sorted(m for m in sys.modules if m.startswith(('megatron', 'torch.distributed.checkpoint'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
