"""Helpers the architecture tables share for reading config.json.

Every config field that changes the forward pass is either carried into the Megatron-LM args
(and proven by the megatron-core oracle) or refused by name; these helpers do it for the fields
many architectures share: the rotary embedding and the MLP activation.
"""
import math
from contextlib import contextmanager

from mconv.errors import MconvError


class MissingConfigField(MconvError):
    """config.json lacks a field an architecture's table reads (`key`)."""

    def __init__(self, key: str, null: bool = False):
        self.key, self.null = key, null
        super().__init__(f"config.json {self.lacks}, which this architecture needs")

    @property
    def lacks(self) -> str:
        """How the field is missing, for a message: "has no 'key'" or "gives 'key' as null"."""
        return f"gives '{self.key}' as null" if self.null else f"has no '{self.key}'"


@contextmanager
def fields_of(block: str):
    """Within it, a MissingConfigField names its key inside config.json's `block` (text_config,
    vision_config of a vision-language model): `vision_config.depth`, not `depth`."""
    try:
        yield
    except MissingConfigField as e:
        raise MissingConfigField(f"{block}.{e.key}", e.null) from None


def config_value(config: dict, key: str):
    """config[key]; MissingConfigField naming `key` where config.json lacks it or gives it as null
    (no architecture's table has a meaning for a null where it needs a value)."""
    value = config.get(key)
    if value is None:
        raise MissingConfigField(key, key in config)
    return value


def config_default(config: dict, key: str, default):
    """config[key], `default` where config.json lacks it; MissingConfigField where it gives null
    (transformers' config classes then hold None, not their default)."""
    return config_value(config, key) if key in config else default


def rope_parameters(config: dict) -> tuple[dict, str]:
    """The rotary-embedding parameters as transformers 5 reads config.json
    (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` and `standardize_rope_params`), with
    the name of the block they came from for messages: the 4.x `rope_scaling` block when set, else
    5.x's `rope_parameters`; `rope_theta` (default 10000) and `partial_rotary_factor` from the top
    level where the block lacks them; `rope_type` from `rope_type` or 4.x's `type` (default
    "default"); for YaRN, `original_max_position_embeddings` from the block, else
    `max_position_embeddings` (a top-level one counts only for config classes that declare the
    field, such as Phi-3; Qwen3's do not). Per-layer-type blocks (keys that are layer types) are refused."""
    where = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = dict(config.get(where) or {})
    if set(params) & set(config.get("layer_types") or ()):
        raise MconvError(f"config.json's {where} holds one block per layer type; mconv reads one rotary "
                         "embedding for all layers")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params, where


def rope_theta(config: dict) -> float:
    return float(rope_parameters(config)[0]["rope_theta"])


def _yarn_mscale(factor: float, mscale: float) -> float:
    """transformers' and megatron-core's YaRN `get_mscale` (the same formula in both)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_args(config: dict) -> dict:
    """The Megatron-LM args for the config's rotary embedding over the whole head (`kv_channels`):
    `position_embedding_type` "rope" with `rotary_base`, or for YaRN "yarn" with the settings
    Megatron-LM's `_apply_yarn_config_from_args` hands to megatron-core's `YarnRotaryEmbedding`
    (`--rotary-scaling-factor`, `--yarn-original-max-position-embeddings`, `--yarn-beta-fast/slow`,
    `--mscale`, `--mscale-all-dim`, `--[no-]yarn-correction-range-round-to-int`), chosen so that
    megatron-core computes transformers' `_compute_yarn_parameters` (inverse frequencies and the
    attention factor on cos/sin). Raises MconvError naming the field for everything else
    (linear, dynamic, llama3, longrope scaling; partial rotary; an attention_factor YaRN's
    mscale formula does not give), which megatron-core's GPTModel cannot reproduce."""
    params, where = rope_parameters(config)
    kind = params["rope_type"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise MconvError(f"config.json's partial_rotary_factor is {params['partial_rotary_factor']}: mconv maps "
                         "rotary embeddings over the whole head only")
    args = dict(position_embedding_type="rope", rotary_base=float(params["rope_theta"]), rotary_percent=1.0)
    if kind == "default":
        return args
    if kind != "yarn":
        raise MconvError(f"config.json's {where} has rope_type {kind!r}, which megatron-core's GPTModel cannot "
                         "reproduce; mconv maps 'default' and 'yarn'")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the extended to the pretraining length
        factor = config_value(config, "max_position_embeddings") / original
    # transformers uses mscale and mscale_all_dim only when both are non-zero; megatron-core always
    # divides, so mscale 1 over mscale_all_dim 0 gives transformers' plain get_mscale(factor).
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    attention_factor = params.get("attention_factor")
    implied = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    if attention_factor is not None and not math.isclose(attention_factor, implied, rel_tol=1e-7):  # float32-written
        raise MconvError(f"config.json's {where} sets attention_factor {attention_factor}, not the {implied} YaRN "
                         "derives from factor and mscale; megatron-core's YaRN has no separate attention factor")
    # Megatron-LM's validate_args turns the legacy use_rotary_position_embeddings into "rope", and
    # refuses add_position_embedding=False for any other type.
    return dict(args, position_embedding_type="yarn", use_rotary_position_embeddings=False,
                add_position_embedding=True, rotary_scaling_factor=float(factor),
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim),
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)))


def require_silu(config: dict) -> None:
    """Megatron-LM's `--swiglu` gates with SiLU; other activations are refused by name."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise MconvError(f"config.json's hidden_act is {act!r}: Megatron-LM's gated MLP (--swiglu) uses silu")
