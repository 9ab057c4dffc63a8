"""BailingMoeV3 multi-token prediction (`hf2mcore --mtp`): HF `model.layers.{L+j}` (enorm, hnorm,
eh_proj, an MLA + MoE layer, final_layernorm) in megatron-core's MTP block (`mtp.layers.{j}.`).

Oracle: megatron-core 0.19.2's own `GPTModel` with `mtp_block_spec` (`get_gpt_mtp_block_spec`, local
spec, the MTP inner layer built from the last decoder layer's spec with the CPU core attention and
AReaL's head-wise gate of test_bailing_oracle.py), loading the rank files hf2mcore wrote with
`strict=True` in gloo processes, against transformers' DeepSeek-V3 modules loaded with the HF tensors
and chained as megatron-core's MTP block chains its depths (HFReference). Each depth's logits through
the output layer must agree (fp32); a wrong mapping (enorm and hnorm swapped, eh_proj's two input
halves swapped, eh_proj split on the wrong dimension) must fail the same comparison. In torch_dist,
megatron-core's `dist_checkpointing.load` fills its TP2 model from the TP1 checkpoint.
"""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter.transforms import ROW
from mconv.mappings import bailing_v3
from tests.conftest import FIXTURES, ROOT, load_rank_file
from tests.megatron_oracle import _cpu_shims, _free_port, read_config
from tests.ranks import start_ranks
from tests.test_bailing_oracle import HFReference, TOKENS, _core_config, _max_difference, bailing_model, megatron_run
from tests.test_roundtrip import assert_bit_identical, read_all


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    # Two MTP depths (the second chains on the first), MoE in the last decoder layer as in the MTP layers.
    return make_bailing_v3(tmp_path_factory.mktemp("bailing-mtp") / "hf", seed=11, dtype=torch.float32,
                           tokenizer=False, num_nextn_predict_layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_megatron_core_mtp_matches_transformers_modules(tmp_path, mtp_model, tp, ep):
    assert _max_difference(tmp_path, mtp_model, tp, ep) < 1e-5


def _swap_eh_halves(model):
    # A converter that concatenates (hidden, embedding) instead of megatron-core's (embedding, hidden).
    for name, tensor in model.items():
        if name.endswith("eh_proj.weight"):
            tensor.copy_(torch.cat(tensor.chunk(2, dim=1)[::-1], dim=1))


def _swap_norms(rule):
    names = {"enorm": "hnorm", "hnorm": "enorm"}
    kind = rule.megatron.split(".")[-2]
    return {"hf": {name.replace(kind, names[kind]): shape for name, shape in rule.hf.items()}}


WRONG = {
    "enorm and hnorm swapped": (1, lambda r: r.megatron.split(".")[-2:] in (["enorm", "weight"], ["hnorm", "weight"]),
                                _swap_norms),
    "eh_proj split on dim 1": (2, lambda r: r.megatron.endswith("eh_proj.weight"), lambda r: {"kind": ROW}),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_mtp_mapping_fails_the_oracle(tmp_path, mtp_model, monkeypatch, wrong):
    from mconv import mappings

    tp, match, change = WRONG[wrong]
    arch = bailing_v3.BAILING_V3
    assert sum(map(match, arch.rules)) >= 1
    rules = tuple(dataclasses.replace(r, **change(r)) if match(r) else r for r in arch.rules)
    monkeypatch.setitem(mappings.ARCHITECTURES, arch.name, dataclasses.replace(arch, rules=rules))
    try:
        difference = _max_difference(tmp_path, mtp_model, tp, 1)
    except mp.ProcessRaisedException as e:  # megatron-core's strict load refuses the shapes
        assert "size mismatch" in str(e)
        return
    assert difference > 1e-3, difference


@pytest.mark.slow
def test_swapped_eh_proj_halves_fail_the_oracle(tmp_path, mtp_model):
    assert _max_difference(tmp_path, mtp_model, 1, 1, _swap_eh_halves) > 1e-3


@pytest.mark.slow
def test_live_load_and_export_with_mtp(tmp_path, mtp_model):
    """mconv.live on a model with megatron-core's MTP block (TP2): load_hf_weights fills it (the MTP
    logits match the HF reference) and iter_hf_weights yields every HF tensor, MTP layers included,
    bit-identically."""
    hf2mcore(mtp_model, tmp_path / "m", Layout(tp=2), fmt="torch", progress=False, mtp=True)  # only its args are used
    logits, (exported, _) = megatron_run(tmp_path / "m", mtp_model, 2, 1, tmp_path, live=True)
    reference = HFReference(mtp_model)(TOKENS)
    assert logits.shape[0] == 3 and ((logits - reference).abs().max() / reference.abs().max()).item() < 1e-5
    assert_bit_identical(read_all(mtp_model), exported)


def _pipeline_worker(rank: int, checkpoint, c: dict, pp: int, vpp: int, port: int):
    import warnings

    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.checkpointing import get_checkpoint_name

    ps.initialize_model_parallel(1, pp, vpp if vpp > 1 else None)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    path = get_checkpoint_name(str(checkpoint), 0, True, pipeline_parallel=True, tensor_rank=0, pipeline_rank=rank)
    state = load_rank_file(path, map_location="cpu")
    config = _core_config(state["args"], 1, 1, pp, vpp)
    for v in range(vpp):
        chunk = state[f"model{v}" if vpp > 1 else "model"]
        model = bailing_model(config, c, state["args"].padded_vocab_size, v if vpp > 1 else None)
        model.load_state_dict(chunk, strict=True)
        last = rank == pp - 1 and v == vpp - 1
        assert hasattr(model, "mtp") == last and any(k.startswith("mtp.") for k in chunk) == last
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp", [(2, 2)])
def test_mtp_sits_on_the_last_pipeline_stage(tmp_path, pp, vpp):
    """megatron-core builds the MTP block on the last (virtual) pipeline stage only, with a copy of the word
    embedding there (GPTModel: `pre_process or mtp_process`): each stage's model loads its rank file with
    strict=True (tied embeddings: the output layer is a copy too)."""
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, dtype=torch.float32, num_nextn_predict_layers=1,
                         tie_word_embeddings=vpp > 1)
    hf2mcore(hf, tmp_path / "m", Layout(pp=pp, vpp=vpp), fmt="torch", progress=False, mtp=True)
    start_ranks(_pipeline_worker, args=(tmp_path / "m", read_config(hf), pp, vpp, _free_port()), nprocs=pp)


def test_cli_mtp_round_trip_and_stored_args(tmp_path):
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=1)
    cli = subprocess.run([sys.executable, "-m", "mconv.cli", "hf2mcore", str(hf), str(tmp_path / "m"), "--format",
                          "torch", "--tp", "2", "--pp", "2", "--mtp"], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0 and "note" not in cli.stderr, cli.stderr
    last = load_rank_file(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")
    assert last["args"].mtp_num_layers == 1 and last["args"].mtp_loss_scaling_factor == 0.1
    assert "mtp.layers.0.eh_proj.weight" in last["model"] and "embedding.word_embeddings.weight" in last["model"]
    first = load_rank_file(tmp_path / "m/release/mp_rank_00_000/model_optim_rng.pt")
    assert not any(k.startswith("mtp.") for k in first["model"])
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp_path / "back"))


