"""The torch_dist boxes mconv derives from its tables (mconv/converter/torch_dist.py, no megatron-core)
equal megatron-core's own: the `sharded_state_dict()` of the local-spec model megatron-core (mbridge
for Qwen3-VL) builds from the args hf2mcore stores, box by box: key, global shape, dtype, global
offset, sizes with the prepended axes, replica id as a TP1 writer has it, the parameter and the rows
of it each box holds; and every `_extra_state` object (unique key, replica id, data)."""
import json
from collections import Counter

import pytest
import torch

from mconv.converter import megatron_io as mio
from mconv.converter import torch_dist
from mconv.converter.layout import Layout
from mconv.converter.hf2mcore import _flat_plan
from mconv.converter.planner import make_plan
from mconv.mappings import architecture_for
from tests.conftest import FIXTURES


def config(fixture: str, text: dict | None = None, vision: dict | None = None, **top) -> dict:
    c = json.loads((FIXTURES / fixture / "config.json").read_text())
    if text is not None or vision is not None:
        c["text_config"] = {**c["text_config"], **(text or {})}
        c["vision_config"] = {**c["vision_config"], **(vision or {})}
    return {**c, **top}


def _dtype(name: str) -> torch.dtype:
    """Mixed dtypes, as HF checkpoints have them (fp32 norms and router bias, bf16 weights)."""
    return torch.float32 if "norm" in name or name.endswith("bias") else torch.bfloat16


CASES = {
    "dense": (config("qwen3-tiny"), Layout()),
    "dense tied, vocab padded for tp2": (config("qwen3-tiny-tied", vocab_size=300), Layout(tp=2, vocab_divisor=24)),
    "dense 3 layers, tp2": (config("qwen3-tiny", num_hidden_layers=3, vocab_size=129), Layout(tp=2, vocab_divisor=1)),
    "all-moe (stacked)": (config("qwen3-moe-tiny", mlp_only_layers=[]), Layout(ep=2)),
    "mixed dense/moe (moe_layer_freq list)": (config("qwen3-moe-tiny"), Layout(tp=2)),
    "moe decoder_sparse_step 2, tied": (config("qwen3-moe-tiny", mlp_only_layers=[], decoder_sparse_step=2,
                                               tie_word_embeddings=True), Layout(vocab_divisor=64)),
    "vl dense, deepstack": (config("qwen3-vl-tiny"), Layout(tp=2)),
    "vl dense tied, no deepstack": (config("qwen3-vl-tiny", vision={"deepstack_visual_indexes": []},
                                           tie_word_embeddings=True), Layout(vocab_divisor=1)),
    "vl moe, deepstack": (config("qwen3-vl-moe-tiny"), Layout()),
    "vl moe mixed dense/moe": (config("qwen3-vl-moe-tiny", text={"mlp_only_layers": [1]}), Layout(tp=2)),
}


def flat_plan_and_args(hf_config: dict, layout: Layout, mtp: bool = False):
    """The TP1 plan of a torch_dist checkpoint of `hf_config` and the Megatron-LM args hf2mcore
    stores with it."""
    arch = architecture_for(hf_config)
    plan = make_plan(arch, hf_config, layout, "local", mtp)
    args = mio.megatron_lm_args(layout, plan.dims, arch.megatron_args(plan.dims), "local", plan.padded_vocab,
                                torch.bfloat16, "torch_dist")
    return _flat_plan(plan), args


def derived(hf_config: dict, layout: Layout, dtype_of=_dtype, mtp: bool = False):
    """mconv's boxes as comparable records (parameter dtypes by `dtype_of(name)`), and the args and
    dtypes hf2mcore would store with them (`mtp`: with the multi-token-prediction layers)."""
    flat, args = flat_plan_and_args(hf_config, layout, mtp)
    dtypes = {t.megatron: dtype_of(t.megatron) for t in flat.ranks[0].chunks[0]}
    records = []
    for box in torch_dist.plan_boxes(flat, args):
        if box.global_shape is None:
            records.append(("object", box.key, box.replica_id, None))
        else:
            records.append(("tensor", box.key, box.global_shape, dtypes[box.task.megatron], box.offsets, box.sizes,
                            box.replica_id, box.task.megatron, box.start))
    return records, args, dtypes


