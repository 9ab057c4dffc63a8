"""Qwen3 dense (`Qwen3ForCausalLM`)."""
from types import SimpleNamespace

from mconv.converter.transforms import GLU, QKV, REPLICATED, ROW, VOCAB
from mconv.errors import MconvError
from mconv.mappings.schema import FIRST, LAST, Architecture, Rule, extra_state, linear
from mconv.mappings.common import config_value, rope_theta

L, H = "decoder.layers.{layer}.", "model.layers.{layer}."


def dims(config: dict) -> SimpleNamespace:
    if config.get("attention_bias"):
        raise MconvError("config.json sets attention_bias=true: Megatron-Core has no o_proj bias without "
                         "biases on every linear layer, so this Qwen3 variant has no exact Megatron layout")
    hidden = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return SimpleNamespace(
        layers=config_value(config, "num_hidden_layers"), hidden=hidden, heads=heads, groups=groups,
        head_dim=head_dim, q=heads * head_dim, kv=groups * head_dim,
        ffn=config_value(config, "intermediate_size"), vocab=config_value(config, "vocab_size"),
        tied=bool(config.get("tie_word_embeddings", False)),
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=rope_theta(config),
        max_positions=config.get("max_position_embeddings", 4096), experts=0, moe_layers=frozenset())


def megatron_args(d: SimpleNamespace) -> dict:
    return dict(normalization="RMSNorm", norm_epsilon=d.norm_eps, qk_layernorm=True, swiglu=True,
                add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
                rotary_base=d.rope_theta, rotary_percent=1.0, max_position_embeddings=d.max_positions,
                ffn_hidden_size=d.ffn, kv_channels=d.head_dim, num_query_groups=d.groups,
                group_query_attention=d.groups != d.heads)


ATTENTION = (
    Rule(L + "input_layernorm.weight", {H + "input_layernorm.weight": "hidden"}, REPLICATED,
         te=L + "self_attention.linear_qkv.layer_norm_weight"),
    *linear(L + "self_attention.linear_qkv", {H + "self_attn.q_proj.weight": "q hidden",
                                              H + "self_attn.k_proj.weight": "kv hidden",
                                              H + "self_attn.v_proj.weight": "kv hidden"}, QKV),
    Rule(L + "self_attention.q_layernorm.weight", {H + "self_attn.q_norm.weight": "head_dim"}, REPLICATED),
    Rule(L + "self_attention.k_layernorm.weight", {H + "self_attn.k_norm.weight": "head_dim"}, REPLICATED),
    # Transformer Engine 2.x norms (TENorm) carry `_extra_state` too.
    extra_state(L + "self_attention.q_layernorm", specs=("te",)),
    extra_state(L + "self_attention.k_layernorm", specs=("te",)),
    *linear(L + "self_attention.linear_proj", {H + "self_attn.o_proj.weight": "hidden q"}, ROW),
    extra_state(L + "self_attention.core_attention", specs=("te",)),
)

def dense(d, layer):
    return layer not in d.moe_layers


DENSE_MLP = (
    Rule(L + "pre_mlp_layernorm.weight", {H + "post_attention_layernorm.weight": "hidden"}, REPLICATED,
         te=L + "mlp.linear_fc1.layer_norm_weight", when=dense),
    *linear(L + "mlp.linear_fc1", {H + "mlp.gate_proj.weight": "ffn hidden",
                                   H + "mlp.up_proj.weight": "ffn hidden"}, GLU, when=dense),
    *linear(L + "mlp.linear_fc2", {H + "mlp.down_proj.weight": "hidden ffn"}, ROW, when=dense),
)

def embedding_and_output(embedding: str = "model.embed_tokens.weight") -> tuple[Rule, ...]:
    """Embedding, final norm and output layer; `embedding` is the HF name of the word embeddings."""
    return (
        Rule("embedding.word_embeddings.weight", {embedding: "vocab hidden"}, VOCAB, stage=FIRST),
        Rule("decoder.final_layernorm.weight", {"model.norm.weight": "hidden"}, REPLICATED, stage=LAST),
        extra_state("decoder.final_layernorm", stage=LAST, specs=("te",)),
        Rule("output_layer.weight", {"lm_head.weight": "vocab hidden"}, VOCAB, stage=LAST, when=lambda d: not d.tied),
        # Tied embeddings: the last stage of a pipeline keeps its own copy of the embedding.
        Rule("output_layer.weight", {embedding: "vocab hidden"}, VOCAB, stage=LAST,
             when=lambda d: d.tied and d.pp > 1, exported=False),
        extra_state("output_layer", stage=LAST),
    )


EMBEDDING_AND_OUTPUT = embedding_and_output()

QWEN3 = Architecture("Qwen3ForCausalLM", dims, EMBEDDING_AND_OUTPUT + ATTENTION + DENSE_MLP, megatron_args)
