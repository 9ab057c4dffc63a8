"""Run by test_torch_dist with PYTHONPATH pointing at a megatron-core release (none: the venv's own):
load each mconv torch_dist checkpoint with that release's `dist_checkpointing.load` (strict) into a
new GPTModel, one process, and save the logits of their forward passes (a list, in argument order).
Usage: old_megatron_load.py HF_DIR PADDED_VOCAB OUT CKPT_ITER_DIR..."""
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron_oracle import MegatronRun, _cpu_shims, _transformer_config, read_config  # noqa: E402


def main(hf_dir: str, padded_vocab: str, out: str, *iter_dirs: str) -> None:
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    import megatron.core
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    print(megatron.core.__version__, megatron.core.__file__)
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    run = MegatronRun(Path(iter_dirs[0]), read_config(hf_dir), padded_vocab=0, tokens=list(range(5, 70, 5)))
    config, rope_theta = _transformer_config(run)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    tokens = torch.tensor([run.tokens])
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    logits = []
    for iter_dir in iter_dirs:
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=int(padded_vocab),
                         max_sequence_length=run.hf_config["max_position_embeddings"],
                         share_embeddings_and_output_weights=bool(run.hf_config.get("tie_word_embeddings")),
                         position_embedding_type="rope", rotary_base=rope_theta, parallel_output=False).eval()
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
        model.load_state_dict(loaded["model"], strict=True)
        with torch.no_grad():
            logits.append(model(tokens, torch.arange(seq).unsqueeze(0), mask).float())
    torch.save(logits, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
