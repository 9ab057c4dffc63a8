"""Layer placement against megatron-core's own rules (get_transformer_layer_offset and
get_num_layers_to_build), and early validation."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mconv import Layout, MconvError


def megatron_placement(num_layers, pp, vpp, first, last):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    placement = []
    for p in range(pp):
        row = []
        for v in range(vpp):
            vp_stage = v if vpp > 1 else None
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=p)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=p)
            row.append(range(offset, offset + count))
        placement.append(row)
    return placement


@settings(max_examples=150, deadline=None)
@given(num_layers=st.integers(1, 24), pp=st.integers(2, 4), vpp=st.integers(1, 3),
       first=st.one_of(st.none(), st.integers(0, 8)), last=st.one_of(st.none(), st.integers(0, 8)))
@example(num_layers=12, pp=2, vpp=2, first=6, last=6)  # megatron-core divides by zero middle stages
def test_chunk_layers_match_megatron_core(num_layers, pp, vpp, first, last):
    layout = Layout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    try:
        theirs = megatron_placement(num_layers, pp, vpp, first, last)
        valid = sorted(i for stage in theirs for chunk in stage for i in chunk) == list(range(num_layers))
    except (ValueError, AssertionError, ZeroDivisionError):  # megatron-core refuses (or fails on) this layout
        valid = False
    if not valid:  # refused, or accepted with a placement that is not a partition of the layers
        with pytest.raises(MconvError):
            layout.chunk_layers(num_layers)
        return
    ours = layout.chunk_layers(num_layers)
    assert ours == theirs
    assert sorted(i for stage in ours for chunk in stage for i in chunk) == list(range(num_layers))


def test_uniform_chunks_follow_interleaved_formula():
    layout = Layout(pp=2, vpp=2)
    assert layout.chunk_layers(8) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]


@pytest.mark.parametrize("layout,layers,message", [
    (Layout(pp=3), 4, "cannot be split evenly"),
    (Layout(pp=2, vpp=3), 4, "not divisible by vpp=3"),
    (Layout(vpp=2), 4, "vpp needs pp > 1"),
    (Layout(pp=2, first_stage_layers=5), 4,
     r"^first_stage_layers=5: 5 layers on the first/last pipeline stages, more than the model's 4$"),
    (Layout(pp=3, first_stage_layers=2, last_stage_layers=2), 4, r"^first_stage_layers=2 and last_stage_layers=2: "
     r"all 4 layers of the model on the first/last pipeline stages, none left for the 1 other stage of pp=3$"),
    (Layout(pp=2, vpp=2, first_stage_layers=1), 4, r"^pipeline stage 0 holds 1 layer, not divisible by vpp=2$"),
    (Layout(pp=3, first_stage_layers=3), 4, r"^first_stage_layers=3 leaves 1 layer, which cannot be split evenly over 2 "
                                             r"pipeline stages "),
    (Layout(tp=0), 4, "positive"),
])
def test_invalid_layouts(layout, layers, message):
    with pytest.raises(MconvError, match=message):
        layout.validate(layers)


def test_rank_directory_names_match_megatron_lm():
    from megatron.training.checkpointing import get_checkpoint_name

    for layout in (Layout(tp=2), Layout(tp=2, pp=3), Layout(tp=1, pp=2, ep=2), Layout(tp=2, ep=4)):
        for rank in layout.ranks():
            theirs = get_checkpoint_name("", 0, release=True, pipeline_parallel=layout.pp > 1,
                                         tensor_rank=rank.tp, pipeline_rank=rank.pp,
                                         expert_parallel=layout.ep > 1, expert_rank=rank.ep)
            assert theirs.split("/")[-2] == layout.rank_dir(rank)
