"""Oracle: what hf2mcore writes for Qwen3-VL loads (strict) into mbridge's Megatron Qwen3VLModel at
TP2 (vision tower split too), PP2 (vision on stage 0, every tensor unsplit as at TP1; a one-process TP1
run proved nothing more and cost CI minutes) and MoE TP2/EP2/ETP1, and its logits
equal transformers' on a text-only and a text+image input (fp32, 1e-4). The MoE fixture holds its
stacked experts in the transformers 4.x orientation, which transformers 5.x transposes on load.
At TP2 and MoE TP2/EP2, the torch_dist output (keys from the Qwen3VLModel, written for any layout)
is also loaded by megatron-core's `dist_checkpointing.load` into a second model of each rank, which
must equal the first bit for bit. With virtual pipeline stages (PP2 x VPP2) the vision tower is on
virtual stage 0 of pipeline rank 0, and each chunk's language model is built for its virtual stage
(qwen3_vl_oracle's docstring says how)."""
import json

import pytest

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, hf2mcore
from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES
from tests.megatron_oracle import assert_same
from tests.qwen3_vl_oracle import VLRun, example_inputs, hf_logits, megatron_logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fixture,tp,pp,ep,etp", [
    ("qwen3-vl-tiny", 2, 1, 1, 1),
    ("qwen3-vl-tiny", 1, 2, 1, 1),
    ("qwen3-vl-moe-tiny", 2, 1, 2, 1),
])
def test_logits_match_transformers(tmp_path, fixture, tp, pp, ep, etp):
    hf = FIXTURES / fixture
    config = json.loads((hf / "config.json").read_text())
    # Dense TP2 also runs the Megatron-Bridge comparison (test_qwen3_vl_bridge.py), which needs an
    # unpadded vocabulary.
    bridge = hf if fixture == "qwen3-vl-tiny" and tp == 2 else None
    divisor = 1 if bridge else 128
    hf2mcore(hf, tmp_path / "m", Layout(tp=tp, pp=pp, ep=ep, etp=etp, vocab_divisor=divisor), fmt="torch",
             progress=False)
    dist = tmp_path / "dist" if tp > 1 else None
    if dist:  # torch_dist: the layout only pads the vocabulary
        hf2mcore(hf, dist, Layout(tp=tp, vocab_divisor=divisor), progress=False)
    inputs = example_inputs(config)
    run = VLRun(tmp_path / "m", config, tp=tp, pp=pp, ep=ep, etp=etp, dist_checkpoint=dist, bridge_hf=bridge,
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], divisor, tp), inputs=inputs)
    ours, theirs = megatron_logits(run, tmp_path), hf_logits(hf, inputs)
    for name in inputs:
        assert (ours[name] - theirs[name]).abs().max() < 1e-4, name
        assert theirs[name].abs().max() > 0.1  # not trivially small
    if dist:
        assert_same(tmp_path, "dist", run.world)
    if bridge:
        assert_same(tmp_path, "bridge", run.world)


def test_virtual_pipeline_stages(tmp_path):
    """Dense, PP2 x VPP2, 8 layers (2 per chunk: mbridge's model asserts more layers than deepstack
    targets in every chunk): the legacy rank files (`model0` / `model1`) load strictly, the torch_dist
    output loads into every chunk through megatron-core's loader, and the logits equal transformers'."""
    hf = make_qwen3_vl(tmp_path / "hf", seed=3, text={"num_hidden_layers": 8},
                       vision={"deepstack_visual_indexes": [1]})
    config = json.loads((hf / "config.json").read_text())
    hf2mcore(hf, tmp_path / "m", Layout(pp=2, vpp=2), fmt="torch", progress=False)
    hf2mcore(hf, tmp_path / "dist", Layout(), progress=False)
    inputs = example_inputs(config)
    run = VLRun(tmp_path / "m", config, pp=2, vpp=2, dist_checkpoint=tmp_path / "dist",
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 128, 1), inputs=inputs)
    ours, theirs = megatron_logits(run, tmp_path), hf_logits(hf, inputs)
    for name in inputs:
        assert (ours[name] - theirs[name]).abs().max() < 1e-4, name
    assert_same(tmp_path, "dist", run.world)
