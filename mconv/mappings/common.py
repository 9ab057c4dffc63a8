"""Helpers the architecture tables share for reading config.json."""
from mconv.errors import MconvError


def config_value(config: dict, key: str):
    if key not in config:
        raise MconvError(f"config.json has no '{key}', which this architecture needs")
    return config[key]


def rope_theta(config: dict) -> float:
    """transformers 4.x writes rope_theta; 5.x nests it in rope_parameters."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
