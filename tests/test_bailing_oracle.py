"""Oracle for BailingMoeV3: no library runs this model on CPU, so each side is built from modules we did
not write and the two forwards are compared (fp32 logits).

HF side (in process): transformers' own modules, loaded with the HF tensors. MLA is DeepSeek-V3's
`DeepseekV3Attention` (q-LoRA, kv-LoRA, rope slice, interleave), with Bailing's head-wise gate
`sigmoid(g_proj(x))` applied to its attention output before `o_proj` (= HF `dense`); the MoE block is
`DeepseekV3MoE` (sigmoid router with the correction bias, group-limited top-k, shared experts); dense
MLPs are `DeepseekV3MLP`; KDA is Kimi Linear's `KimiLinearDeltaAttention` (same q/k/v, short convolutions,
`b_proj`, gated `o_norm`, `o_proj` and its pure-torch chunk kernel) with Bailing's decay gate
(`kda_safe_gate`: `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`) and, with `no_kda_lora`, the
full-rank `f_proj`/`g_proj` (reference/bailing-v3.md, forward semantics).

Megatron side (gloo processes, one per rank): megatron-core's `GPTModel` with one layer spec per layer
(megatron-core's local spec for MLA, dense MLP and MoE with `SequentialMLP` experts, the `allgather`
dispatcher and the sigmoid/expert-bias/grouped router), configured from the args hf2mcore stored,
loading the rank file hf2mcore wrote with `strict=True`. Two test-only pieces: a CPU core attention
(the local `DotProductAttention` rejects MLA's k/v channels) and AReaL's head-wise gate (a
`linear_gate` column-parallel linear applied by a pre-hook on `linear_proj`, as AReaL's
`BailingV3MLASelfAttention` does); and, as megatron-core has no KDA, a KDA module holding AReaL's fused
per-rank parameters (`in_proj` sections `[q, k, v, f, g]`, `conv1d` `[q, k, v]`, heads split by TP)
that calls the same Kimi Linear kernel.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from fixtures.make_fixtures import make_bailing_v3
from mconv import Layout, hf2mcore
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.transforms import Kind, Piece, ShardLayout
from mconv.mappings import bailing_v3
from tests.conftest import load_rank_file
from tests.megatron_oracle import _cpu_shims, _free_port, read_config
from tests.ranks import start_ranks

TOKENS = list(range(5, 200, 13))


def _decay(f, A_log, dt_bias, lower_bound, head_dim):
    """Bailing's safe KDA decay gate, per channel: [b, s, heads * head_dim] -> [b, s, heads, head_dim]."""
    f = (f.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * f)


# ----------------------------------------------------------------------------------------- HF side

class _BailingDecay(torch.nn.Module):
    def __init__(self, tensors, prefix, config):
        super().__init__()
        self.t, self.prefix, self.c = tensors, prefix, config

    def forward(self, x):
        t, p = self.t, self.prefix
        f = (x @ t[p + "f_proj.weight"].T if self.c["no_kda_lora"]
             else x @ t[p + "f_a_proj.weight"].T @ t[p + "f_b_proj.weight"].T)
        return _decay(f, t[p + "A_log"], t[p + "dt_bias"], self.c["kda_lower_bound"], self.c["head_dim"])


def _linear(weight):
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


def _hf_kda(c, tensors, p):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = KimiLinearConfig(hidden_size=c["hidden_size"], linear_attn_config={
        "num_heads": c["num_attention_heads"], "head_dim": c["head_dim"],
        "short_conv_kernel_size": c["short_conv_kernel_size"], "kda_layers": [1], "full_attn_layers": []},
        num_hidden_layers=1, rms_norm_eps=c["rms_norm_eps"], hidden_act="silu")
    kda = KimiLinearDeltaAttention(config, 0)
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm"):
        getattr(kda, name).weight.data.copy_(tensors[p + name + ".weight"])
    kda.conv1d.weight.data.copy_(torch.cat([tensors[p + f"{x}_conv1d.weight"] for x in "qkv"]))
    kda.forget_gate = _BailingDecay(tensors, p, c)
    if c["no_kda_lora"]:
        kda.g_a_proj, kda.g_b_proj = _linear(tensors[p + "g_proj.weight"]), torch.nn.Identity()
    else:
        kda.g_a_proj, kda.g_b_proj = _linear(tensors[p + "g_a_proj.weight"]), _linear(tensors[p + "g_b_proj.weight"])
    return kda


