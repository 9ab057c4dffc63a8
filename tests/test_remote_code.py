"""A model with remote code (auto_map: configuration_*.py, modeling_*.py and what they import
relatively) keeps it through every conversion: the Megatron checkpoint's hf_config/, mcore2hf's
output and a hub download carry exactly the files transformers needs, so transformers loads the
output with trust_remote_code=True (in a fresh interpreter; mconv never imports that code).

Oracles: transformers' own AutoConfig / get_class_from_dynamic_module on the output, its
get_relative_import_files for the files needed, and huggingface_hub's filter_repo_objects for what
the allow patterns given to snapshot_download fetch."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from mconv.cli import main
from mconv.converter.hf_config import SIDE_FILES, copy_side_files
from mconv.converter.remote_code import remote_code_files
from tests.conftest import FIXTURES, ROOT

CONFIGURATION = '''from transformers import PretrainedConfig


class BailingMoeV3Config(PretrainedConfig):
    model_type = "bailing_hybrid"

    def __init__(self, num_experts=8, layer_group_size=2, **kwargs):
        self.num_experts = num_experts
        self.layer_group_size = layer_group_size
        super().__init__(**kwargs)
'''
MODELING = '''import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_bailing_moe_v3 import BailingMoeV3Config
from .bailing_layers import layer_kinds


class BailingMoeV3ForCausalLM(PreTrainedModel):
    config_class = BailingMoeV3Config

    def __init__(self, config):
        super().__init__(config)
        self.kinds = layer_kinds(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
'''
LAYERS = '''def layer_kinds(config):
    """KDA layers, then an MLA layer closing each group of layer_group_size."""
    group = config.layer_group_size
    return ["mla" if (i + 1) % group == 0 else "kda" for i in range(config.num_hidden_layers)]
'''
CODE = {"configuration_bailing_moe_v3.py": CONFIGURATION, "modeling_bailing_moe_v3.py": MODELING,
        "bailing_layers.py": LAYERS}
LOAD = """import sys
from transformers import AutoConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module
config = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
model = get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], sys.argv[1])
print(type(config).__name__, model.__name__, model(config).kinds)
"""


def with_remote_code(tmp_path: Path) -> Path:
    """bailing-v3-tiny (whose config.json has an auto_map) with its remote code beside it, and a
    script nothing names (not carried)."""
    hf = tmp_path / "bailing"
    shutil.copytree(FIXTURES / "bailing-v3-tiny", hf)
    for name, text in CODE.items():
        (hf / name).write_text(text)
    (hf / "convert_checkpoint.py").write_text("print('not part of the model')\n")
    return hf


def transformers_loads(directory: Path, tmp_path: Path) -> str:
    """What transformers makes of `directory` with trust_remote_code=True, in a fresh interpreter
    whose dynamic-module cache is in tmp_path (HF_MODULES_CACHE)."""
    done = subprocess.run([sys.executable, "-c", LOAD, str(directory)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_files_needed_are_those_transformers_resolves(tmp_path):
    from transformers.dynamic_module_utils import get_relative_import_files

    hf = with_remote_code(tmp_path)
    auto_map = json.loads((hf / "config.json").read_text())["auto_map"]
    expected = set()
    for reference in auto_map.values():
        module = hf / (reference.split(".")[0] + ".py")
        expected |= {module.name} | {Path(f).name for f in get_relative_import_files(module)}
    assert set(remote_code_files(hf, SIDE_FILES)) == expected == set(CODE)


def test_remote_code_survives_hf2mcore_and_mcore2hf(tmp_path):
    hf = with_remote_code(tmp_path)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    for args in (["hf2mcore", hf, ckpt], ["mcore2hf", ckpt, back]):
        result = CliRunner().invoke(main, [str(a) for a in args] + ["-q"])
        assert result.exit_code == 0, result.output
    for directory in (ckpt / "hf_config", back):
        assert {p.name for p in directory.glob("*.py")} == set(CODE), directory
        assert all((directory / name).read_text() == text for name, text in CODE.items())
    assert transformers_loads(back, tmp_path) == "BailingMoeV3Config BailingMoeV3ForCausalLM ['kda', 'mla', 'kda', 'mla']"


def test_references_into_other_repositories_and_paths_are_not_copied(tmp_path):
    """`org/repo--module.Class` is fetched by transformers from that repository; a module name
    that is not a Python identifier (a path) is never read."""
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    (tmp_path / "secret.py").write_text("x = 1\n")
    (source / "config.json").write_text(json.dumps({"auto_map": {
        "AutoConfig": "other/repo--configuration_x.XConfig", "AutoModel": "../secret.Model"}}))
    (source / "tokenizer_config.json").write_text(json.dumps({"auto_map": {
        "AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    (source / "tokenization_x.py").write_text("from .vocab_x import VOCAB\n")
    (source / "vocab_x.py").write_text("VOCAB = {}\n")
    copied = copy_side_files(source, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(copied) == [
        "config.json", "tokenization_x.py", "tokenizer_config.json", "vocab_x.py"]
