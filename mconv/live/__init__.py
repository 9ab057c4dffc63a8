"""The live-engine API: HF weights into a trainer's sharded Megatron model, and HF-named tensors
out of it at every weight sync, with the same tables, planner and transforms as the offline tools;
and, for the architectures megatron-core builds itself, that model (build_model, transformer_config).

Every function that takes `model_chunks` runs on every rank of the job (they issue collectives),
with megatron-core's parallel_state initialised and `model_chunks` the rank's model chunks (one
per virtual pipeline stage), wrapped or not (DDP / Float16Module `module.` prefixes,
Megatron-Bridge LoRA `.to_wrap.`).
"""
try:
    import megatron.core  # noqa: F401
except ImportError:
    # `from None`: one sentence naming the extra, not megatron's own import chain.
    raise ImportError("mconv.live needs megatron-core: pip install 'mconv[live]'", name="megatron") from None

from mconv.live.chunks import LiveModel  # noqa: E402
from mconv.live.export import DEFAULT_BUCKET_BYTES, iter_hf_weights, save_hf_weights  # noqa: E402
from mconv.live.schedule import clear_cache  # noqa: E402
from mconv.live.load import load_hf_weights  # noqa: E402
from mconv.live.model import build_model, transformer_config  # noqa: E402

__all__ = ["load_hf_weights", "iter_hf_weights", "save_hf_weights", "clear_cache", "LiveModel", "transformer_config",
           "build_model", "DEFAULT_BUCKET_BYTES"]