@pytest.mark.parametrize("mtp", [False, True])
def test_config_says_how_many_mtp_layers_were_converted(tmp_path, mtp):
    """Without --mtp the MTP layers are left out, so config.json says there are none (a loader that
    builds them would look for weights that are not there); with --mtp it keeps the model's count."""
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=2)
    hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch", mtp=mtp, progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert config["num_nextn_predict_layers"] == (2 if mtp else 0)
    layers = {int(name.split(".")[2]) for name in read_all(tmp_path / "back") if name.startswith("model.layers.")}
    assert max(layers) + 1 == config["num_hidden_layers"] + config["num_nextn_predict_layers"]


def _cli_error(*args) -> str:
    cli = subprocess.run([sys.executable, "-m", "mconv.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1, cli.stderr
    return cli.stderr


def test_mtp_is_refused_for_a_model_without_mtp_layers(tmp_path):
    error = _cli_error("hf2mcore", FIXTURES / "bailing-v3-tiny", tmp_path / "m", "--format", "torch", "--mtp")
    assert error.startswith("mconv: error: --mtp: BailingMoeV3ForCausalLM as config.json describes it has no "
                            "multi-token-prediction layers")
    assert not (tmp_path / "m").exists()


def test_mtp_is_refused_when_megatron_core_would_build_another_layer_kind(tmp_path):
    # All 4 decoder layers dense: megatron-core would build the MTP layer dense, the HF one is MoE.
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=1, first_k_dense_replace=4)
    with pytest.raises(MconvError, match="mtp=True: config.json first_k_dense_replace gives MTP layer model.layers.4 MoE"):
        hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch", progress=False, mtp=True)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("other, implied", [(2, "2"), (0, "none")])
def test_mcore2hf_refuses_a_config_with_other_mtp_layers(tmp_path, other, implied, fmt):
    """torch_dist too (its reader planned with the args' MTP first, and blamed an `--mtp` not given)."""
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=1)
    hf2mcore(hf, tmp_path / "m", Layout(), fmt=fmt, progress=False, mtp=True)
    config = make_bailing_v3(tmp_path / "other", tokenizer=False, num_nextn_predict_layers=other)
    with pytest.raises(MconvError, match=f"args say mtp_num_layers=1, but the HF config implies {implied}"):
        mcore2hf(tmp_path / "m", tmp_path / "back", hf_config=config, progress=False)


