"""Every dimension a Megatron checkpoint records (its args, its global shapes, its padded vocabulary)
must agree exactly with the HF config it is read with, in both formats and for every command that
reads one (mcore2hf, inspect --hf-config, export-lora): a mismatch is one line naming the field,
never a silently cut vocabulary. Oracle for the padding rule: Megatron-LM's own
`calculate_padded_vocab_size` (megatron.training.vocab_utils)."""
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mconv import Layout, MconvError
from tests.conftest import FIXTURES
from tests.test_errors import assert_refused, mconv

TINY = FIXTURES / "qwen3-tiny"  # vocab_size 300


def config_with(tmp_path: Path, **fields) -> Path:
    directory = tmp_path / "config"
    directory.mkdir(exist_ok=True)
    config = {**json.loads((TINY / "config.json").read_text()), **fields}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["torch_dist", "torch"])
def padded_512(request, tmp_path_factory):
    """The fixture (vocab 300) at TP2 with make_vocab_size_divisible_by 256: 512 padded rows, as a
    100-row vocabulary would be padded too."""
    out = tmp_path_factory.mktemp("dims") / request.param
    result = mconv("hf2mcore", TINY, out, "--tp", "2", "--vocab-divisor", "256", "--format", request.param, "-q")
    assert result.exit_code == 0, result.output
    return out


def test_a_smaller_vocabulary_is_refused_not_cut(padded_512, tmp_path):
    small = config_with(tmp_path, vocab_size=100)
    out = tmp_path / "out"
    assert_refused(mconv("mcore2hf", padded_512, out, "--hf-config", small), out, "vocab_size=300", "100")
    result = mconv("inspect", padded_512, "--hf-config", small)
    assert result.exit_code == 1 and "vocab_size=300" in result.stderr and len(result.stderr.splitlines()) == 1
    assert mconv("mcore2hf", padded_512, out, "--hf-config", TINY, "-q").exit_code == 0  # the right config
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].shape[0] == 300


def test_export_lora_goes_through_the_same_check(tmp_path):
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path, TINY, Layout(tp=2), adapter_only=False)
    out = tmp_path / "out"
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--hf-config", config_with(tmp_path, vocab_size=100)),
                   out, "vocab_size=300")


def test_a_global_shape_is_checked_when_the_args_say_nothing(tmp_path):
    """A torch_dist checkpoint without args (common.pt holds none): inspect --hf-config, which reads
    no tensor, still checks every stored global shape against the HF config."""
    import torch

    ckpt = tmp_path / "ckpt"
    assert mconv("hf2mcore", TINY, ckpt, "-q").exit_code == 0
    torch.save({}, ckpt / "release" / "common.pt")
    result = mconv("inspect", ckpt, "--hf-config", config_with(tmp_path, intermediate_size=64))
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.output
    assert "decoder.layers.mlp.linear_fc1.weight has shape [4, 192, 64], the HF config implies [4, 128, 64]" \
        in result.stderr


@pytest.mark.slow  # Megatron-LM's training package takes a while to import
def test_padding_rule_and_tp_sizes_follow_megatron_lm():
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    from mconv.converter.megatron_checkpoint import check_padded_vocab
    from mconv.converter.transforms import tp_sizes_for_padded_vocab

    def megatron(vocab, divisor, tp):
        return calculate_padded_vocab_size(vocab, divisor, tp, logging_enabled=False)

    for vocab, divisor, padded in [(300, 128, 384), (300, 256, 512), (100, 128, 512), (151936, 128, 151936),
                                   (1000, 64, 1024), (50257, 128, 50304)]:
        sizes = tp_sizes_for_padded_vocab(padded, vocab, divisor)
        assert sizes == [tp for tp in range(1, padded + 1) if megatron(vocab, divisor, tp) == padded]
        for tp in range(1, 9):
            saved = {"make_vocab_size_divisible_by": divisor, "tensor_model_parallel_size": tp}
            if megatron(vocab, divisor, tp) == padded:
                check_padded_vocab(saved, vocab, padded, TINY)
            else:
                with pytest.raises(MconvError, match=f"vocab_size={vocab} pads to {megatron(vocab, divisor, tp)}"):
                    check_padded_vocab(saved, vocab, padded, TINY)
    with pytest.raises(MconvError, match="padded_vocab_size=512, but its word embedding has 384 rows"):
        check_padded_vocab({"padded_vocab_size": 512}, 300, 384, TINY)


def test_tp_sizes_of_an_absurd_padded_vocabulary_stop_at_the_largest_layout():
    """A checkpoint's padded vocabulary of 2**40 rows (divisor 1, no HF config): the TP sizes end at
    the largest a layout takes, at once (inspect spun for good over 2**40 candidates)."""
    from mconv.converter.options import MAX_PARALLEL_SIZE
    from mconv.converter.transforms import tp_sizes_for_padded_vocab

    assert tp_sizes_for_padded_vocab(2**40, None, 1) == [2**k for k in range(17)] and MAX_PARALLEL_SIZE == 2**16


def dry_run_rows(tp: int) -> int | None:
    """The word embedding rows of `hf2mcore --tp tp --dry-run` on the fixture, None where it refuses."""
    result = mconv("hf2mcore", TINY, "unused-out", "--tp", tp, "--dry-run", "--json")
    if result.exit_code:
        return None
    tensors = json.loads(result.output)["plan"][0]["tensors"]
    return next(t["shape"][0] for t in tensors if t["megatron"] == "embedding.word_embeddings.weight")


def test_inspect_names_the_tp_sizes_hf2mcore_accepts_with_the_stored_padding(tmp_path):
    """Oracle: the real command. The TP sizes listed are exactly those N in 1..8 where
    `hf2mcore --tp N --dry-run` succeeds and plans the stored padded rows (the fixture has 2 query
    groups: TP4 pads 300 to 512 rows as TP2 does, but hf2mcore refuses it)."""
    saved_tp = 2
    ckpt = tmp_path / "ckpt"
    assert mconv("hf2mcore", TINY, ckpt, "--tp", saved_tp, "-q").exit_code == 0
    layout = json.loads(mconv("inspect", ckpt, "--json").output)["layout"]
    rows = dry_run_rows(saved_tp)
    assert layout["tp_sizes"] == [tp for tp in range(1, 9) if dry_run_rows(tp) == rows] == [saved_tp]
    accepted = [pp for pp in range(1, 9) if mconv("hf2mcore", TINY, "unused-out", "--pp", pp, "--dry-run").exit_code == 0]
    assert layout["pp_sizes"] == accepted and layout["ep_sizes"] == [1]
    text = mconv("inspect", ckpt).output
    line = next(line for line in text.splitlines() if line.strip().startswith("layout"))
    assert f"TP {saved_tp} (" in line and "PP 1, 2 or 4" in line and "any PP" not in line


def test_merge_names_a_tensor_the_base_model_lacks(tmp_path):
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path, TINY, Layout(), adapter_only=True)
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((TINY / name).read_bytes())
    tensors = load_file(TINY / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_refused(mconv("export-lora", lora, out, "--alpha", 8, "--merge", "--base-model", base), out,
                   "model.layers.0.self_attn.q_proj.weight", "the base model lacks it;")
