"""The mbridge peer of bench/convert.py: how an mbridge user converts offline.

    python bench/peer_mbridge.py hf2mcore HF_DIR CKPT_DIR     # AutoBridge.load_weights into a GPTModel, then
                                                              # megatron-core dist_checkpointing.save (torch_dist)
    python bench/peer_mbridge.py mcore2hf HF_DIR CKPT_DIR OUT # dist_checkpointing.load into the model, then
                                                              # AutoBridge.save_weights (HF safetensors)

One process, TP1/PP1/EP1, bf16, the model on the GPU as mbridge builds it (`get_model` moves it to
CUDA and wraps it in Float16Module). mbridge builds Transformer Engine layer specs; where
Transformer Engine is absent, megatron-core's local spec is used instead (same tensors and keys
for the non-TE parts, no fused layer norms). `--cpu` runs the same steps on the CPU with the
shims the mconv tests use for megatron-core without a GPU (current_device -> "cpu", no
`.cuda()`), to check this script on a machine without a GPU; its times are not a peer's.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import warnings

import torch

warnings.filterwarnings("ignore")
LOCAL_TO_TE = {r"\.input_layernorm\.weight$": ".self_attention.linear_qkv.layer_norm_weight",
               r"\.pre_mlp_layernorm\.weight$": ".mlp.linear_fc1.layer_norm_weight",
               r"\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$": r".experts.\2.weight\1"}


def cpu_shims() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self


def build(hf_dir: str):
    import torch.distributed as dist
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    on_gpu = torch.cuda.is_available() and "--cpu" not in sys.argv
    if not on_gpu:
        cpu_shims()
    store = tempfile.mkdtemp()
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    if on_gpu:
        model_parallel_cuda_manual_seed(0)
    else:
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    bridge = AutoBridge.from_pretrained(hf_dir)
    if importlib.util.find_spec("transformer_engine") is None:
        def local_spec(vp_stage=None):
            return get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, normalization="RMSNorm",
                                              vp_stage=vp_stage)
        bridge._get_transformer_layer_spec = local_spec
        te_names = bridge._weight_name_mapping_mcore_to_hf

        def hf_names(name: str) -> list[str]:
            """mbridge knows the TE names of the norms only: try them for the local ones."""
            try:
                return te_names(name)
            except NotImplementedError:
                for local, te in LOCAL_TO_TE.items():
                    if re.search(local, name):
                        return te_names(re.sub(local, te, name))
                raise
        bridge._weight_name_mapping_mcore_to_hf = hf_names
        bridge.set_extra_args(persist_layer_norm=False)  # an Apex / TE option the local norms refuse
    if not on_gpu:
        bridge.set_extra_args(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)  # alltoall: CUDA streams
    return bridge, bridge.get_model(wrap_with_ddp=False, bf16=True, use_cpu_initialization=not on_gpu)


def main() -> None:
    from megatron.core import dist_checkpointing

    direction, hf_dir, ckpt = sys.argv[1:4]
    bridge, model = build(hf_dir)
    if direction == "hf2mcore":
        bridge.load_weights(model, hf_dir)
        os.makedirs(ckpt)
        dist_checkpointing.save(model[0].sharded_state_dict(), ckpt)
    else:
        state = dist_checkpointing.load(model[0].sharded_state_dict(), ckpt)
        model[0].load_state_dict(state, strict=False)
        bridge.safetensor_io = bridge._get_safetensor_io(hf_dir)  # the HF names and shard layout to write
        bridge.save_weights(model, sys.argv[4])


if __name__ == "__main__":
    main()
