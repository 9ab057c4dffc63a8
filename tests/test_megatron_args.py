"""Checkpoints whose args Megatron-LM itself made: mcore2hf reads the layout from the args
Megatron-LM's own `parse_args` + `validate_args` (megatron-core 0.19.2's megatron.training) store,
dense and MoE, and from older versions' args (the same Namespace with the fields those versions
lack removed, or set to None).

A checkpoint is written by hf2mcore at the layout, then every rank file's `args` is replaced by
Megatron-LM's; mcore2hf must give back the HF model bit for bit (read with safetensors), which it
can only do if it found every rank file where Megatron-LM's naming puts it for that layout.
"""
import argparse
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter import megatron_io as mio
from mconv.converter.megatron_checkpoint import check_args
from mconv.mappings import architecture_for
from tests.conftest import FIXTURES, load_rank_file
from tests.megatron_oracle import megatron_lm_args, read_config

pytestmark = pytest.mark.slow  # Megatron-LM's argument module takes a while to import

DENSE = FIXTURES / "qwen3-tiny"
MOE = FIXTURES / "qwen3-moe-tiny"


def model_flags(hf_dir) -> list[str]:
    """The Megatron-LM command line of a job training the fixture."""
    c = read_config(hf_dir)
    flags = ["--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
             "--num-attention-heads", c["num_attention_heads"], "--group-query-attention",
             "--num-query-groups", c["num_key_value_heads"], "--kv-channels", c["head_dim"],
             "--ffn-hidden-size", c["intermediate_size"], "--seq-length", 256, "--max-position-embeddings", 256,
             "--position-embedding-type", "rope", "--rotary-base", int(c["rope_parameters"]["rope_theta"]),
             "--normalization", "RMSNorm", "--norm-epsilon", c["rms_norm_eps"], "--qk-layernorm", "--swiglu",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", 1,
             "--tokenizer-type", "NullTokenizer", "--vocab-size", c["vocab_size"], "--bf16"]
    if c.get("num_local_experts"):
        dense = set(c["mlp_only_layers"])
        flags += ["--num-experts", c["num_local_experts"], "--moe-ffn-hidden-size", c["moe_intermediate_size"],
                  "--moe-router-topk", c["num_experts_per_tok"],
                  "--moe-layer-freq", str([int(i not in dense) for i in range(c["num_hidden_layers"])]).replace(" ", "")]
    return [str(f) for f in flags]


# (fixture, Megatron-LM parallel flags, world size, the layout those args describe)
CASES = {
    "dense-tp2": (DENSE, ["--tensor-model-parallel-size", "2"], 2, Layout(tp=2)),
    "dense-tp2-pp2-uneven": (DENSE, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--decoder-first-pipeline-num-layers", "1"], 4,
                             Layout(tp=2, pp=2, first_stage_layers=1)),
    "dense-pp2-vpp2": (DENSE, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                       2, Layout(pp=2, vpp=2)),
    "moe-tp2-ep2": (MOE, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4,
                    Layout(tp=2, ep=2, etp=2)),
    "moe-tp2-ep2-etp1": (MOE, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                               "--expert-tensor-parallel-size", "1"], 2, Layout(tp=2, ep=2, etp=1)),
}
# How each Megatron-LM generation stores expert_tensor_parallel_size: 0.10+ always (= TP unless
# given), before 0.10 not at all (experts split like the dense layers: no ETP1 case), and a None
# that validate_args would have replaced.
ETP_FIELD = ["stored", "absent", "none"]


def args_for(case: str, etp_field: str) -> argparse.Namespace:
    hf_dir, flags, world, _ = CASES[case]
    args = megatron_lm_args(model_flags(hf_dir) + flags, world)
    if etp_field == "absent":
        del args.expert_tensor_parallel_size
    elif etp_field == "none":
        args.expert_tensor_parallel_size = None
    return args


def with_megatron_lm_args(ckpt, layout: Layout, args: argparse.Namespace) -> None:
    """Replace the args of every rank file with Megatron-LM's."""
    location = mio.locate(ckpt)
    for rank in layout.ranks():
        path = mio.rank_file(location.iter_dir, layout, rank)
        state = load_rank_file(path)
        state["args"] = args
        torch.save(state, path)


@pytest.mark.parametrize("case,etp_field", [(case, field) for case in CASES for field in ETP_FIELD
                                             if field == "stored" or not case.endswith("etp1")])
def test_checkpoint_with_megatron_lm_args_converts(tmp_path, case, etp_field):
    hf_dir, _, _, layout = CASES[case]
    args = args_for(case, etp_field)
    if etp_field == "stored":  # Megatron-LM stores ETP = TP for every run, dense ones too
        assert args.expert_tensor_parallel_size == (layout.etp if layout.ep > 1 else layout.tp)
    hf2mcore(hf_dir, tmp_path / "ckpt", layout, fmt="torch", progress=False)
    with_megatron_lm_args(tmp_path / "ckpt", layout, args)
    assert mio.layout_from_args(args, tmp_path) == layout
    mcore2hf(tmp_path / "ckpt", tmp_path / "back", hf_config=hf_dir, progress=False)
    original = load_file(hf_dir / "model.safetensors")
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k].view(torch.uint8), back[k].view(torch.uint8)) for k in original)


@pytest.mark.parametrize("field,value,fragment", [
    ("pipeline_model_parallel_layout", "Et|tL", "pipeline_model_parallel_layout"),
    ("account_for_embedding_in_pipeline_split", True, "account_for_embedding_in_pipeline_split"),
    ("account_for_loss_in_pipeline_split", True, "account_for_loss_in_pipeline_split"),
])
def test_layouts_mconv_does_not_read_are_refused_by_name(field, value, fragment):
    args = args_for("dense-tp2", "stored")
    setattr(args, field, value)
    with pytest.raises(MconvError, match=fragment):
        mio.layout_from_args(args, FIXTURES)


def test_older_megatron_lm_args():
    """Before ETP existed: `--moe-extended-tp` (0.8-0.9) is refused by name; checkpoint version < 3
    stored TP as `model_parallel_size`, as Megatron-LM's load_args_from_checkpoint reads it."""
    args = args_for("moe-tp2-ep2", "absent")
    args.moe_extended_tp = True
    with pytest.raises(MconvError, match="moe_extended_tp"):
        mio.layout_from_args(args, FIXTURES)
    old = SimpleNamespace(model_parallel_size=2, make_vocab_size_divisible_by=128)
    assert mio.layout_from_args(old, FIXTURES) == Layout(tp=2)


def test_args_without_group_query_attention():
    """Without --group-query-attention Megatron-LM keeps num_query_groups at its default (1) while
    every head is its own group."""
    argv = model_flags(DENSE)
    at = argv.index("--group-query-attention")
    del argv[at:at + 3]  # and --num-query-groups N
    args = megatron_lm_args(argv)
    assert args.num_query_groups == 1 and args.group_query_attention is False
    config = {**read_config(DENSE), "num_key_value_heads": 4}
    arch = architecture_for(config)
    check_args(args, arch, arch.dims(config), FIXTURES)
    with pytest.raises(MconvError, match="num_query_groups=4"):  # the fixture's 2 groups are another model
        check_args(args, arch, arch.dims(read_config(DENSE)), FIXTURES)
