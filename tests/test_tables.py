"""The tables against megatron-core's own naming rules."""
from mconv.mappings import ARCHITECTURES


def test_te_norm_names_follow_megatron_core_key_map():
    # megatron-core's local spec declares how its norms are named in TE-layout checkpoints.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    key_map = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    prefix = "decoder.layers.{layer}."
    checked = 0
    for arch in ARCHITECTURES.values():
        if arch.torch_dist and arch.torch_dist.te_names:  # not the GPT spec (Qwen3.5: tests/test_qwen3_5.py's oracle)
            continue
        for rule in arch.rules:
            if rule.te and rule.megatron.startswith(prefix):
                local = rule.megatron.removeprefix(prefix)
                for old, new in key_map.items():  # (expert renames are not norm renames)
                    if local.startswith(old):
                        assert prefix + new + local.removeprefix(old) == rule.te
                        checked += 1
    assert checked >= 2
