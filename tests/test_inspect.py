"""`mconv inspect`: readable text with no Python reprs, JSON for scripts, checkpoints mconv did
not write (with and without --hf-config). Oracles: torch's distributed-checkpoint metadata
reader (stored tensor count, dtypes, bytes), the rank files as torch loads them, hf2mcore's own
report (the same tensor count) and Megatron-LM's argument parser (the trainer flags parse back
to the saved args)."""
import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from mconv.cli import main
from mconv.converter.describe import LAYOUT_FLAGS, MODEL_FLAGS, saved_value
from tests.conftest import FIXTURES, load_rank_file

MOE = FIXTURES / "qwen3-moe-tiny"


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A torch_dist and a legacy (TP2 EP2) MoE checkpoint, with hf2mcore's reports."""
    tmp = tmp_path_factory.mktemp("inspect")
    reports = {}
    for fmt, extra in (("torch_dist", []), ("torch", ["--tp", "2", "--ep", "2"])):
        result = mconv("hf2mcore", MOE, tmp / fmt, "--format", fmt, "--json", *extra)
        assert result.exit_code == 0, result.output
        reports[fmt] = json.loads(result.output.strip().splitlines()[-1])
    return tmp, reports


def foreign(tmp_path, source):
    """The same checkpoint as another tool leaves it: no mconv metadata, no stored HF config."""
    copy = tmp_path / "foreign"
    shutil.copytree(source, copy)
    shutil.rmtree(copy / "hf_config")
    (copy / "mconv.json").unlink()
    return copy


def assert_readable(text: str):
    for repr_marker in ("frozenset", "Namespace(", "torch.", "None", "{", "[(", "<"):
        assert repr_marker not in text, (repr_marker, text)


def test_text_is_grouped_and_has_no_reprs(checkpoints):
    tmp, _ = checkpoints
    for path in (tmp / "torch_dist", tmp / "torch", MOE):
        result = mconv("inspect", path)
        assert result.exit_code == 0, result.output
        assert_readable(result.output)
        labels = [line.split()[0] for line in result.output.splitlines()[1:]]
        assert labels[:2] == ["model", "experts"] and "dtypes" in labels and "size" in labels and "trainer" in labels
    assert "MoE layers 0, 2, 3" in mconv("inspect", tmp / "torch").output
    assert "TP2 PP1 EP2 ETP1" in mconv("inspect", tmp / "torch").output


