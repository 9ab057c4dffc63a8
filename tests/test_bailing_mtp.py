"""BailingMoeV3 multi-token prediction (`hf2mcore --mtp`): HF `model.layers.{L+j}` (enorm, hnorm,
eh_proj, an MLA + MoE layer, final_layernorm) in megatron-core's MTP block (`mtp.layers.{j}.`).

Oracle: megatron-core 0.19.2's own `GPTModel` with `mtp_block_spec` (`get_gpt_mtp_block_spec`, local
spec, the MTP inner layer built from the last decoder layer's spec with the CPU core attention and
AReaL's head-wise gate of test_bailing_oracle.py), loading the rank files hf2mcore wrote with
`strict=True` in gloo processes, against transformers' DeepSeek-V3 modules loaded with the HF tensors
and chained as megatron-core's MTP block chains its depths (HFReference). Each depth's logits through
the output layer must agree (fp32); a wrong mapping (enorm and hnorm swapped, eh_proj's two input
halves swapped, eh_proj split on the wrong dimension) must fail the same comparison.
"""
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from mconv.converter.transforms import ROW
from mconv.mappings import bailing_v3
from tests.conftest import FIXTURES, ROOT
from tests.test_bailing_oracle import _max_difference
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
