"""Each transform kind against an independent formulation of the layout it must produce, and
split/merge as exact inverses."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mconv.converter.transforms import (COLUMN, GLU, QKV, REPLICATED, ROW, SECTIONED, VOCAB, merge,
                                        padded_vocab_size, split_tensors)


def shards_of(kind, tensors, size, **params):
    params = {"name": "t", "vocab_divisor": 128, **params}
    shapes = [tuple(t.shape) for t in tensors]
    layouts = [kind.layout(shapes, r, size, params) for r in range(size)]
    shards = [split_tensors(layout, tensors) for layout in layouts]
    return layouts, shards, shapes


def assert_round_trip(kind, tensors, size, **params):
    layouts, shards, shapes = shards_of(kind, tensors, size, **params)
    if kind.replicated:
        layouts, shards = layouts[:1], shards[:1]
    for original, rebuilt in zip(tensors, merge(layouts, shards, shapes)):
        assert rebuilt.dtype == original.dtype and torch.equal(rebuilt, original)
    return shards


@settings(max_examples=60, deadline=None)
@given(groups=st.sampled_from([1, 2, 4, 8]), q_per_group=st.integers(1, 4), head_dim=st.sampled_from([2, 4]),
       hidden=st.integers(1, 6), tp_index=st.integers(0, 3), bias=st.booleans())
def test_qkv_matches_grouped_reference(groups, q_per_group, head_dim, hidden, tp_index, bias):
    tp = [d for d in (1, 2, 4, 8) if groups % d == 0][min(tp_index, [1, 2, 4, 8].index(groups))]
    heads = groups * q_per_group
    tail = () if bias else (hidden,)
    q, k, v = (torch.randn(n * head_dim, *tail) for n in (heads, groups, groups))
    shards = assert_round_trip(QKV, [q, k, v], tp, heads=heads, groups=groups, head_dim=head_dim)
    # Reference: [ng, (q heads of the group, k, v) * d, ...] then TP takes contiguous groups.
    grouped = torch.cat([q.reshape(groups, q_per_group * head_dim, *tail),
                         k.reshape(groups, head_dim, *tail), v.reshape(groups, head_dim, *tail)], dim=1)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, grouped.chunk(tp, dim=0)[r].reshape(-1, *tail))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glu_rank_holds_its_gate_and_up_chunks(tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = assert_round_trip(GLU, [gate, up], tp)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    assert tp == 1 or not torch.equal(torch.cat(shards), torch.cat([gate, up]))


def test_sectioned_splits_every_section():
    sections = [torch.randn(4, 2), torch.randn(8, 2), torch.randn(4, 2)]
    shards = assert_round_trip(SECTIONED, sections, 2)
    assert torch.equal(shards[1], torch.cat([sections[0][2:], sections[1][4:], sections[2][2:]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_column_row_replicated(dtype):
    w = torch.randn(8, 6).to(dtype)
    assert [s.shape for s in assert_round_trip(COLUMN, [w], 4)] == [(2, 6)] * 4
    assert [s.shape for s in assert_round_trip(ROW, [w], 2)] == [(8, 3)] * 2
    assert all(torch.equal(s, w) for s in assert_round_trip(REPLICATED, [w], 4))


@pytest.mark.parametrize("vocab,divisor,tp", [(300, 128, 1), (300, 128, 2), (151936, 128, 4), (7, 4, 8), (256, 128, 2)])
def test_vocab_padding_matches_megatron_lm(vocab, divisor, tp):
    from argparse import Namespace

    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    padded = vocab_size_with_padding(vocab, Namespace(make_vocab_size_divisible_by=divisor,
                                                     tensor_model_parallel_size=tp, rank=1), logging_enabled=False)
    assert padded_vocab_size(vocab, divisor, tp) == padded
    table = torch.randn(vocab, 3)
    shards = assert_round_trip(VOCAB, [table], tp, vocab_divisor=divisor)
    assert all(s.shape == (padded // tp, 3) for s in shards)
    stacked = torch.cat(shards)
    assert torch.equal(stacked[:vocab], table) and not stacked[vocab:].any()


def test_uneven_column_split_is_refused():
    from mconv import MconvError

    with pytest.raises(MconvError, match="not divisible"):
        COLUMN.layout([(6, 2)], 0, 4, {"name": "decoder.layers.0.mlp.linear_fc1.weight"})


@pytest.mark.parametrize("kind,shapes,params", [
    (GLU, [(4, 3), (4, 3)], {}), (QKV, [(8, 3), (8, 3), (8, 3)], dict(heads=2, groups=2, head_dim=4)),
    (VOCAB, [(5, 3)], dict(vocab_divisor=4)), (ROW, [(4, 6)], {}), (REPLICATED, [(7,)], {}),
])
def test_merge_single_equals_merge_and_avoids_copies(kind, shapes, params):
    from mconv.converter.transforms import merge_single

    tensors = [torch.randn(s) for s in shapes]
    layouts, shards, _ = shards_of(kind, tensors, 1, **params)
    views = merge_single(layouts[0], shards[0], shapes)
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    shares = [v.untyped_storage().data_ptr() == shards[0].untyped_storage().data_ptr() for v in views]
    assert all(shares) == (kind is not QKV)  # QKV interleaves groups: a copy is unavoidable
