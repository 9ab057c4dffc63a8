"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention, routed experts, optional dense layers."""
from types import SimpleNamespace

from mconv.converter.transforms import GLU, REPLICATED, ROW
from mconv.errors import MconvError
from mconv.mappings.common import config_value
from mconv.mappings.qwen3 import ATTENTION, DENSE_MLP, EMBEDDING_AND_OUTPUT, L, H
from mconv.mappings.qwen3 import attention_dims, fp8_projection
from mconv.mappings.qwen3 import megatron_args as qwen3_args
from mconv.mappings.schema import GPT_LOCAL_KEYS, Architecture, Rule, extra_state


def dims(config: dict) -> SimpleNamespace:
    """transformers' `Qwen3MoeConfig`: no head_dim field (hidden // heads when config.json omits
    it) and 4 KV heads by default; `use_sliding_window` with a `sliding_window` makes every layer
    slide, which is refused."""
    d = attention_dims(config, head_dim=None, groups=4)
    if config.get("use_sliding_window") and config.get("sliding_window", 4096) is not None:
        raise MconvError("config.json sets use_sliding_window: every layer uses sliding-window attention, "
                         "which mconv does not map to Megatron-LM's --window-size")
    # transformers 5.x writes num_local_experts, 4.x num_experts.
    d.experts = config.get("num_local_experts") or config_value(config, "num_experts")
    d.moe_ffn = config_value(config, "moe_intermediate_size")
    d.top_k = config_value(config, "num_experts_per_tok")
    d.norm_topk_prob = bool(config.get("norm_topk_prob", False))
    step = config.get("decoder_sparse_step", 1) or 1
    dense_layers = set(config.get("mlp_only_layers") or [])
    d.moe_layers = frozenset(i for i in range(d.layers) if i not in dense_layers and (i + 1) % step == 0)
    return d


def megatron_args(d: SimpleNamespace) -> dict:
    return dict(qwen3_args(d), num_experts=d.experts, moe_ffn_hidden_size=d.moe_ffn, moe_router_topk=d.top_k,
                # Softmax over the top-k logits (pre_softmax False) renormalises like norm_topk_prob;
                # softmax over all experts first (pre_softmax True) keeps the raw probabilities.
                moe_router_pre_softmax=not d.norm_topk_prob, moe_router_score_function="softmax",
                moe_layer_freq=moe_layer_freq(d))


def moe_layer_freq(d: SimpleNamespace) -> int | list[int]:
    """Megatron-LM's --moe-layer-freq: the int 1 when every layer is MoE, else the per-layer list.
    It changes megatron-core's torch_dist keys: a list gives per-layer keys (`decoder.layers.0....`)
    even when all ones, the int stacked ones; the stored args must build the model whose keys the
    checkpoint holds (megatron-core 0.19.2)."""
    flags = [int(i in d.moe_layers) for i in range(d.layers)]
    return 1 if all(flags) else flags


def moe(d, layer):
    return layer in d.moe_layers


E = L + "mlp.experts."
HE = H + "mlp.experts.{expert}."
MOE_MLP = (
    Rule(L + "pre_mlp_layernorm.weight", {H + "post_attention_layernorm.weight": "hidden"}, REPLICATED, when=moe),
    Rule(L + "mlp.router.weight", {H + "mlp.gate.weight": "experts hidden"}, REPLICATED, when=moe),
    # --spec local: SequentialMLP; --spec te: TE grouped GEMM.
    Rule(E + "local_experts.{expert}.linear_fc1.weight", {HE + "gate_proj.weight": "moe_ffn hidden",
                                                          HE + "up_proj.weight": "moe_ffn hidden"}, GLU,
         te=E + "linear_fc1.weight{expert}", group="etp", when=moe),
    Rule(E + "local_experts.{expert}.linear_fc2.weight", {HE + "down_proj.weight": "hidden moe_ffn"}, ROW,
         te=E + "linear_fc2.weight{expert}", group="etp", when=moe),
    extra_state(E + "local_experts.{expert}.linear_fc1", specs=("local",), when=moe),
    extra_state(E + "local_experts.{expert}.linear_fc2", specs=("local",), when=moe),
    extra_state(E + "linear_fc1", specs=("te",), when=moe),
    extra_state(E + "linear_fc2", specs=("te",), when=moe),
)

QWEN3_MOE = Architecture("Qwen3MoeForCausalLM", dims, EMBEDDING_AND_OUTPUT + ATTENTION + DENSE_MLP + MOE_MLP,
                         megatron_args, model_type="qwen3_moe", torch_dist=GPT_LOCAL_KEYS,
                         fp8=fp8_projection)
