"""The architecture registry: config.json's architectures[0] picks the table."""
from mconv.errors import MconvError
from mconv.mappings.bailing_v3 import BAILING_V3
from mconv.mappings.qwen3 import QWEN3
from mconv.mappings.qwen3_moe import QWEN3_MOE
from mconv.mappings.qwen3_vl import QWEN3_VL, QWEN3_VL_MOE
from mconv.mappings.schema import Architecture

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (QWEN3, QWEN3_MOE, QWEN3_VL, QWEN3_VL_MOE,
                                                                          BAILING_V3)}


def architecture_for(config: dict) -> Architecture:
    names = config.get("architectures") or []
    if not names:
        raise MconvError("config.json has no 'architectures' entry, so the model type is unknown")
    if names[0] not in ARCHITECTURES:
        raise MconvError(f"config.json names unsupported architecture {names[0]!r}; mconv supports: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[names[0]]
