"""A second, independent mapping: Megatron-Bridge 0.6's own Qwen3-VL bridges (mapping registry and
loader, imported without Transformer Engine) load the same HF checkpoint into the same mbridge
`Qwen3VLModel`, in the same gloo processes, and every tensor equals what mconv's rank files put there,
bit for bit. Megatron-Bridge cannot map dense layers inside the MoE model (`mlp_only_layers`; it
crashes on them), so the MoE case has none; and it pads the vocabulary only for the names
`embedding.word_embeddings.weight` / `output_layer.weight` (not under `language_model.`), so the
vocabulary is left unpadded here (`--vocab-divisor 1`; 300 rows split over TP2)."""
import json

import pytest

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, hf2mcore
from mconv.converter.transforms import padded_vocab_size
from tests.megatron_oracle import assert_same
from tests.qwen3_vl_oracle import VLRun, megatron_logits

pytestmark = pytest.mark.slow


def test_megatron_bridge_loads_the_same_tensors(tmp_path):
    """MoE at TP2/EP2 (the dense model at TP2 is compared in test_qwen3_vl_oracle.py's run)."""
    hf = make_qwen3_vl(tmp_path / "hf", seed=7, moe=True, text={"mlp_only_layers": []})
    config = json.loads((hf / "config.json").read_text())
    hf2mcore(hf, tmp_path / "m", Layout(tp=2, ep=2, vocab_divisor=1), fmt="torch", progress=False)
    run = VLRun(tmp_path / "m", config, tp=2, ep=2, bridge_hf=hf,
                padded_vocab=padded_vocab_size(config["text_config"]["vocab_size"], 1, 2))
    megatron_logits(run, tmp_path)
    assert_same(tmp_path, "bridge", run.world)