def test_torch_dist_counts(checkpoints, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tmp, reports = checkpoints
    stored = {k: md for k, md in FileSystemReader(str(tmp / "torch_dist" / "release")).read_metadata()
              .state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    nbytes = sum(md.properties.dtype.itemsize * torch.Size(md.size).numel() for md in stored.values())
    for path, args in ((tmp / "torch_dist", []), (foreign(tmp_path, tmp / "torch_dist"), ["--hf-config", MOE])):
        info = json.loads(mconv("inspect", path, "--json", *args).output)
        assert info["size"]["tensors"] == reports["torch_dist"]["tensors"]  # as hf2mcore counted them
        assert info["size"]["stored_tensors"] == len(stored)
        assert info["size"]["bytes"] == nbytes == reports["torch_dist"]["bytes"]
        assert info["dtypes"] == {"bfloat16": {"tensors": len(stored), "bytes": nbytes}}
        assert info["model"]["name"] == "Qwen3MoeForCausalLM" and info["model"]["moe_layers"] == [0, 2, 3]


def test_a_checkpoint_mconv_did_not_write(checkpoints, tmp_path):
    tmp, reports = checkpoints
    for fmt in ("torch_dist", "torch"):
        path = foreign(tmp_path / fmt, tmp / fmt)
        result = mconv("inspect", path)
        assert result.exit_code == 0, result.output
        assert_readable(result.output)
        assert "another tool" in result.output and "--hf-config" in result.output
        info = json.loads(mconv("inspect", path, "--json").output)
        assert info["checkpoint"]["format"] == fmt and info["checkpoint"]["iteration"] == "release"
        assert info["model"]["layers"] == 4 and info["model"]["experts"] == 8  # from the saved args
        if fmt == "torch":
            # The rank files as torch loads them: every tensor, its dtype and bytes.
            tensors = [t for f in sorted((path / "release").glob("mp_rank_*/model_optim_rng.pt"))
                       for t in load_rank_file(f)["model"].values() if isinstance(t, torch.Tensor)]
            assert info["size"]["tensors"] == len(tensors) == reports["torch"]["tensors"]
            assert info["size"]["bytes"] == sum(t.nbytes for t in tensors)
            assert info["layout"]["text"] == "TP2 PP1 EP2 ETP1"
        with_config = json.loads(mconv("inspect", path, "--json", "--hf-config", MOE).output)
        assert with_config["model"]["name"] == "Qwen3MoeForCausalLM" and "note" not in with_config
    # A wrong --hf-config is refused by name, as mcore2hf refuses it.
    result = mconv("inspect", foreign(tmp_path / "wrong", tmp / "torch"), "--hf-config", FIXTURES / "qwen3-tiny")
    assert result.exit_code == 1 and result.stderr.startswith("mconv: error: ")


def test_trainer_flags_parse_back_with_megatron_lm(checkpoints, tmp_path):
    """Megatron-LM's own parser reads the printed flags (the JSON argv, and the text line as a
    shell splits it) into the saved args' values: the MoE TP2 EP2 checkpoint, and a dense one with
    uneven pipeline stages, which must print them and no MoE-only flags."""
    import argparse
    import shlex
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.training.arguments import add_megatron_arguments

    from mconv.converter import megatron_io as mio

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    tmp, _ = checkpoints
    uneven = tmp_path / "uneven"
    result = mconv("hf2mcore", FIXTURES / "qwen3-tiny", uneven, "--format", "torch", "--pp", 3,
                   "--first-stage-layers", 1, "--last-stage-layers", 1, "--spec", "te", "-q")
    assert result.exit_code == 0, result.output
    for path, min_checked in ((tmp / "torch", 25), (uneven, 15)):
        args = vars(mio.load_rank_file(sorted((path / "release").glob("mp_rank_*"))[0] / "model_optim_rng.pt")["args"])
        dense = not args.get("num_experts")
        info = json.loads(mconv("inspect", path, "--json").output)
        text = mconv("inspect", path).output
        line = next(line.split(None, 1)[1] for line in text.splitlines() if line.split()[:1] == ["trainer"])
        assert shlex.split(line) == info["trainer_flags"], line  # pastes into a shell as the same argv
        parsed, unknown = parser.parse_known_args(info["trainer_flags"])
        assert not unknown
        checked = 0
        for dests, flag in MODEL_FLAGS + LAYOUT_FLAGS:
            saved = saved_value(args, dests)
            if saved is None:
                continue
            if dense and (flag.startswith("--moe-") or flag.startswith("--expert-")):
                assert flag not in info["trainer_flags"], (path, flag)  # MoE-only: not for a dense model
                continue
            parsed_value = getattr(parsed, parser._option_string_actions[flag].dest)
            if flag == "--expert-tensor-parallel-size" and parsed_value is None:
                parsed_value = parsed.tensor_model_parallel_size  # Megatron-LM's validate_args default
            assert parsed_value == saved, (path, flag, parsed_value, saved)
            checked += 1
        assert checked > min_checked, (path, checked)
        if dense:
            assert not [f for f in info["trainer_flags"] if f.startswith(("--moe", "--expert", "--num-experts"))]
            assert (parsed.pipeline_model_parallel_size, parsed.decoder_first_pipeline_num_layers,
                    parsed.decoder_last_pipeline_num_layers) == (3, 1, 1)
            assert "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1" in line
        else:
            assert re.search(r"--moe-layer-freq \[1,0,1,1\]", " ".join(info["trainer_flags"]))
            assert "--moe-layer-freq '[1,0,1,1]'" in line


def test_vpp_flags():
    """Virtual pipeline stages as Megatron-LM names them: the saved per-rank stage count (or the
    derived virtual_pipeline_model_parallel_size older args hold), or the saved layers per stage,
    never both (Megatron-LM refuses both)."""
    from mconv.converter.describe import trainer_flags

    base = {"num_layers": 8, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
    assert trainer_flags({**base, "num_virtual_stages_per_pipeline_rank": 2})[-2:] == [
        "--num-virtual-stages-per-pipeline-rank", "2"]
    assert trainer_flags({**base, "virtual_pipeline_model_parallel_size": 2})[-2:] == [
        "--num-virtual-stages-per-pipeline-rank", "2"]
    flags = trainer_flags({**base, "num_layers_per_virtual_pipeline_stage": 2, "virtual_pipeline_model_parallel_size": 2})
    assert flags[-2:] == ["--num-layers-per-virtual-pipeline-stage", "2"]
    assert "--num-virtual-stages-per-pipeline-rank" not in flags


def test_settings_beyond_the_flags_are_shown():
    """Qwen3-VL's vision tower and mrope sections have no place in the flags: shown as read from
    its config.json."""
    config = json.loads((FIXTURES / "qwen3-vl-tiny" / "config.json").read_text())
    result = mconv("inspect", FIXTURES / "qwen3-vl-tiny")
    assert result.exit_code == 0 and "model settings beyond these flags" in result.output
    assert_readable(result.output)
    other = json.loads(mconv("inspect", FIXTURES / "qwen3-vl-tiny", "--json").output)["other_settings"]
    assert other["vision_layers"] == config["vision_config"]["depth"]
    assert other["mrope_section"] == config["text_config"]["rope_parameters"]["mrope_section"]


def test_fp8_checkpoint_headers_are_read_once(checkpoints, tmp_path, monkeypatch):
    """inspect of a sharded FP8 checkpoint opens each safetensors file's header once (safetensors'
    safe_open, which validates it before mconv reads its offsets), its FP8 checks included."""
    import safetensors

    from mconv import mcore2hf
    from mconv.converter.describe import inspect_path

    tmp, _ = checkpoints
    mcore2hf(tmp / "torch_dist", tmp_path / "fp8", quantize="fp8", max_shard_bytes=200_000, progress=False)
    opened, real = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, *a, **k: opened.append(path) or real(path, *a, **k))
    report = inspect_path(tmp_path / "fp8")
    assert "is block-wise FP8" in report["note"]
    files = sorted(str(p) for p in (tmp_path / "fp8").glob("*.safetensors"))
    assert len(files) > 1 and sorted(opened) == files


def test_an_hf_model_whose_tensors_disagree_with_its_config_is_refused_as_hf2mcore_refuses_it(tmp_path):
    """inspect holds an HF model's tensors to its config.json as hf2mcore does (new-user pass: an
    expert ffn of 31 with tensors of 32 rows was described, exit 0, and hf2mcore then refused it)."""
    hf = shutil.copytree(MOE, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": config["moe_intermediate_size"] - 1}))
    results = [CliRunner().invoke(main, [command, str(hf), *args]) for command, args in
               (("inspect", ()), ("hf2mcore", (str(tmp_path / "out"), "-q")))]
    lines = {result.stderr for result in results}
    assert all(result.exit_code == 1 for result in results) and len(lines) == 1, [r.output for r in results]
    assert "but config.json implies" in lines.pop()
