"""The light install: `pip install mconv` (setup.cfg's install_requires) is all every command needs.
The demo's commands (read from scripts/demo.sh) and export-lora, plain and `--merge`, run in a fresh
interpreter where megatron-core, transformers and peft cannot be imported (an import hook answers as
Python does for a package that is not installed), and every third-party distribution they load is
declared in install_requires or required by a declared one (importlib.metadata's record of what each
installed distribution requires)."""
import configparser
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from mconv import Layout, hf2mcore
from tests.conftest import FIXTURES, ROOT

EXTRAS_ONLY = {"megatron-core", "transformers", "peft"}
PROBE = """import importlib.abc, json, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megatron", "transformers", "peft"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
from mconv.cli import main
for line in json.loads(sys.argv[1]):
    try:
        main(line, standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (line, e.code)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_requires() -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return [Requirement(line) for line in config["options"]["install_requires"].split("\n") if line.strip()]


def closure(requirements: list[Requirement]) -> set[str]:
    """The distributions `requirements` pull in, through each installed one's own requirements."""
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        name = canonical(todo.pop().name)
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or []:
            r = Requirement(text)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r)
    return seen


def demo_commands(out: Path) -> list[list[str]]:
    lines = (ROOT / "scripts" / "demo.sh").read_text().splitlines()
    commands = [shlex.split(line.replace('$OUT', str(out)))[1:] for line in lines if line.startswith("mconv ")]
    assert len(commands) >= 6
    return commands


def lora_checkpoint(directory: Path) -> Path:
    """Legacy TP1 rank files with Megatron-Bridge adapters on every linear_qkv (as docs/lora.md makes)."""
    hf2mcore(FIXTURES / "qwen3-tiny", directory, Layout(), fmt="torch", progress=False)
    path = directory / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    model = state["model"]
    for name in [n for n in model if n.endswith("linear_qkv.weight")]:
        rows, columns = model[name].shape
        model[name.replace(".weight", ".adapter.linear_in.weight")] = torch.randn(4, columns)
        model[name.replace(".weight", ".adapter.linear_out.weight")] = torch.randn(rows, 4)
    torch.save(state, path)
    return directory


def test_install_requires_leave_out_what_only_the_extras_need():
    assert not {canonical(r.name) for r in install_requires()} & EXTRAS_ONLY


def pins(constraints: str) -> dict[str, str]:
    """name -> version of each `name==version` line of a constraints file at the repository root."""
    found = {}
    for line in (ROOT / constraints).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            found[canonical(name)] = version.strip()
    return found


def test_lower_bounds_are_the_oldest_tested_versions():
    """Each of install_requires' lower bounds is the version scripts/install-oldest.sh installs (the
    oldest set-up CI tests), and python_requires' is its Python; in that set-up, what is installed."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    oldest = pins("constraints-oldest.txt")
    bounds = {}
    for requirement in install_requires():
        (spec,) = requirement.specifier
        assert spec.operator == ">=", requirement
        bounds[canonical(requirement.name)] = spec.version
    assert {name: Version(oldest[name]) for name in bounds} == {name: Version(v) for name, v in bounds.items()}
    assert config["options"]["python_requires"].strip() == ">=3.10"
    if sys.version_info[:2] == (3, 10):
        assert {name: importlib.metadata.version(name) for name in oldest} == oldest


def test_every_command_runs_without_megatron_core_transformers_and_peft(tmp_path):
    lora = lora_checkpoint(tmp_path / "lora")
    commands = demo_commands(tmp_path / "demo") + [
        ["hf2mcore", FIXTURES / "qwen3-moe-tiny", tmp_path / "moe", "--tp", "2", "--ep", "2", "-q"],
        ["inspect", tmp_path / "moe"],
        ["export-lora", lora, tmp_path / "adapter", "--alpha", "8", "-q"],
        ["export-lora", lora, tmp_path / "merged", "--alpha", "8", "--merge", "--base-model",
         FIXTURES / "qwen3-tiny", "-q"],
        ["verify", FIXTURES / "qwen3-tiny", tmp_path / "demo" / "hf-from-torch-dist", "-q"],
    ]
    lines = [[str(a) for a in command] for command in commands]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(lines)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "identical: 47 tensors" in done.stdout + done.stderr

    # Every third-party distribution loaded is declared, or required by a declared one.
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    owners = importlib.metadata.packages_distributions()
    loaded = {canonical(d) for m in modules for d in owners.get(m, [])} - {"mconv"}
    assert not loaded & EXTRAS_ONLY
    assert loaded - closure(install_requires()) == set()
