"""Megatron-Bridge's own Qwen3.5-VL model on the CPU, for mconv.live's tests (tests/test_qwen3_5_vl.py).

The model is Megatron-Bridge 0.6's `Qwen3VLModel` (modelling_qwen3_vl/model.py), which its Qwen3.5-VL
providers (qwen35_vl_provider.py `provide`) build: its Qwen3-VL vision tower (`vision_model.`) and its
`Qwen3VLGPTModel` (`language_model.`, a megatron-core GPTModel) from the decoder block spec and MTP block
spec the providers pass, megatron-core's `get_transformer_block_with_experimental_attention_variant_spec`
and `get_gpt_mtp_block_spec_for_backend`, here from tests/qwen3_5_oracle.py (its CPU backend, Transformer
Engine's parameter names). Its config is Megatron-LM's `core_transformer_config_from_args` of the args
hf2mcore stores (mrope built as plain RoPE: Megatron-LM's validate_args refuses MTP with mrope; position
embeddings hold no parameters), with the VL fields the model reads set from config.json; it is wrapped in
megatron-core's Float16Module (bfloat16, the checkpoint's dtype), as a bf16 trainer wraps it.

The model builds its vision tower with Transformer Engine's ViT spec (TELayerNormColumnParallelLinear for
`linear_qkv` and `linear_fc1`, TEDotProductAttention, TERowParallelLinear) and TE patch mergers (TENorm,
TEColumnParallelLinear, TERowParallelLinear). Without Transformer Engine these are replaced in that module
by megatron-core's local layers of the same parameter names: a LayerNorm (weight and bias) fused before a
ColumnParallelLinear as `layer_norm_weight` / `layer_norm_bias`, DotProductAttention, Column/RowParallelLinear
and a torch LayerNorm. The parameters are what the test looks at; no forward pass runs.
"""
from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import Parameter

from tests.megatron_oracle import MegatronRun, _assert_same_as, _config_from_args, _cpu_shims, _free_port
from tests.ranks import start_ranks


@dataclass
class Case:
    """One model of a run: its HF directory, hf2mcore's `--spec te` rank files of it at these sizes
    (their stored args configure the model), and where the worker writes what iter_hf_weights yields
    and save_hf_weights' directory."""

    hf_dir: Path
    ranks: Path
    args: argparse.Namespace  # Megatron-LM's validated trainer args of the stored ones, mrope as rope (above)
    out: Path
    tp: int = 1
    pp: int = 1
    ep: int = 1


def _vision_linear():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear with a LayerNorm (the ViT's normalization): the norm's weight
        and bias as `layer_norm_weight` / `layer_norm_bias`, then the linear layer."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            self.norm_eps = config.layernorm_epsilon

        def forward(self, x, *args, **kwargs):
            x = torch.nn.functional.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias,
                                               self.norm_eps)
            return super().forward(x, *args, **kwargs)

    return LayerNormColumnParallelLinear


