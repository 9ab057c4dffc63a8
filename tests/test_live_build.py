"""mconv.live.build_model / transformer_config against megatron-core 0.19 (Qwen3 at TP2 and PP2 x VPP2,
Qwen3-MoE at TP2/EP2/ETP1) and 0.14, the side install (Qwen3 at TP2, Qwen3-MoE at EP2): Megatron-LM's
own config from mconv's stored args (0.19), strict loading, transformers' logits (see
live_build_oracle.py); the one-line error without megatron-core; and the refusals."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mconv import Layout, MconvError, hf2mcore
from tests.conftest import FIXTURES, ROOT
from tests.live_build_oracle import CASES, TOKENS
from tests.megatron_oracle import hf_logits, read_config
from tests.test_torch_dist import OLD_MEGATRON


@pytest.mark.slow
@pytest.mark.parametrize("megatron", ["0.19", "0.14"])
def test_built_model_matches_megatron_lm_config_and_transformers_logits(tmp_path, megatron):
    if megatron == "0.14" and not OLD_MEGATRON.is_dir() and not os.environ.get("CI"):
        pytest.skip(f"no older megatron-core at {OLD_MEGATRON} (scripts/install.sh installs 0.14.0 there)")
    import torch

    cases = ["dense-tp2", "moe-tp2-ep2", "dense-pp2-vpp2"] if megatron == "0.19" else ["dense-tp2", "moe-ep2"]
    for case in cases:
        fixture, sizes = CASES[case]
        hf2mcore(FIXTURES / fixture, tmp_path / case, Layout(**sizes), fmt="torch", progress=False)
    env = {**os.environ, "PYTHONPATH": str(OLD_MEGATRON) if megatron == "0.14" else str(ROOT)}
    arguments = [arg for case in cases for arg in (case, str(tmp_path / case))]
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("live_build_oracle.py")), str(tmp_path),
                             *arguments], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "version").read_text().startswith(f"{megatron}.")
    for case in cases:
        hf_dir = FIXTURES / CASES[case][0]
        logits = torch.load(tmp_path / f"{case}.logits.pt")[..., :read_config(hf_dir)["vocab_size"]]
        assert (logits - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4, case
        tp = CASES[case][1].get("tp", 1)
        assert (tmp_path / f"{case}.mismatch.txt").read_text() == (
            f"build_model: the layout has TP{3 - tp}, megatron-core's parallel_state TP{tp}")
        if megatron == "0.19":  # Megatron-LM's megatron.training comes with the 0.19 install only
            assert json.loads((tmp_path / f"{case}.config.json").read_text()) == {}, case


def test_yarn_config_is_megatron_lms(tmp_path):
    """YaRN as transformers 4.x wrote it (every setting changed, MoE TP2/EP2): transformer_config's
    fields and the yarn_* settings GPTModel reads equal what Megatron-LM's
    core_transformer_config_from_args makes from the args hf2mcore stores (one process: neither
    needs a process group)."""
    from mconv.live import transformer_config
    from tests.live_build_oracle import RUNTIME, config_differences
    from tests.megatron_oracle import MegatronRun, _config_from_args, trainer_args
    from tests.test_oracle_megatron import YARN_CASES, stored_args

    fixture, sizes, rope = YARN_CASES[1]
    hf_dir = shutil.copytree(FIXTURES / fixture, tmp_path / "hf")
    config = {k: v for k, v in {**read_config(hf_dir), **rope}.items() if v is not None}
    (hf_dir / "config.json").write_text(json.dumps(config))
    hf2mcore(hf_dir, tmp_path / "megatron", Layout(**sizes), fmt="torch", progress=False)
    theirs, rotary = _config_from_args(trainer_args(stored_args(tmp_path / "megatron"),
                                                    MegatronRun(tmp_path / "megatron", config, **sizes)))
    ours = transformer_config(config, Layout(**sizes), dtype=torch.float32, **RUNTIME)
    assert rotary["position_embedding_type"] == "yarn" and theirs.yarn_rotary_scaling_factor == 8.0
    assert config_differences(ours, theirs) == {}


def test_te_spec_without_transformer_engine_is_one_line(monkeypatch):
    """spec="te" where Transformer Engine cannot be imported: one MconvError saying so and naming
    spec='local', before anything else is asked of megatron-core (no parallel_state here)."""
    from mconv.live import build_model

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # what import finds for a missing package
    with pytest.raises(MconvError) as raised:
        build_model(FIXTURES / "qwen3-tiny", Layout(tp=2), spec="te")
    assert str(raised.value) == ("build_model: spec='te' needs Transformer Engine, which is not installed; "
                                 "spec='local' builds megatron-core's own layers")


def test_import_without_megatron_core_names_the_extra():
    """`import mconv.live` where megatron cannot be imported: one ImportError naming the extra."""
    code = ("import sys, importlib.abc\n"
            "class NoMegatron(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'megatron' or name.startswith('megatron.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoMegatron())\n"
            "import mconv.live\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: mconv.live needs megatron-core: pip install 'mconv[live]'")
    assert "During handling" not in result.stderr and "direct cause" not in result.stderr


@pytest.mark.parametrize("fixture,where", [("qwen3-vl-tiny", "no Qwen3-VL vision model; mbridge"),
                                           ("bailing-v3-tiny", "no Kimi Delta Attention (KDA) layer; AReaL")])
def test_models_megatron_core_cannot_build_name_the_bridge(fixture, where):
    from mconv.live import transformer_config

    with pytest.raises(MconvError, match=r"megatron-core cannot build \w+ itself: megatron-core has "
                       + re.escape(where)):
        transformer_config(FIXTURES / fixture, Layout())


def test_overrides_set_only_what_the_model_leaves_open():
    from mconv.live import transformer_config

    config = transformer_config(FIXTURES / "qwen3-moe-tiny", Layout(tp=2, ep=2, etp=1), sequence_parallel=True,
                                moe_token_dispatcher_type="alltoall", num_layers=4)  # the model's own value
    assert config.sequence_parallel and config.moe_token_dispatcher_type == "alltoall" and config.num_layers == 4
    with pytest.raises(MconvError, match="num_query_groups is 2 for this HF config and layout"):
        transformer_config(FIXTURES / "qwen3-moe-tiny", Layout(), num_query_groups=4)
    with pytest.raises(MconvError, match="TransformerConfig has no field 'hidden'"):
        transformer_config(FIXTURES / "qwen3-tiny", Layout(), hidden=4)
    with pytest.raises(MconvError, match="the model has no experts, so the expert layout EP 2 ETP 1"):
        transformer_config(FIXTURES / "qwen3-tiny", Layout(ep=2))


def test_dtype_is_one_mconv_writes():
    """`dtype` as hf2mcore's: float32, bfloat16 or float16, by torch dtype or name; anything else
    (it once became params_dtype as given) is refused by build_model and transformer_config alike."""
    from mconv.live import build_model, transformer_config

    assert transformer_config(FIXTURES / "qwen3-tiny", Layout(), dtype="float16").params_dtype == torch.float16
    for dtype in ("bf16", "float8", 3, torch.int8):
        for make in (transformer_config, build_model):
            with pytest.raises(MconvError, match=re.escape(f"dtype={dtype!r} is not a dtype mconv writes; available: ")):
                make(FIXTURES / "qwen3-tiny", Layout(), dtype=dtype)
