"""The examples/ scripts run as their docstrings say, and do what they claim, checked against a library
we did not write."""
import os
import re
import subprocess
import sys

import pytest
import torch

from mconv.converter.transforms import padded_vocab_size
from tests.conftest import FIXTURES, ROOT
from tests.megatron_oracle import read_config


@pytest.mark.slow
def test_weight_sync_example_streams_the_stepped_weights(tmp_path):
    """examples/weight_sync_gloo.py under torchrun (2 gloo processes, TP2): the HF tensors it streams
    after its SGD step are transformers' own parameters after the same step (the same loss on the
    same tokens, over megatron-core's padded vocabulary, whose padding logits are zero), every one of
    them, and each differs from the checkpoint's (the step reached the streamed weights)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "examples"))
    from weight_sync_gloo import LR, TOKENS

    hf_dir = FIXTURES / "qwen3-tiny"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "examples/weight_sync_gloo.py", "--hf", str(hf_dir), "--save", str(tmp_path / "w.pt")],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^bucket 0: \d+ tensors, \d+ bytes$", result.stdout, re.M), result.stdout
    streamed = torch.load(tmp_path / "w.pt")

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    vocab = read_config(hf_dir)["vocab_size"]
    logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
    padded = torch.nn.functional.pad(logits, (0, padded_vocab_size(vocab, 128, 2) - vocab))
    torch.nn.functional.cross_entropy(padded, torch.tensor(TOKENS[1:])).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()

    stepped = dict(model.named_parameters())
    assert sorted(streamed) == sorted(stepped)
    for name, tensor in streamed.items():
        assert torch.allclose(tensor, stepped[name].detach(), rtol=0, atol=1e-5), name
        assert not torch.equal(tensor, before[name]), name