def _bridge_model_module():
    """Megatron-Bridge's modelling_qwen3_vl/model.py, imported without Transformer Engine (the package
    `__init__`s bypassed as tests/qwen3_vl_oracle.py does), its TE vision modules replaced as the
    module docstring says."""
    import importlib

    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tests.qwen3_vl_oracle import _import_megatron_bridge_mapping

    _import_megatron_bridge_mapping()
    module = importlib.import_module("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    norm_linear = _vision_linear()

    def vit_spec():
        spec = get_vit_layer_with_transformer_engine_spec()
        attention = spec.submodules.self_attention.submodules
        attention.linear_qkv, attention.core_attention, attention.linear_proj = (
            norm_linear, DotProductAttention, RowParallelLinear)
        mlp = spec.submodules.mlp.keywords["submodules"]  # a partial of MLP.as_mlp_submodule
        mlp.linear_fc1, mlp.linear_fc2 = norm_linear, RowParallelLinear
        return spec

    module.get_vit_layer_with_transformer_engine_spec = vit_spec
    module.TENorm, module.TEColumnParallelLinear, module.TERowParallelLinear = (
        WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear)
    return module


def build_model(case: Case):
    """Megatron-Bridge's Qwen3VLModel for this rank's pipeline stage in a Float16Module, as described above
    (the vision tower on the first stage, the MTP block on the last)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoConfig

    from tests.qwen3_5_oracle import block_spec, mtp_spec

    module = _bridge_model_module()
    args = case.args
    config, rotary = _config_from_args(args)
    padded_vocab = args.padded_vocab_size
    hf = AutoConfig.from_pretrained(case.hf_dir)
    text = hf.text_config
    # The fields Megatron-Bridge's provider adds to the TransformerConfig (qwen35_vl_provider.py)
    for name, value in dict(mrope_section=list(text.rope_parameters["mrope_section"]), image_token_id=hf.image_token_id,
                            video_token_id=hf.video_token_id, vision_start_token_id=hf.vision_start_token_id,
                            use_hf_vision_model=False, vocab_size=padded_vocab, should_pad_vocab=False,
                            language_max_sequence_length=text.max_position_embeddings, fp16_lm_cross_entropy=False,
                            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                            rotary_percent=rotary["rotary_percent"], rotary_base=rotary["rotary_base"]).items():
        setattr(config, name, value)
    spec = block_spec(config, 0)
    torch.manual_seed(1234)  # random init must agree across the ranks that replicate a tensor
    mtp = mtp_spec(config, spec, 0) if config.mtp_num_layers else None
    model = module.Qwen3VLModel(language_transformer_config=config, language_transformer_layer_spec=spec,
                                vision_transformer_config=hf.vision_config, pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage(), mtp_block_spec=mtp)
    # As a bf16 trainer wraps it (Megatron-LM, Megatron-Bridge): every parameter in bfloat16, the checkpoint's
    # dtype (the vision tower's config is built apart, in float32), under `module.`
    config.bf16 = True
    return Float16Module(config, model)


def _worker(rank: int, cases: list[Case], port: int, world: int):
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv.live import iter_hf_weights, load_hf_weights, save_hf_weights

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for case in cases:  # one model after another in the same processes
        ps.initialize_model_parallel(case.tp, case.pp, expert_model_parallel_size=case.ep,
                                     expert_tensor_parallel_size=1)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        model = build_model(case)
        load_hf_weights([model], case.hf_dir)
        run = MegatronRun(case.ranks, {}, tp=case.tp, pp=case.pp, ep=case.ep)
        _assert_same_as([model.module], case.ranks, run)  # what hf2mcore writes, bit for bit (no more, no less)
        # every rank the whole model (gather_pp); with PP also its own stage's tensors; MoE: experts stacked too
        for label, options in (("yielded", {"gather_pp": True}), ("stage", {}),
                               ("stacked", {"stacked_experts": True, "gather_pp": True})):
            if label == "stage" and case.pp == 1 or label == "stacked" and case.ep == 1:
                continue
            buckets = [[(name, tensor.clone()) for name, tensor in bucket]
                       for bucket in iter_hf_weights([model], case.hf_dir, bucket_bytes=40_000, **options)]
            torch.save(buckets, case.out / f"{label}{rank}.pt")
        save_hf_weights([model], case.out / "saved", case.hf_dir, max_shard_bytes=200_000)
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def run_live(cases: list[Case], world: int = 2) -> None:
    """Each case in turn in the same `world` gloo processes: the model built, `load_hf_weights` from its HF
    directory (then checked against its rank files), `iter_hf_weights` (every rank the whole model, with
    `gather_pp`; with PP also per stage; per expert, and stacked for a MoE model) and `save_hf_weights`,
    into `case.out`."""
    for case in cases:
        case.out.mkdir(parents=True, exist_ok=True)
    start_ranks(_worker, args=(cases, _free_port(), world), nprocs=world)


os.environ.setdefault("OMP_NUM_THREADS", "1")
