"""megatron-core's own Qwen3.5 model on the CPU, for the oracle of tests/test_qwen3_5.py.

The decoder block spec is megatron-core's `get_transformer_block_with_experimental_attention_variant_spec`
(the one Megatron-LM, Megatron-Bridge and mbridge build Qwen3.5 with: per-layer gated delta-net or
gated attention from `linear_attention_freq`, dense or MoE MLP from `moe_layer_freq`), and every layer
is megatron-core's own module (GatedDeltaNet, SelfAttention with `attention_output_gate`, MLP,
SequentialMLP experts, SharedExpertMLP). That spec asks Transformer Engine for its modules; without it
(no GPU here) the backend is megatron-core's local one with three stand-ins named as Transformer
Engine's modules are, so the model's parameter names and torch_dist keys are those of a TE model
(reference qwen3-5.md, sections 2.3, 2.4 and 4):

- a zero-centred RMSNorm `x / rms(x) * (1 + w)` (TE's norm with `zero_centered_gamma`; megatron-core's
  torch norm refuses `layernorm_zero_centered_gamma`);
- that norm fused before a ColumnParallelLinear, as `layer_norm_weight` (TELayerNormColumnParallelLinear).

The norms and the core attention carry no `_extra_state` here (Transformer Engine's do, in legacy
rank files), so the `_extra_state` entries of norms are not checked.

GatedDeltaNet needs fla importable; in deterministic mode it runs megatron-core's own torch kernels
(`torch_chunk_gated_delta_rule`, `F.conv1d`) but for fla's Triton l2norm, replaced by its formula.

`wrong_rules` gives what a converter following a wrong rule would write, for the oracle to fail on.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch.nn import Parameter


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


class ZeroCentredNorm(torch.nn.Module):
    """TENorm with zero_centered_gamma, as Transformer Engine's RMSNorm computes it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.weight, self.eps = Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)), eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


def _norm_linear():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear: the zero-centred norm, then the linear layer. (Megatron-Bridge
        tells TE's fused module by this substring of its class name: its `weight` column-parallel, its
        `layer_norm_weight` replicated.)"""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            self.norm_eps = config.layernorm_epsilon

        def forward(self, x, *args, **kwargs):
            return super().forward(_rms(x, self.layer_norm_weight, self.norm_eps), *args, **kwargs)

    return LayerNormColumnParallelLinear


def _backend(config):
    """megatron-core's local backend with the stand-ins above, and GatedDeltaNet's deterministic torch kernels."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import common

    common.HAVE_FLA = True
    common.l2norm = lambda x: x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
    config.deterministic_mode = True
    norm_linear = _norm_linear()

    class Backend(LocalSpecProvider):
        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return ZeroCentredNorm

    return Backend()


def block_spec(config, vp_stage: int):
    """megatron-core's experimental-attention-variant block spec for `config` at `vp_stage`, on the
    CPU backend described above."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    backend = _backend(config)

    def self_attention(config, backend):  # the TE layer spec's attention, from the backend's modules
        norm = backend.layer_norm(rms_norm=True, for_qk=True)
        return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                          submodules=SelfAttentionSubmodules(
                              linear_qkv=backend.column_parallel_layer_norm_linear(),
                              core_attention=backend.core_attention(), linear_proj=backend.row_parallel_linear(),
                              q_layernorm=norm, k_layernorm=norm),
                          metainfo={"fuse_input_layernorm": True})

    specs._get_backend_spec_provider = lambda config: backend
    specs._get_self_attention_module_spec = self_attention
    return specs.get_transformer_block_with_experimental_attention_variant_spec(
        config, vp_stage=vp_stage, pp_rank=ps.get_pipeline_model_parallel_rank())


def mtp_spec(config, spec, vp_stage: int):
    """megatron-core's MTP block spec (`get_gpt_mtp_block_spec_for_backend`, multi_token_prediction.py:
    enorm, hnorm, column-parallel eh_proj, final_layernorm around an inner layer) on the CPU backend,
    its layer the decoder block's last layer spec (a gated full-attention layer with the last layer's
    MLP), as Megatron-Bridge builds it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    return get_gpt_mtp_block_spec_for_backend(config, spec, backend=_backend(config), vp_stage=vp_stage,
                                              pp_rank=ps.get_pipeline_model_parallel_rank())