def megatron_cores(args, dtypes):
    from tests.megatron_dist_oracle import box_record, megatron_process_group, meta_model, parameter_names, sharded_items

    with megatron_process_group():
        model = meta_model(args, torch.bfloat16, dtypes)
        names = parameter_names(model)
        return [box_record(item, names) for item in sharded_items(model)]


@pytest.mark.parametrize("case", list(CASES))
def test_derived_boxes_equal_megatron_cores(case):
    hf_config, layout = CASES[case]
    ours, args, dtypes = derived(hf_config, layout)
    theirs = megatron_cores(args, dtypes)
    assert Counter(ours) == Counter(theirs), (sorted(set(ours) - set(theirs), key=str)[:5],
                                              sorted(set(theirs) - set(ours), key=str)[:5])
    assert len(ours) == len(set(ours))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_5_vl_boxes_equal_megatron_cores(moe):
    """Qwen3.5-VL (no Megatron model of it builds without Transformer Engine here): the `language_model.`
    boxes equal megatron-core's GPTModel of the Qwen3.5 block spec (tests/qwen3_5_oracle.py, with the MTP
    block) saved under that prefix, as Qwen3VLModel saves its language model; the `vision_model.` boxes
    equal those of mbridge's Qwen3VLModel for a Qwen3-VL model with the same tower and no deepstack
    (vision blocks stacked: Megatron-Bridge builds the tower from its own config, whose layers are alike)."""
    from fixtures.make_fixtures import QWEN3_5, QWEN3_5_MOE, QWEN3_VL_TOKENS
    from tests.megatron_dist_oracle import box_record, megatron_process_group, parameter_names, sharded_items
    from tests.qwen3_5_oracle import meta_model

    qwen3_vl = config("qwen3-vl-tiny", vision={"deepstack_visual_indexes": []})
    text = {**(QWEN3_5_MOE if moe else QWEN3_5), "mtp_num_hidden_layers": 1}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    vl = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
          "text_config": text, "vision_config": qwen3_vl["vision_config"], **QWEN3_VL_TOKENS}
    ours, args, dtypes = derived(vl, Layout(), mtp=True)
    # The model's norms are fused into the next linear layer as Transformer Engine's are: its parameter
    # names are the rules' TE names (the keys are TE names either way).
    flat, _ = flat_plan_and_args(vl, Layout(), mtp=True)
    te = {t.megatron: t.rule.te.format(**torch_dist._indexes(t.rule.megatron, t.megatron))
          for t in flat.ranks[0].chunks[0] if t.rule.te and "{expert}" not in t.rule.te and t.megatron.startswith("language_model.")}
    ours = [r[:7] + (te.get(r[7], r[7]),) + r[8:] if r[0] == "tensor" else r for r in ours]
    language = {te.get(name, name).removeprefix("language_model."): dtype for name, dtype in dtypes.items()}
    with megatron_process_group():
        model = meta_model(args, language)
        names = {key: "language_model." + name for key, name in parameter_names(model).items()}
        theirs = [box_record(item, names) for item in sharded_items(model, "language_model.")]
    _, vision_args, vision_dtypes = derived(qwen3_vl, Layout())
    theirs += [r for r in megatron_cores(vision_args, vision_dtypes) if r[1].startswith("vision_model.")]
    assert Counter(ours) == Counter(theirs), (sorted(set(ours) - set(theirs), key=str)[:5],
                                              sorted(set(theirs) - set(ours), key=str)[:5])
    assert any(r[1] == "language_model.mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" for r in ours)
