"""The vocabulary of the architecture tables.

A table is a list of `Rule`s. A rule names one Megatron tensor (a template with `{layer}` for
per-layer tensors and `{expert}` for per-expert ones), the HF tensors it is made of (templates with their shapes, written as
space-separated names of model dimensions), and the transform kind that relates them. Tensors
outside the layers that come in numbered copies (a vision tower's blocks) name their index in
`repeat`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable

from mconv.converter.transforms import COLUMN, EXTRA_STATE, REPLICATED, VOCAB, Kind

FIRST, LAST = "first", "last"  # pipeline placement of non-layer tensors


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: dict[str, str]  # HF name template -> shape, e.g. {"model.norm.weight": "hidden"}
    kind: Kind
    te: str | None = None  # the Megatron name under the Transformer Engine spec, where it differs
    when: Callable[..., bool] | None = None  # applies only where when(dims) / when(dims, layer) holds
    stage: str | None = None  # FIRST or LAST for tensors outside the layers
    group: str = "tp"  # which parallel group splits it: "tp" (or "etp" for experts)
    exported: bool = True  # False for copies (the tied output layer): mcore2hf takes the original
    specs: tuple[str, ...] = ("local", "te")
    # Non-layer rules repeated over an index: (template field, dims attribute with the count),
    # e.g. ("block", "vision_layers") for `vision_model.decoder.layers.{block}.`. A third item, a dims
    # attribute, makes the copies layers kept outside the decoder (MTP): copy j is HF layer
    # `{layer}` = that attribute + j, and `when` takes (dims, layer) as a layer rule's does.
    repeat: tuple[str, ...] | None = None
    # The dims attributes a fused QKV rule takes its (heads, query groups, head_dim) from.
    qkv_dims: tuple[str, str, str] = ("heads", "groups", "head_dim")
    # torch_dist: a fused tensor stored as one global tensor per HF section, its key suffixed with
    # these names (e.g. AReaL's KimiDeltaAttention `in_proj.weight.query`); see converter/torch_dist.py.
    dist_sections: tuple[str, ...] = ()
    # The model keeps it in float32 whatever the dtype of the rest (transformers'
    # `_keep_in_fp32_modules_strict`, megatron-core's router `expert_bias`): a cast (--dtype, `dtype=`)
    # writes it in float32, not in the dtype asked for (converter/transforms.cast_dtype).
    fp32: bool = False

    def megatron_name(self, spec: str) -> str:
        return self.te if spec == "te" and self.te else self.megatron

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron


@dataclass(frozen=True)
class DistKeys:
    """How a torch_dist checkpoint names an architecture's tensors, beyond the conventions of every
    megatron-core model (converter/torch_dist.py): `keys_map` is the layer spec's
    `sharded_state_dict_keys_map` (a local-spec name prefix inside a decoder layer -> its key prefix,
    the first match applies); `te_names` says the keys are the rules' Transformer Engine names instead
    (a model megatron-core builds with TE only), routed experts excepted (SequentialMLP's keys, which
    TE's grouped experts share); `per_layer` says the decoder layers differ from each other, so their keys
    are always per layer (`decoder.layers.{i}.`), never stacked; `check(dims)` raises MconvError for
    a model the trainer's Megatron model class cannot build (so no checkpoint of it can be loaded);
    `tower` is the name prefix of a vision tower built from its own homogeneous config (Megatron-Bridge's
    Qwen3.5-VL): its numbered blocks are stacked whatever the decoder layers are, and it keeps the
    local-spec names (as Qwen3-VL's tower does) where `te_names` renames the rest."""

    keys_map: tuple[tuple[str, str], ...] = ()
    per_layer: bool = False
    te_names: bool = False
    check: Callable[[SimpleNamespace], None] | None = None
    tower: str | None = None


# megatron-core's local GPT layer spec (get_gpt_layer_local_submodules, megatron-core 0.19.2): the
# norms take the names they have fused into the next linear under Transformer Engine.
GPT_LOCAL_KEYS = DistKeys(keys_map=(("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                                    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")))


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json architectures[0]
    dims: Callable[[dict], SimpleNamespace]  # config.json -> model dimensions used by shapes and params
    rules: tuple[Rule, ...]
    megatron_args: Callable[[SimpleNamespace], dict] = field(default=lambda d: {})  # Megatron-LM args
    model_type: str | None = None  # config.json model_type whose CausalLM class (transformers' auto mapping) this is
    # Extra layout checks of the architecture (dims, layout) -> None, raising MconvError.
    check_layout: Callable | None = None
    # HF keeps routed experts stacked (`mlp.experts.gate_up_proj` / `down_proj`, transformers'
    # Qwen3-VL-MoE): the table names them per expert and the HF writer stacks them.
    stacked_experts: bool = False
    # The orientations (hf_experts.ORIENTATIONS) transformers loads stacked experts of this model in, the
    # default first.
    expert_orientations: tuple[str, ...] = ("4.x", "5.x")
    # transformers loads this model's experts stacked or per expert alike: mcore2hf writes them in the
    # form hf2mcore's input had (mconv.json's `hf_experts`), stacked by default.
    experts_as_input: bool = False
    # config.json as mcore2hf writes it, from the model's config and the converted model's dims (e.g.
    # with the keys of both transformers 4.x and 5.x, or without the layers the checkpoint lacks).
    hf_config: Callable[[dict, SimpleNamespace], dict] = field(default=lambda config, d: config)
    # HF tensors the Megatron layout has no place for: {HF name prefix: why}; hf2mcore leaves them out
    # and says so (mcore2hf cannot bring them back).
    dropped: Callable[[SimpleNamespace], dict[str, str]] = field(default=lambda d: {})
    # How torch_dist keys are named (None: no torch_dist checkpoint for this architecture).
    torch_dist: DistKeys | None = None
    # Why megatron-core cannot build this model itself, naming the bridge that can (None: its GPTModel
    # can; mconv.live.build_model builds it).
    needs_bridge: str | None = None
    # Which HF weights its block-wise FP8 releases store in FP8 (the others stay 16-bit), given the
    # HF name and the model's dims (where a name's layer kind decides); None: mconv does not write FP8
    # for it (`mcore2hf --quantize fp8` refuses).
    fp8: Callable[[str, SimpleNamespace], bool] | None = None

    def fp32_kind(self, hf_name: str) -> str | None:
        """For an HF tensor the table keeps in float32 (Rule.fp32), its kind: the name past the
        layer (and expert) indices, e.g. `mlp.gate.expert_bias`; None for any other tensor."""
        cached = _FP32_PATTERNS.get(id(self.rules))
        if cached is None or cached[0] is not self.rules:
            templates = sorted({name for rule in self.rules if rule.fp32 for name in rule.hf})
            cached = _FP32_PATTERNS[id(self.rules)] = (self.rules, [
                (re.compile(r"\d+".join(map(re.escape, re.split(r"\{\w+\}", t)))), t.rpartition("}.")[2])
                for t in templates])
        return next((kind for pattern, kind in cached[1] if pattern.fullmatch(hf_name)), None)


# id(Architecture.rules) -> (the rules, [(HF name pattern, kind)]): fp32_kind's patterns, made once per table
_FP32_PATTERNS: dict[int, tuple] = {}


def prefixed(rules: tuple[Rule, ...], megatron: str, hf: Callable[[str], str]) -> tuple[Rule, ...]:
    """The rules of a model nested inside another one (the language model of a vision-language
    model): `megatron` is prepended to the Megatron names, `hf` renames the HF templates."""
    return tuple(replace(r, megatron=megatron + r.megatron, te=r.te and megatron + r.te,
                         hf={hf(name): shape for name, shape in r.hf.items()}) for r in rules)


DECODER_LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."
MTP_LAYER = "mtp.layers.{mtp}."  # megatron-core's MultiTokenPredictionBlock, on the last pipeline stage
MTP_REPEAT = ("mtp", "mtp_layers", "layers")  # MTP layer j is HF layer num_hidden_layers + j


def mtp_layer_rules(rules: tuple[Rule, ...], hf_layer: str | None = None) -> tuple[Rule, ...]:
    """Decoder-layer rules as the inner layer of megatron-core's MTP layers
    (`mtp.layers.{j}.mtp_model_layer.`, multi_token_prediction.py), placed with the final norm on the
    last pipeline stage, for HF layer num_hidden_layers + j; their `when` picks the layer kind there.
    `hf_layer`: where the HF model keeps its MTP layers, if not among its decoder layers (Qwen3.5's
    `mtp.layers.{mtp}.`)."""
    def move(name: str) -> str:
        return name.replace(DECODER_LAYER, MTP_LAYER + "mtp_model_layer.")
    return tuple(replace(r, megatron=move(r.megatron), te=r.te and move(r.te), stage=LAST, repeat=MTP_REPEAT,
                         hf={name.replace(HF_LAYER, hf_layer or HF_LAYER): shape for name, shape in r.hf.items()})
                 for r in rules if r.per_layer)


def mtp_copy_of_embedding(d) -> bool:
    # GPTModel builds an embedding wherever MTP runs; off the first chunk it is a copy (tied by megatron-core).
    return bool(d.mtp_layers) and (d.pp > 1 or d.vpp > 1)


def mtp_block_rules(layer_rules: tuple[Rule, ...], hf_layer: str | None, hf: dict[str, str],
                    embedding: str) -> tuple[Rule, ...]:
    """megatron-core's MTP block: per depth j, the inner layer (mtp_layer_rules), the norms `enorm`
    (of the next token's embedding), `hnorm` (of the hidden state), `final_layernorm`, and `eh_proj`
    [h, 2h] (column-parallel, input [embedding; hidden] as in the HF models), whose HF names `hf` gives
    by those four names; and GPTModel's copy of the word embedding (HF `embedding`) where MTP runs
    off the first pipeline chunk."""
    m = MTP_LAYER
    norms = tuple(rule for norm in ("enorm", "hnorm", "final_layernorm") for rule in (
        Rule(f"{m}{norm}.weight", {hf[norm]: "hidden"}, REPLICATED, stage=LAST, repeat=MTP_REPEAT),
        extra_state(m + norm, stage=LAST, specs=("te",), repeat=MTP_REPEAT)))
    return (*mtp_layer_rules(layer_rules, hf_layer), *norms,
            *linear(m + "eh_proj", {hf["eh_proj"]: "hidden eh_in"}, COLUMN, stage=LAST, repeat=MTP_REPEAT),
            Rule("embedding.word_embeddings.weight", {embedding: "vocab hidden"}, VOCAB, stage=LAST,
                 when=mtp_copy_of_embedding, exported=False))


def extra_state(module: str, stage: str | None = None, specs=("local", "te"), when=None, repeat=None) -> Rule:
    """The `_extra_state` entry (None in converted checkpoints) that Megatron linear modules carry."""
    return Rule(f"{module}._extra_state", {}, EXTRA_STATE, stage=stage, specs=specs, when=when, repeat=repeat)


def linear(module: str, hf: dict[str, str], kind: Kind, **options) -> tuple[Rule, Rule]:
    """A Megatron linear layer: its weight and its `_extra_state`."""
    stage, when, repeat = options.get("stage"), options.get("when"), options.get("repeat")
    return Rule(f"{module}.weight", hf, kind, **options), extra_state(module, stage=stage, when=when, repeat=repeat)
