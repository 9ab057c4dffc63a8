"""A command imports only what it needs: megatron-core, transformers and peft are heavy (seconds
of imports: megatron-core pulls in torch.distributed.tensor, dynamo and sympy), so `--help`,
`inspect`, `verify`, `--dry-run` and the legacy format in both directions must not import them, and
`--help` must not import torch either. Each command runs in a fresh interpreter, which then lists
the modules it loaded (`sys.modules`, the interpreter's own record)."""
import json
import subprocess
import sys


from tests.conftest import FIXTURES, ROOT

HEAVY = ("megatron", "transformers", "peft", "torch")
PROBE = """import json, sys
from mconv.cli import main
for line in json.loads(sys.argv[1]):
    try:
        main(line, standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (line, e.code)
print(json.dumps(sorted(sys.modules)))
"""


def loaded(*commands: list) -> set[str]:
    """The modules that running `commands` (mconv argument lists, one after another) loaded in a
    fresh interpreter. One interpreter runs them all, to keep the test fast: a module none of them
    may import is absent at the end only if each left it out."""
    lines = [[str(a) for a in command] for command in commands]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(lines)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def imported(*commands: list) -> set[str]:
    """The heavy top-level packages that running `commands` imported (see `loaded`)."""
    return {m.split(".")[0] for m in loaded(*commands)} & set(HEAVY)


def test_help_imports_no_torch():
    assert imported(["--help"], ["hf2mcore", "--help"], ["mcore2hf", "--help"]) == set()


def test_python_dash_m_mconv_is_the_command_line():
    done = subprocess.run([sys.executable, "-m", "mconv", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "hf2mcore" in done.stdout and "mcore2hf" in done.stdout, done.stderr


def test_inspect_verify_dry_run_and_legacy_format_import_no_megatron(tmp_path):
    """The whole legacy round trip (with 2 workers), inspect of both sides, verify and a dry run."""
    hf, ckpt, back = FIXTURES / "qwen3-moe-tiny", tmp_path / "ckpt", tmp_path / "back"
    assert imported(["inspect", hf],
                    ["hf2mcore", hf, tmp_path / "plan", "--tp", "2", "--ep", "2", "--dry-run"],
                    ["hf2mcore", hf, ckpt, "--tp", "2", "--pp", "2", "--ep", "2", "--format", "torch", "-q",
                     "--workers", "2"],
                    ["inspect", ckpt],
                    ["mcore2hf", ckpt, back, "-q", "--workers", "2"],
                    ["verify", hf, back, "-q"]) == {"torch"}


def test_torch_dist_round_trip_imports_no_megatron(tmp_path):
    """torch_dist keys come from mconv's tables (converter/torch_dist.py), not from megatron-core's
    model: hf2mcore --format torch_dist (2 workers) and mcore2hf of it, for Qwen3-MoE and BailingMoeV3,
    import neither megatron-core nor transformers."""
    commands = []
    for fixture in ("qwen3-moe-tiny", "bailing-v3-tiny"):
        ckpt = tmp_path / fixture
        commands += [["hf2mcore", FIXTURES / fixture, ckpt, "--format", "torch_dist", "--tp", "2", "-q",
                      "--workers", "2"],
                     ["mcore2hf", ckpt, tmp_path / f"{fixture}-back", "-q"]]
    assert imported(*commands) == {"torch"}


def test_torch_dist_writer_imports_no_torch_distributed_beyond_import_torch(tmp_path):
    """DCP's `.metadata` is pickled from mconv's stand-ins of its classes (converter/dcp_stand_in):
    hf2mcore --format torch_dist (one writer and two) loads no torch.distributed module that
    `import torch` does not load itself (torch.distributed.checkpoint pulls in DTensor, dynamo and
    sympy), nor sympy."""
    done = subprocess.run([sys.executable, "-c", "import json, sys, torch; print(json.dumps(sorted(sys.modules)))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    by_torch = set(json.loads(done.stdout))
    hf = FIXTURES / "qwen3-moe-tiny"
    modules = loaded(["hf2mcore", hf, tmp_path / "one", "--format", "torch_dist", "-q"],
                     ["hf2mcore", hf, tmp_path / "two", "--format", "torch_dist", "--tp", "2", "-q", "--workers", "2"])
    assert (tmp_path / "one" / "release" / ".metadata").is_file() and (tmp_path / "two" / "release" / ".metadata").is_file()
    assert "torch.distributed" in by_torch
    assert {m for m in modules - by_torch if m.startswith(("torch.distributed.", "sympy"))} == set()
    assert not {m for m in modules if m.startswith(("torch.distributed.checkpoint", "torch.distributed.tensor"))}
