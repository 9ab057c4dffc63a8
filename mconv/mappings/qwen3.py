"""Qwen3 dense (`Qwen3ForCausalLM`)."""
from types import SimpleNamespace

from mconv.converter.transforms import GLU, QKV, REPLICATED, ROW, VOCAB
from mconv.errors import MconvError
from mconv.mappings.schema import FIRST, GPT_LOCAL_KEYS, LAST, Architecture, Rule, extra_state, linear
from mconv.mappings.common import config_value, require_silu, rope_args

L, H = "decoder.layers.{layer}.", "model.layers.{layer}."


def attention_dims(config: dict, head_dim: int | None, groups: int | None) -> SimpleNamespace:
    """Qwen3 attention and the fields both Qwen3 configs share. `head_dim` and `groups` are the
    config class's defaults for a config.json without `head_dim` / `num_key_value_heads` (None:
    hidden // heads, and one group per head), as transformers fills them in.

    Forward-pass fields are carried into the Megatron-LM args (rope, norm epsilon, head_dim) or
    refused by name (attention_bias, hidden_act other than silu, rope types megatron-core cannot
    reproduce); sliding windows are checked by each architecture, as the two configs differ."""
    if config.get("attention_bias"):
        raise MconvError("config.json sets attention_bias=true: Megatron-Core has no o_proj bias without "
                         "biases on every linear layer, so this Qwen3 variant has no exact Megatron layout")
    require_silu(config)
    hidden = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    groups = config.get("num_key_value_heads", groups) or heads
    head_dim = config.get("head_dim", head_dim) or hidden // heads
    return SimpleNamespace(
        layers=config_value(config, "num_hidden_layers"), hidden=hidden, heads=heads, groups=groups,
        head_dim=head_dim, q=heads * head_dim, kv=groups * head_dim,
        ffn=config_value(config, "intermediate_size"), vocab=config_value(config, "vocab_size"),
        tied=bool(config.get("tie_word_embeddings", False)),
        norm_eps=config.get("rms_norm_eps", 1e-6), rope=rope_args(config),
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        max_positions=config.get("max_position_embeddings", 32768), experts=0, moe_layers=frozenset())


def dims(config: dict) -> SimpleNamespace:
    """transformers' `Qwen3Config`: head_dim 128 and 32 KV heads when config.json omits them; the
    layers listed as "sliding_attention" in `layer_types` (or, without it, layers from
    `max_window_layers` on when `use_sliding_window` is set) use a sliding window, which is refused."""
    d = attention_dims(config, head_dim=128, groups=32)
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    types = config.get("layer_types") or ["sliding_attention" if window is not None and i >= config.get(
        "max_window_layers", 28) else "full_attention" for i in range(d.layers)]
    sliding = [i for i, kind in enumerate(types) if kind != "full_attention"]
    if sliding:
        field = "layer_types" if config.get("layer_types") else "use_sliding_window"
        raise MconvError(f"config.json's {field} gives layers {sliding} sliding-window attention, "
                         "which mconv does not map to Megatron-LM's --window-size")
    return d


def megatron_args(d: SimpleNamespace) -> dict:
    # --norm-epsilon is stored as norm_epsilon up to Megatron-LM 0.15 and as layernorm_epsilon from 0.16 on.
    return dict(normalization="RMSNorm", norm_epsilon=d.norm_eps, layernorm_epsilon=d.norm_eps, qk_layernorm=True,
                swiglu=True, attention_dropout=d.attention_dropout, add_bias_linear=False, add_qkv_bias=False,
                **d.rope, max_position_embeddings=d.max_positions,
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


def fp8_projection(name: str, d: SimpleNamespace | None = None) -> bool:
    """The Qwen3 FP8 releases' choice (reference fp8.md, 1.3): the language model's q/k/v/o and
    gate/up/down projections are FP8, routed experts included (per expert, or stacked: Qwen3-VL-MoE's
    `mlp.experts.gate_up_proj` / `down_proj`); embeddings, lm_head, norms, the MoE router and a vision
    tower stay 16-bit."""
    return (name.endswith(("_proj.weight", ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
            and not name.startswith("model.visual."))


QWEN3 = Architecture("Qwen3ForCausalLM", dims, EMBEDDING_AND_OUTPUT + ATTENTION + DENSE_MLP, megatron_args,
                     model_type="qwen3", torch_dist=GPT_LOCAL_KEYS, fp8=fp8_projection)