def _dist_worker(rank: int, iter_dir, args, c: dict, tp: int, port: int, out):
    import warnings

    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ps.initialize_model_parallel(tp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = _core_config(args, tp, 1)
    model = bailing_model(config, c, args.padded_vocab_size)
    mtp_hidden = []
    model.mtp.register_forward_hook(lambda module, inputs, output: mtp_hidden.append(output))
    sharded = model.sharded_state_dict()
    # (key, global shape); a GLU fc1 is a factory of two boxes (its shape is checked by the load)
    keys = {(v.key, tuple(v.global_shape) if isinstance(v, ShardedTensor) else None) for v in nested_values(sharded)
            if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    loaded = dist_checkpointing.load({"model": sharded}, str(iter_dir))  # as Megatron-LM nests it
    model.load_state_dict(loaded["model"], strict=True)
    tokens = torch.tensor([TOKENS])
    mask = torch.ones(1, 1, len(TOKENS), len(TOKENS), dtype=torch.bool).triu(1)
    with torch.no_grad():
        logits = model(tokens, torch.arange(len(TOKENS))[None], mask)
        for hidden in mtp_hidden[0].chunk(1 + config.mtp_num_layers)[1:]:
            logits = torch.cat([logits, model.output_layer(hidden)[0].transpose(0, 1)])
    if rank == 0:
        torch.save((logits[..., : c["vocab_size"]], keys), out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_core_loads_the_torch_dist_mtp_checkpoint_at_tp2(tmp_path):
    """torch_dist with --mtp, written for TP1: megatron-core's own sharded_state_dict of the TP2 model
    (MLA + dense and MLA + MoE layers, megatron-core's MTP block) asks for exactly the keys and global
    shapes stored (the MTP inner layer as `mtp.layers.0.transformer_layer.`), `dist_checkpointing.load`
    fills it (strict load_state_dict), and its logits, the MTP depth's included, equal the HF reference."""
    from mconv.converter.torch_dist_io import TorchDistReader

    hf = make_bailing_v3(tmp_path / "hf", seed=5, dtype=torch.float32, tokenizer=False, num_hidden_layers=2,
                         layer_group_size=1, first_k_dense_replace=1, num_nextn_predict_layers=1)
    hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch_dist", progress=False, mtp=True)
    reader = TorchDistReader.open(tmp_path / "m" / "release")
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in reader.tensors
    start_ranks(_dist_worker, args=(tmp_path / "m" / "release", reader.args, read_config(hf), 2, _free_port(),
                                    tmp_path / "out.pt"), nprocs=2)
    logits, keys = torch.load(tmp_path / "out.pt")
    assert keys == {(key, None if (key, None) in keys else tuple(md.shape)) for key, md in reader.tensors.items()}
    reference = HFReference(hf)(TOKENS)
    assert logits.shape[0] == 2 and ((logits - reference).abs().max() / reference.abs().max()).item() < 1e-5
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp_path / "back"))


def test_torch_dist_mtp_round_trip(tmp_path):
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=2)  # KDA and MLA layers
    hf2mcore(hf, tmp_path / "m", Layout(tp=2), fmt="torch_dist", progress=False, mtp=True)
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    assert_bit_identical(read_all(hf), read_all(tmp_path / "back"))


def test_inspect_prints_the_mtp_flags_megatron_lm_parses(tmp_path):
    """`mconv inspect` of a --mtp checkpoint prints --mtp-num-layers / --mtp-loss-scaling-factor, and
    Megatron-LM's own parser reads them back as the stored args."""
    import argparse
    import warnings

    from megatron.training.arguments import add_megatron_arguments

    from mconv.converter import megatron_io as mio
    from mconv.converter.describe import inspect_path

    warnings.filterwarnings("ignore")
    hf = make_bailing_v3(tmp_path / "hf", tokenizer=False, num_nextn_predict_layers=2, mtp_loss_scaling_factor=0.3)
    hf2mcore(hf, tmp_path / "m", Layout(), fmt="torch", progress=False, mtp=True)
    saved = vars(mio.load_rank_file(tmp_path / "m/release/mp_rank_00/model_optim_rng.pt")["args"])
    flags = inspect_path(tmp_path / "m")["trainer_flags"]
    parsed, unknown = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_known_args(flags)
    assert not unknown and "--mtp-num-layers" in flags
    assert (parsed.mtp_num_layers, parsed.mtp_loss_scaling_factor) == (saved["mtp_num_layers"],
                                                                       saved["mtp_loss_scaling_factor"]) == (2, 0.3)