def _deepseek_config(c):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=1, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"], n_shared_experts=c["num_shared_experts"],
        n_routed_experts=c["num_experts"], routed_scaling_factor=c["routed_scaling_factor"],
        kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c["q_lora_rank"], qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"], qk_nope_head_dim=c["qk_nope_head_dim"], n_group=c["n_group"],
        topk_group=c["topk_group"], num_experts_per_tok=c["num_experts_per_tok"], norm_topk_prob=True,
        rms_norm_eps=c["rms_norm_eps"], rope_interleave=c["rope_interleave"], attention_bias=False,
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={"rope_theta": c["rope_theta"], "rope_type": "default",
                         **{k.replace("type", "rope_type"): v for k, v in (c["rope_scaling"] or {}).items()}})
    config._attn_implementation = "eager"
    return config


class HFReference(torch.nn.Module):
    """BailingMoeV3's forward from transformers' DeepSeek-V3 and Kimi Linear modules (fp32). MTP layers
    (HF layers L + j) are computed as megatron-core's MTP block chains them (multi_token_prediction.py):
    depth j takes the ids shifted j + 1 left (zero-filled) and the previous depth's output (the decoder's
    final-normed output for j = 0): `final_layernorm(layer(eh_proj(cat(enorm(embed(ids)), hnorm(h)))))`."""

    def __init__(self, hf_dir: Path):
        super().__init__()
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        self.ds = ds
        c = self.c = read_config(hf_dir)
        ckpt = HFCheckpoint(hf_dir)
        t = self.t = {name: ckpt.read(name).float() for name in ckpt.tensors}
        self.ds_config = _deepseek_config(c)
        self.embed = t["model.word_embeddings.weight"]
        self.head = t["model.word_embeddings.weight" if c["tie_word_embeddings"] else "lm_head.weight"]
        self.rope = ds.DeepseekV3RotaryEmbedding(self.ds_config)
        layers, mtp = c["num_hidden_layers"], c["num_nextn_predict_layers"]
        mla_layers = bailing_v3._layer_kinds(layers, c["layer_group_size"])
        self.layers = [self._layer(i, i in mla_layers) for i in range(layers)]
        self.norm = self._norm("model.norm.weight")
        # An MTP layer is MLA (the HF tail-group rule) and MoE past first_k_dense_replace.
        self.mtp = [dict(enorm=self._norm(f"model.layers.{i}.enorm.weight"),
                         hnorm=self._norm(f"model.layers.{i}.hnorm.weight"), eh_proj=t[f"model.layers.{i}.eh_proj.weight"],
                         layer=self._layer(i, True), final=self._norm(f"model.layers.{i}.final_layernorm.weight"))
                    for i in range(layers, layers + mtp)]

    def _norm(self, name):
        module = self.ds.DeepseekV3RMSNorm(self.t[name].shape[0], eps=self.c["rms_norm_eps"])
        module.weight.data.copy_(self.t[name])
        return module

    def _layer(self, i: int, is_mla: bool):
        ds, c, t, ds_config = self.ds, self.c, self.t, self.ds_config
        p, a = f"model.layers.{i}.", f"model.layers.{i}.attention."
        if is_mla:
            attn = ds.DeepseekV3Attention(ds_config, 0)
            renames = {"o_proj": "dense"}
            for name, param in attn.named_parameters():
                module, _, leaf = name.rpartition(".")
                param.data.copy_(t[a + renames.get(module, module) + "." + leaf])
            gate = t[a + "g_proj.weight"]
            heads = c["num_attention_heads"]

            def gated(module, args, gate=gate, heads=heads, holder={}):  # Bailing's head-wise gate
                out = args[0].unflatten(-1, (heads, -1)) * torch.sigmoid(holder["x"] @ gate.T)[..., None]
                return (out.flatten(-2),)
            attn.o_proj.register_forward_pre_hook(gated)
            attn.gate_input = gated.__defaults__[2]
        else:
            attn = _hf_kda(c, t, a)
        if i < c["first_k_dense_replace"]:
            mlp = ds.DeepseekV3MLP(ds_config)
            for x in ("gate_proj", "up_proj", "down_proj"):
                getattr(mlp, x).weight.data.copy_(t[p + f"mlp.{x}.weight"])
        else:
            mlp = ds.DeepseekV3MoE(ds_config)
            mlp.gate.weight.data.copy_(t[p + "mlp.gate.weight"])
            mlp.gate.e_score_correction_bias.copy_(t[p + "mlp.gate.expert_bias"])
            for e in range(c["num_experts"]):
                ex = p + f"mlp.experts.{e}."
                mlp.experts.gate_up_proj.data[e].copy_(torch.cat([t[ex + "gate_proj.weight"], t[ex + "up_proj.weight"]]))
                mlp.experts.down_proj.data[e].copy_(t[ex + "down_proj.weight"])
            for x in ("gate_proj", "up_proj", "down_proj"):
                getattr(mlp.shared_experts, x).weight.data.copy_(t[p + f"mlp.shared_experts.{x}.weight"])
        return (self._norm(p + "input_layernorm.weight"), attn, is_mla, self._norm(p + "post_attention_layernorm.weight"),
                mlp)

    @staticmethod
    def _apply(layer, x, cos_sin, mask):
        in_norm, attn, is_mla, post_norm, mlp = layer
        h = in_norm(x)
        if is_mla:
            attn.gate_input["x"] = h
            out = attn(h, cos_sin, mask)[0]
        else:
            out = attn(h)
        x = x + out
        return x + mlp(post_norm(x))

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Logits [1, s, vocab], then those of each MTP depth."""
        ids = torch.tensor([tokens])
        x = self.embed[ids]
        seq = ids.shape[1]
        cos_sin = self.rope(x, torch.arange(seq)[None])
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            x = self._apply(layer, x, cos_sin, mask)
        h = self.norm(x)
        logits = [h @ self.head.T]
        for depth in self.mtp:
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            x = torch.cat([depth["enorm"](self.embed[ids]), depth["hnorm"](h)], -1) @ depth["eh_proj"].T
            h = depth["final"](self._apply(depth["layer"], x, cos_sin, mask))
            logits.append(h @ self.head.T)
        return torch.cat(logits)


# ---------------------------------------------------------------------------------- Megatron side

def _megatron_classes():
    """Test-only modules for megatron-core (defined lazily: megatron-core imports in the workers only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    class CPUCoreAttention(MegatronModule):
        """Causal softmax attention on [s, b, heads, d] (megatron-core's local DotProductAttention
        refuses MLA's separate k/v head sizes)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                     k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config)
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
            scores = (q @ k.transpose(-1, -2)) * self.scale
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            out = scores.softmax(-1) @ v  # [b, heads, s, dv]
            return out.permute(2, 0, 1, 3).flatten(2)

    class GatedMLA(MLASelfAttention):
        """AReaL's BailingV3MLASelfAttention: MLA plus a column-parallel `linear_gate [heads, hidden]`
        applied head-wise by a forward pre-hook on `linear_proj`."""

        def __init__(self, config, submodules, layer_number, **kwargs):
            super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
            self.linear_gate = ColumnParallelLinear(config.hidden_size, config.num_attention_heads, config=config,
                                                   init_method=config.init_method, gather_output=False, bias=False)
            self._gate_input = None
            self.linear_proj.register_forward_pre_hook(self._gate)

        def _resolve_qk_norm_config(self, submodules):
            if self.config.q_lora_rank is not None:
                return super()._resolve_qk_norm_config(submodules)
            # Without q-LoRA, megatron-core 0.17 (AReaL's pin) builds linear_q_proj from the spec as it
            # is, with no norm; 0.19 insists on a fused norm+linear there, which the HF model has not.
            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                        kv_layernorm=submodules.kv_layernorm)

        def _gate(self, module, args):
            gate = torch.sigmoid(self.linear_gate(self._gate_input)[0].float())
            out = args[0]
            return ((out.unflatten(-1, (gate.shape[-1], -1)) * gate[..., None]).flatten(-2),) + tuple(args[1:])

        def forward(self, hidden_states, *args, **kwargs):
            self._gate_input = hidden_states
            return super().forward(hidden_states, *args, **kwargs)

    class AReaLKDA(MegatronModule):
        """KDA over AReaL's per-rank KimiDeltaAttention parameters: `in_proj` = this rank's
        `[q_r; k_r; v_r; f_r; g_r]`, `conv1d` = `[q_r; k_r; v_r]` (kda_attention.py's split order),
        `beta_proj`, `A_log`, `dt_bias` split by heads, `out_norm [head_dim]`, row-parallel `out_proj`;
        without no_kda_lora, f_r and g_r are the rank's rows of the low-rank f_a/g_a outputs, gathered
        before the column-parallel `f_b_proj`/`g_b_proj`."""

        def __init__(self, config, submodules=None, layer_number=None, *, head_dim, conv_kernel, lora, lower_bound,
                     **kwargs):
            super().__init__(config)
            tp = ps.get_tensor_model_parallel_world_size()
            h, heads = config.hidden_size, config.num_attention_heads
            self.d, self.lora, self.lower_bound, self.heads = head_dim, lora, lower_bound, heads // tp
            p = heads * head_dim
            fg = head_dim if lora else p
            self.sections = [p // tp, p // tp, p // tp, fg // tp, fg // tp]
            common = dict(config=config, init_method=config.init_method, bias=False)
            self.in_proj = ColumnParallelLinear(h, 3 * p + 2 * fg, gather_output=False, **common)
            self.beta_proj = ColumnParallelLinear(h, heads, gather_output=False, **common)
            if lora:
                self.f_b_proj = ColumnParallelLinear(head_dim, p, gather_output=False, **common)
                self.g_b_proj = ColumnParallelLinear(head_dim, p, gather_output=False, **common)
            self.conv1d = torch.nn.Conv1d(3 * p // tp, 3 * p // tp, conv_kernel, groups=3 * p // tp, bias=False,
                                          padding=conv_kernel - 1)
            self.A_log = torch.nn.Parameter(torch.empty(heads // tp))
            self.dt_bias = torch.nn.Parameter(torch.empty(p // tp))
            self.out_norm = WrappedTorchNorm(config, head_dim, eps=config.layernorm_epsilon)
            self.out_proj = RowParallelLinear(p, h, input_is_parallel=True, skip_bias_add=True, **common)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            s, b, _ = hidden_states.shape
            q, k, v, f, g = self.in_proj(hidden_states)[0].split(self.sections, dim=-1)
            if self.lora:
                f = self.f_b_proj(gather_from_tensor_model_parallel_region(f))[0]
                g = self.g_b_proj(gather_from_tensor_model_parallel_region(g))[0]
            qkv = torch.cat([q, k, v], -1).permute(1, 2, 0)  # [b, channels, s]
            qkv = F.silu(self.conv1d(qkv)[..., :s]).permute(0, 2, 1)  # [b, s, channels]
            q, k, v = (x.unflatten(-1, (self.heads, self.d)) for x in qkv.chunk(3, dim=-1))
            beta = torch.sigmoid(self.beta_proj(hidden_states)[0].float()).transpose(0, 1)
            decay = _decay(f.transpose(0, 1), self.A_log, self.dt_bias, self.lower_bound, self.d)
            out, _ = chunk_kimi_delta_attention(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
            gate = g.transpose(0, 1).unflatten(-1, (self.heads, self.d))
            out = self.out_norm(out.float()) * torch.sigmoid(gate.float())
            return self.out_proj(out.flatten(2).transpose(0, 1).contiguous())

    return CPUCoreAttention, GatedMLA, AReaLKDA


def _core_config(args, tp, ep, pp=1, vpp=1):
    """megatron-core's MLATransformerConfig from the Megatron-LM args hf2mcore stored (the names
    Megatron-LM's core_transformer_config_from_args maps)."""
    from megatron.core.transformer import MLATransformerConfig

    a = vars(args)
    same = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
            "normalization", "qk_layernorm", "add_bias_linear", "add_qkv_bias", "multi_latent_attention",
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_base",
            "rotary_percent", "rope_type", "rotary_scaling_factor", "moe_ffn_hidden_size", "moe_router_topk",
            "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
            "moe_router_dtype", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
            "moe_shared_expert_intermediate_size", "moe_layer_freq", "mtp_num_layers")
    yarn = {k: a[k] for k in ("mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
                              "beta_slow") if k in a}
    return MLATransformerConfig(
        **{k: a.get(k) for k in same}, **yarn, num_moe_experts=a["num_experts"], layernorm_epsilon=a["norm_epsilon"],
        gated_linear_unit=a["swiglu"], activation_func=F.silu, moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", attention_dropout=0.0, hidden_dropout=0.0,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
        apply_rope_fusion=False, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32,
        expert_tensor_parallel_size=1)


def bailing_model(config, c: dict, padded_vocab: int, vp_stage: int | None = None):
    """megatron-core's GPTModel for this pipeline stage (and virtual chunk `vp_stage`): one local layer spec
    per layer (AReaLKDA or GatedMLA with the CPU core attention; dense MLP or MoE by moe_layer_freq), and
    with `config.mtp_num_layers` the MTP block megatron-core builds from the last decoder layer's spec."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    CPUCoreAttention, GatedMLA, AReaLKDA = _megatron_classes()
    kda = ModuleSpec(module=AReaLKDA, params=dict(head_dim=c["head_dim"], conv_kernel=c["short_conv_kernel_size"],
                                                  lora=not c["no_kda_lora"], lower_bound=c["kda_lower_bound"]))
    specs = []
    for i, moe in enumerate(config.moe_layer_freq):
        mla = not bailing_v3.kda(bailing_v3.dims(c), i)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts if moe else None, qk_layernorm=True,
                                        multi_latent_attention=mla, normalization="RMSNorm")
        if mla:
            spec.submodules.self_attention.module = GatedMLA
            spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
            if config.q_lora_rank is None:  # megatron-core refuses a q norm it would not use
                spec.submodules.self_attention.submodules.q_layernorm = IdentityOp
        else:
            spec.submodules.self_attention = kda
        specs.append(spec)
    # MTP (hf2mcore --mtp): megatron-core's MTP block, its inner layer from the last decoder layer's spec.
    mtp_spec = (get_gpt_mtp_block_spec(config, TransformerBlockSubmodules(specs), use_transformer_engine=False,
                                       vp_stage=vp_stage) if config.mtp_num_layers else None)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    stage = specs[offset: offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return GPTModel(config=config, transformer_layer_spec=TransformerBlockSubmodules(stage, layer_norm=WrappedTorchNorm),
                    mtp_block_spec=mtp_spec, vocab_size=padded_vocab, max_sequence_length=c["max_position_embeddings"],
                    share_embeddings_and_output_weights=c["tie_word_embeddings"], position_embedding_type="rope",
                    rotary_base=config.rotary_base, parallel_output=False, vp_stage=vp_stage,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)).eval()


def _worker(rank: int, checkpoint: Path, hf_config: dict, tp: int, ep: int, port: int, out: Path,
            live_hf: Path | None):
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=max(tp, ep))
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.checkpointing import get_checkpoint_name

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    path = get_checkpoint_name(str(checkpoint), 0, True, expert_parallel=ep > 1,
                               expert_rank=ps.get_expert_model_parallel_rank())
    state = load_rank_file(path, map_location="cpu")
    config = _core_config(state["args"], tp, ep)
    c = hf_config
    model = bailing_model(config, c, state["args"].padded_vocab_size)
    mtp_hidden = []
    if config.mtp_num_layers:  # the block's output: [decoder output; depth 1; ...] on the sequence dim
        model.mtp.register_forward_hook(lambda module, args, output: mtp_hidden.append(output))
    if live_hf is None:
        model.load_state_dict(state["model"], strict=True)
    else:
        from mconv.live import iter_hf_weights, load_hf_weights

        load_hf_weights([model], live_hf)
    tokens = torch.tensor([TOKENS])
    mask = torch.ones(1, 1, len(TOKENS), len(TOKENS), dtype=torch.bool).triu(1)
    with torch.no_grad():
        logits = model(tokens, torch.arange(len(TOKENS))[None], mask)
        for hidden in mtp_hidden[0].chunk(1 + config.mtp_num_layers)[1:] if mtp_hidden else ():
            weight = model.shared_embedding_or_output_weight() if c["tie_word_embeddings"] else None
            logits = torch.cat([logits, model.output_layer(hidden, weight=weight)[0].transpose(0, 1)])
    exported = None if live_hf is None else [  # as the model holds them, and cast to bfloat16
        {name: tensor.clone() for bucket in iter_hf_weights([model], live_hf, bucket_bytes=100_000, dtype=dtype)
         for name, tensor in bucket} for dtype in (None, torch.bfloat16)]
    if rank == 0:
        torch.save((logits[..., : c["vocab_size"]], exported), out)
    dist.barrier()
    dist.destroy_process_group()


def megatron_run(checkpoint: Path, hf_dir: Path, tp: int, ep: int, workdir: Path, live: bool = False):
    """(logits, None) of megatron-core's forward on the rank files ([1 + MTP depths, s, vocab]: the
    model's, then each MTP depth's through the output layer); with `live`, the model is loaded by
    mconv.live.load_hf_weights from `hf_dir` instead, and the second item is what iter_hf_weights yields
    (without a dtype, and with dtype=bfloat16)."""
    out = workdir / "logits.pt"
    start_ranks(_worker, args=(checkpoint, read_config(hf_dir), tp, ep, _free_port(), out,
                               hf_dir if live else None), nprocs=max(tp, ep))
    return torch.load(out)


def _max_difference(tmp_path: Path, hf_dir: Path, tp: int, ep: int, edit=None) -> float:
    """Max |logit difference| relative to the largest logit (about 4 here); `edit(state)` changes every
    rank file before megatron-core loads it."""
    mtp = bool(read_config(hf_dir)["num_nextn_predict_layers"])
    hf2mcore(hf_dir, tmp_path / "m", Layout(tp=tp, ep=ep), spec="local", fmt="torch", progress=False, mtp=mtp)
    for path in (tmp_path / "m").glob("release/*/model_optim_rng.pt") if edit else ():
        state = load_rank_file(path)
        edit(state["model"])
        torch.save(state, path)
    ours, _ = megatron_run(tmp_path / "m", hf_dir, tp, ep, tmp_path)
    reference = HFReference(hf_dir)(TOKENS)
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bailing-oracle")
    # Every layer kind: 0 KDA+dense, 1 MLA+dense, 2 KDA+MoE, 3 MLA+MoE (BAILING_V3 in make_fixtures).
    return {"default": make_bailing_v3(tmp / "a", seed=7, dtype=torch.float32, tokenizer=False),
            "yarn": make_bailing_v3(tmp / "c", seed=9, dtype=torch.float32, tokenizer=False, rope_scaling={
                "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
                "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
            "kda-lora-no-q-lora": make_bailing_v3(tmp / "b", seed=8, dtype=torch.float32, tokenizer=False,
                                                   no_kda_lora=False, q_lora_rank=None, tie_word_embeddings=True)}


@pytest.mark.slow
@pytest.mark.parametrize("model,tp,ep", [("default", 1, 1), ("default", 2, 2), ("kda-lora-no-q-lora", 2, 1),
                                         ("yarn", 1, 1)])
def test_megatron_core_forward_matches_transformers_modules(tmp_path, models, model, tp, ep):
    assert _max_difference(tmp_path, models[model], tp, ep) < 1e-5


@pytest.mark.slow
def test_live_load_and_export(tmp_path, models):
    """mconv.live on this table: load_hf_weights into megatron-core's model (TP2, EP2) gives the HF
    forward; iter_hf_weights yields every HF tensor bit-identically, and with dtype=bfloat16 what
    transformers loads with that dtype (the tensors the model keeps in float32 in float32)."""
    from tests.test_fp32_kept import bailing_fp32_modules, transformers_cast
    from tests.test_roundtrip import assert_bit_identical, read_all

    hf_dir = models["default"]
    hf2mcore(hf_dir, tmp_path / "m", Layout(tp=2, ep=2), fmt="torch", progress=False)  # only its args are used
    logits, (exported, cast) = megatron_run(tmp_path / "m", hf_dir, 2, 2, tmp_path, live=True)
    reference = HFReference(hf_dir)(TOKENS)
    assert ((logits - reference).abs().max() / reference.abs().max()).item() < 1e-5
    assert_bit_identical(read_all(hf_dir), exported)
    assert_bit_identical(transformers_cast(hf_dir, torch.bfloat16, bailing_fp32_modules()), cast)


def _contiguous(shapes, rank, size, params):
    # The wrong TP rule: a contiguous slice of the concatenated sections, not each section split on its own.
    total = sum(s[0] for s in shapes)
    start, stop, pieces, offset = rank * total // size, (rank + 1) * total // size, [], 0
    for i, s in enumerate(shapes):
        lo, hi = max(start, offset), min(stop, offset + s[0])
        if hi > lo:
            pieces.append(Piece(i, lo - offset, hi - offset))
        offset += s[0]
    return ShardLayout(0, tuple(pieces))


def _swap_f_and_g(rule):
    names = list(rule.hf.items())
    names[3], names[4] = names[4], names[3]
    return dict(names)


WRONG = {
    "kda sections swapped": (1, lambda r: r.megatron.endswith("in_proj.weight"),
                             lambda r: {"hf": _swap_f_and_g(r)}),
    "kda in_proj split as one column": (2, lambda r: r.megatron.endswith("in_proj.weight"),
                                        lambda r: {"kind": Kind("contiguous", _contiguous, sources=None)}),
    "MLA gate not split by heads": (2, lambda r: r.megatron.endswith("linear_gate.weight"),
                                    lambda r: {"kind": bailing_v3.DUPLICATED}),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_mapping_fails_the_oracle(tmp_path, models, monkeypatch, wrong):
    import dataclasses

    from mconv import mappings

    tp, match, change = WRONG[wrong]
    arch = bailing_v3.BAILING_V3
    rules = tuple(dataclasses.replace(r, **change(r)) if match(r) else r for r in arch.rules)
    assert sum(map(match, arch.rules)) >= 1
    monkeypatch.setitem(mappings.ARCHITECTURES, arch.name, dataclasses.replace(arch, rules=rules))
    try:
        difference = _max_difference(tmp_path, models["default"], tp, 1)
    except mp.ProcessRaisedException as e:  # megatron-core's strict load refuses the shapes
        assert "size mismatch" in str(e)
        return
    assert difference > 1e-3, difference


@pytest.mark.slow
def test_a_missing_expert_bias_fails_the_oracle(tmp_path, models):
    # What a converter that does not map mlp.gate.expert_bias leaves: megatron-core's initial zeros.
    def zero_bias(model):
        for name, tensor in model.items():
            if name.endswith("router.expert_bias"):
                tensor.zero_()
    assert _max_difference(tmp_path, models["default"], 1, 1, zero_bias) > 1e-3