# Wrong MTP rules a converter could follow, as edits of the HF tensors (a Megatron model converted by the
# wrong rule computes what the reference computes on the edited tensors).
WRONG_MTP = {
    "enorm and hnorm swapped": lambda t: t.update({"mtp.pre_fc_norm_embedding.weight": t["mtp.pre_fc_norm_hidden.weight"],
                                                   "mtp.pre_fc_norm_hidden.weight": t["mtp.pre_fc_norm_embedding.weight"]}),
    "eh_proj input halves swapped": lambda t: t.update({"mtp.fc.weight": torch.cat(t["mtp.fc.weight"].chunk(2, 1)[::-1], 1)}),
}


@torch.no_grad()
def hf_mtp_logits(hf_dir, tokens: list[int], tmp_path) -> dict[str, torch.Tensor]:
    """Logits [1, s, vocab] (fp32) of the HF model's MTP depth computed from transformers' own modules,
    chained as megatron-core 0.19's MultiTokenPredictionLayer chains them (multi_token_prediction.py,
    `_get_embeddings`, `_concat_embeddings`, `_postprocess`): the ids shifted one left (the last zero),
    `fc(cat(pre_fc_norm_embedding(embed(ids)), pre_fc_norm_hidden(h)))` with h the decoder's final-normed
    output, then the MTP layer, `mtp.norm` and the shared output head. The layer and its norm are a
    one-layer model of the HF class (a full-attention decoder layer with the model's MLP, made by
    transformers from `mtp.layers.0.*`, its experts per expert or fused, and `mtp.norm`), loaded by
    transformers' from_pretrained from a copy in `tmp_path`; the rotary positions are 0..s-1, as
    megatron-core passes the decoder's to its MTP block. Keyed "right", then by each WRONG_MTP rule."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_tensors

    main = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tensors = {n: t.float() for n, t in hf_tensors(hf_dir).items()}
    config = copy.deepcopy(main.config)
    layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_only_layers": []}
    config.update({k: v for k, v in layer.items() if hasattr(config, k)})
    mtp_dir = tmp_path / "hf-mtp-layer"
    config.save_pretrained(mtp_dir)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    save_file({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"], "lm_head.weight": tensors[head],
               "model.norm.weight": tensors["mtp.norm.weight"],
               **{"model." + n.removeprefix("mtp."): t for n, t in tensors.items() if n.startswith("mtp.layers.0.")}},
              mtp_dir / "model.safetensors", metadata={"format": "pt"})
    mtp, info = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every MTP layer tensor taken, none missing
    ids = torch.tensor([tokens])
    h = main.model(ids, use_cache=False).last_hidden_state
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    logits = {}
    for rule, edit in {"right": lambda t: None, **WRONG_MTP}.items():
        t = dict(tensors)
        edit(t)
        enorm, hnorm = (type(main.model.norm)(config.hidden_size, eps=config.rms_norm_eps) for _ in range(2))
        enorm.weight.copy_(t["mtp.pre_fc_norm_embedding.weight"])
        hnorm.weight.copy_(t["mtp.pre_fc_norm_hidden.weight"])
        x = torch.cat([enorm(main.model.embed_tokens(shifted)), hnorm(h)], dim=-1) @ t["mtp.fc.weight"].T
        logits[rule] = mtp.eval()(inputs_embeds=x, use_cache=False).logits
    return logits


# Wrong rules a converter could follow for the decoder's layers (reference qwen3-5.md, section 5), by name.
WRONG_RULES = ("delta-net in_proj / conv1d split in one contiguous TP slice",
               "delta-net out_norm copied without the -1", "q / gate read from q_proj blocked, not per head")


def _tp_rows(sections: list[torch.Tensor], contiguous: bool) -> torch.Tensor:
    """This TP rank's rows of a column-parallel tensor made of `sections` (dim 0): each section split over
    TP, or, wrongly, the sections' concatenation split in one contiguous slice."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return torch.cat(sections).chunk(tp)[rank] if contiguous else torch.cat([s.chunk(tp)[rank] for s in sections])


