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
