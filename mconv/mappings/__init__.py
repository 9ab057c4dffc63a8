"""The architecture registry: config.json's architectures[0] picks the table, or, without it,
model_type as transformers' `AutoModelForCausalLM` maps it to a class."""
from mconv.errors import MconvError
from mconv.mappings.common import MissingConfigField
from mconv.mappings.bailing_v3 import BAILING_V3
from mconv.mappings.qwen3 import QWEN3
from mconv.mappings.qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from mconv.mappings.qwen3_5_vl import QWEN3_5_VL, QWEN3_5_VL_MOE
from mconv.mappings.qwen3_moe import QWEN3_MOE
from mconv.mappings.qwen3_vl import QWEN3_VL, QWEN3_VL_MOE
from mconv.mappings.schema import Architecture

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (QWEN3, QWEN3_MOE, QWEN3_VL, QWEN3_VL_MOE,
                                                                          BAILING_V3, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT,
                                                                          QWEN3_5_VL, QWEN3_5_VL_MOE)}


def architecture_for(config: dict, where="config.json") -> Architecture:
    """The table for config.json. Without `architectures`, the class transformers'
    `AutoModelForCausalLM` picks for `model_type` (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), when exactly
    one table has that model_type. Raises MconvError naming what is missing or unsupported, and `where`
    (the config.json file's path, where the caller knows it)."""
    names = config.get("architectures") or []
    if not names:
        model_type = config.get("model_type")
        if not model_type:
            raise MconvError(f"{where} has neither 'architectures' nor 'model_type', so the model class is unknown")
        found = [arch for arch in ARCHITECTURES.values() if arch.model_type == model_type]
        if len(found) != 1:
            raise MconvError(f"{where} has no 'architectures' and mconv has no causal-LM table for "
                             f"model_type {model_type!r}; supported: "
                             f"{', '.join(sorted(a.model_type for a in ARCHITECTURES.values() if a.model_type))}")
        return found[0]
    if names[0] not in ARCHITECTURES:
        raise MconvError(f"{where} names unsupported architecture {names[0]!r}; mconv supports: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[names[0]]
    if not isinstance(where, str):  # the file is known (every such caller reads dims next): name it with a missing field
        try:
            arch.dims(config)
        except MissingConfigField as e:
            raise MconvError(f"{where} {e.lacks}, which {arch.name} needs") from None
    return arch