def _linear_qkv(hf: dict, c: dict, prefix: str, blocked: bool) -> torch.Tensor:
    """linear_qkv's rows on this TP rank: per query group [q heads; gate heads; k; v] (megatron-core's
    SelfAttention with attention_output_gate), groups split over TP; q and gate from HF's q_proj
    [2 nq d, h], interleaved per head, or, wrongly, read as [all q; all gate]."""
    nq, ng, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    q = hf[prefix + "q_proj.weight"]
    query, gate = q.view(2, nq, d, -1) if blocked else q.view(nq, 2, d, -1).transpose(0, 1)
    key, value = (hf[prefix + f"{n}_proj.weight"].view(ng, d, -1) for n in "kv")
    heads = [slice(g * nq // ng, (g + 1) * nq // ng) for g in range(ng)]
    return _tp_rows([torch.cat([query[h].flatten(0, 1), gate[h].flatten(0, 1), key[g], value[g]])
                     for g, h in enumerate(heads)], contiguous=True)


def _delta_net_rules(hf: dict, c: dict, prefix: str, attention) -> list:
    """(parameter, rule, rows(wrong)) of a GatedDeltaNet: in_proj [Q; K; V; Z; B; A] and conv1d [Q; K; V]
    sections, each split over TP; out_norm = HF norm - 1 (megatron-core's norm zero-centred, HF's not)."""
    qk, v = (c[f"linear_{kind}_head_dim"] * c[f"linear_num_{kind}_heads"] for kind in ("key", "value"))
    in_proj = [*hf[prefix + "in_proj_qkv.weight"].split([qk, qk, v]), *(hf[prefix + f"in_proj_{n}.weight"]
                                                                          for n in "zba")]
    conv1d, norm = list(hf[prefix + "conv1d.weight"].split([qk, qk, v])), hf[prefix + "norm.weight"]
    return [(attention.in_proj.weight, WRONG_RULES[0], lambda wrong: _tp_rows(in_proj, wrong)),
            (attention.conv1d.weight, WRONG_RULES[0], lambda wrong: _tp_rows(conv1d, wrong)),
            (attention.out_norm.weight, WRONG_RULES[1], lambda wrong: norm if wrong else norm - 1)]


def wrong_rules(hf_dir, chunks: list) -> dict[str, dict]:
    """For each of WRONG_RULES, what a converter following it would have written into this rank's
    decoder parameters (for MegatronRun.wrong_rules), computed from the HF tensors of a
    `Qwen3_5ForCausalLM` directory. Each is computed beside the right rule, which must give the
    parameters megatron-core loaded, bit for bit (so the layouts assumed here are the model's)."""
    from tests.conftest import hf_tensors
    from tests.megatron_oracle import read_config

    hf, c = {n: t.float() for n, t in hf_tensors(hf_dir).items()}, read_config(hf_dir)
    rules: dict[str, dict] = {rule: {} for rule in WRONG_RULES}
    for model in chunks:
        for layer in model.decoder.layers:
            attention, prefix = layer.self_attention, f"model.layers.{layer.layer_number - 1}."
            cases = (_delta_net_rules(hf, c, prefix + "linear_attn.", attention) if hasattr(attention, "in_proj") else
                     [(attention.linear_qkv.weight, WRONG_RULES[2],
                       lambda wrong: _linear_qkv(hf, c, prefix + "self_attn.", wrong))])
            for param, rule, rows in cases:
                assert torch.equal(rows(False), param), f"{prefix}: {rule}: the right rule gives another tensor"
                rules[rule][param] = rows(True)
    return rules


def meta_model(args, dtypes: dict[str, torch.dtype]):
    """megatron-core's GPTModel built from this block spec (and its MTP block, where `args` has MTP
    layers) on the meta device, configured by Megatron-LM from the stored `args` at TP1/PP1, its
    parameters in `dtypes` (by name); for its `sharded_state_dict()` (tests/test_torch_dist_keys.py).
    A VL model's mrope is built as plain RoPE (position embeddings hold no parameters; Megatron-LM's
    validate_args refuses MTP with mrope, which Megatron-Bridge, not Megatron-LM, builds)."""
    from megatron.core.models.gpt import GPTModel

    from tests.megatron_dist_oracle import with_dtypes
    from tests.megatron_oracle import MegatronRun, _config_from_args, trainer_args

    args = argparse.Namespace(**{**vars(args), "position_embedding_type": "rope"})
    config, rotary = _config_from_args(trainer_args(args, MegatronRun(None, {})))
    spec = block_spec(config, 0)
    # GatedDeltaNet puts its A_log and dt_bias on torch.cuda.current_device(): here the meta device.
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: "meta"
    try:
        with torch.device("meta"):
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                             max_sequence_length=args.max_position_embeddings,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                             mtp_block_spec=mtp_spec(config, spec, 0) if config.mtp_num_layers else None, **rotary)
            return with_dtypes(model, dtypes)
    finally:
        torch.cuda.current_device = current_device
