"""What mconv says, as a new user meets it: no Python reprs in any command's text or JSON, short
reprs of library results, --dry-run --json's plan as data (checked against the rank files torch
loads), honest progress units, --max-shard-size read exactly as transformers reads it (its own
parser is the oracle), one-line refusals, PEFT adapters for inspect (peft's own config reader is
the oracle) and verify, the layer kinds of a hybrid model, --version and shell completion."""
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from mconv import Layout
from mconv.cli import main
from tests.conftest import FIXTURES, ROOT, load_rank_file

TINY, MOE, BAILING = FIXTURES / "qwen3-tiny", FIXTURES / "qwen3-moe-tiny", FIXTURES / "bailing-v3-tiny"
QWEN3_5 = FIXTURES / "qwen3-5-tiny"
REPR_MARKERS = ("frozenset", "Namespace(", "torch.", "None", "{", "[(", "<", "(s)")


def mconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_readable(text: str):
    for marker in REPR_MARKERS:
        assert marker not in text, (marker, text)


def json_strings(value):
    """Every string in a JSON document (keys and values)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from json_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from json_strings(v)
    elif isinstance(value, str):
        yield value


def assert_readable_output(result, as_json: bool = False):
    """A command's stdout and stderr (errors included) read as text for people, and any JSON holds
    no repr in its strings."""
    assert_readable(result.stderr)
    if as_json and result.exit_code == 0:
        for string in json_strings(json.loads(result.stdout)):
            assert_readable(string)
    else:
        assert_readable(result.stdout)


LAYOUTS = [[], ["--tp", "2"], ["--pp", "3", "--first-stage-layers", "2"], ["--pp", "3", "--last-stage-layers", "1"],
           ["--pp", "2", "--vpp", "2"], ["--pp", "3", "--first-stage-layers", "1", "--last-stage-layers", "1"],
           ["--tp", "2", "--ep", "2", "--etp", "2"], ["--pp", "2", "--first-stage-layers", "4"],
           ["--layout", "attn:d1p2t2|ffn:d1p2t1e2"]]


@pytest.mark.parametrize("fixture", ["qwen3-tiny", "qwen3-moe-tiny", "bailing-v3-tiny", "qwen3-vl-tiny"])
def test_no_reprs_in_any_commands_text_or_json(tmp_path, fixture):
    """Dry runs (text and JSON) at every layout kind, accepted or refused; a conversion at an uneven
    layout in both formats, and inspect, mcore2hf and verify of it, in text and JSON."""
    hf = FIXTURES / fixture
    for layout in LAYOUTS:
        for fmt in ("torch", "torch_dist"):
            for extra in ([], ["--json"]):
                result = mconv("hf2mcore", hf, tmp_path / "plan", "--format", fmt, "--dry-run", *layout, *extra)
                assert_readable_output(result, bool(extra))
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    uneven = ["--pp", "2", "--last-stage-layers", "1"]
    result = mconv("hf2mcore", hf, tmp_path / "dist", *uneven)  # torch_dist's own text: its layout and TP sizes
    assert result.exit_code == 0, result.output
    assert_readable_output(result)
    for extra in ([], ["--json"]):
        assert_readable_output(mconv("inspect", tmp_path / "dist", *extra), bool(extra))
        shutil.rmtree(ckpt, ignore_errors=True)
        result = mconv("hf2mcore", hf, ckpt, *uneven, "--format", "torch", *extra)
        assert result.exit_code == 0, result.output
        assert_readable_output(result, bool(extra))
        assert_readable_output(mconv("inspect", ckpt, *extra), bool(extra))
        assert_readable_output(mconv("inspect", hf, *extra), bool(extra))
        shutil.rmtree(back, ignore_errors=True)
        assert_readable_output(mconv("mcore2hf", ckpt, back, *extra), bool(extra))
    assert "(last stage 1 layer)" in mconv("inspect", ckpt).stdout
    assert json.loads(mconv("inspect", ckpt, "--json").stdout)["layout"]["text"] == "TP1 PP2 (last stage 1 layer)"
    assert_readable_output(mconv("verify", hf, back))
    assert_readable_output(mconv("verify", hf, FIXTURES / "qwen3-tiny-tied"))  # a difference, in detail


def test_library_results_have_short_reprs(tmp_path):
    from mconv import hf2mcore, mcore2hf
    from mconv.converter.lora import export_lora
    from tests.test_lora import lora_checkpoint

    summaries = [hf2mcore(MOE, tmp_path / "ckpt", Layout(tp=2, ep=2), fmt="torch", progress=False),
                 mcore2hf(tmp_path / "ckpt", tmp_path / "back", progress=False)]
    hf2mcore(TINY, tmp_path / "dist", Layout(tp=2, pp=2), progress=False)
    back = mcore2hf(tmp_path / "dist", tmp_path / "dist-back", progress=False)
    # A torch_dist checkpoint is read as global tensors: no TP1 PP1 that the checkpoint never had.
    assert repr(back) == f"Summary(Qwen3ForCausalLM, torch_dist (any layout): 1 file, {back.tensors} tensors, " \
                         f"{back.bytes:,} bytes)"
    assert repr(summaries[1]).startswith("Summary(Qwen3MoeForCausalLM, TP2 PP1 EP2 ETP1: 1 file, ")
    lora, _ = lora_checkpoint(tmp_path / "lora", TINY, Layout(tp=2))
    export = export_lora(lora, tmp_path / "adapter", alpha=16, progress=False)
    texts = [repr(x) for x in (*summaries, summaries[0].plan, export, export.adapter)]
    s = summaries[0]
    assert texts[0] == f"Summary(Qwen3MoeForCausalLM, TP2 PP1 EP2 ETP1: 2 files, {s.tensors} tensors, {s.bytes:,} bytes)"
    assert texts[3].startswith("LoraExport(PeftAdapter(Qwen3ForCausalLM, r=")
    for text in texts:
        assert len(text) < 300 and "\n" not in text and "tensor([" not in text, text


@pytest.mark.parametrize("model,sizes", [(MOE, ["--ep", "2"]), (FIXTURES / "qwen3-5-tiny", ["--spec", "te"])],
                         ids=["qwen3-moe", "qwen3_5"])
def test_dry_run_json_plan_is_the_rank_files_as_torch_loads_them(tmp_path, model, sizes):
    """Per rank file, each tensor's Megatron name, chunk, shape and dtype as the written file holds
    it (torch.load), its HF names and kind, and which shard of which group it is."""
    args = [model, tmp_path / "ckpt", "--tp", "2", "--pp", "2", *sizes, "--format", "torch"]
    plan = json.loads(mconv("hf2mcore", *args, "--dry-run", "--json").stdout)["plan"]
    assert mconv("hf2mcore", *args, "-q").exit_code == 0
    assert len(plan) == len(list((tmp_path / "ckpt" / "release").iterdir()))
    for entry in plan:
        state = load_rank_file(tmp_path / "ckpt" / "release" / entry["file"] / "model_optim_rng.pt")
        chunks = [state[k] for k in sorted(state) if k.startswith("model")]
        written = {(v, k): t for v, chunk in enumerate(chunks) for k, t in chunk.items() if hasattr(t, "shape")}
        assert {(t["chunk"], t["megatron"]) for t in entry["tensors"]} == written.keys()
        for t in entry["tensors"]:
            tensor = written[t["chunk"], t["megatron"]]
            assert t["shape"] == list(tensor.shape) and t["dtype"] == str(tensor.dtype).removeprefix("torch.")
            assert t["bytes"] == tensor.nbytes and t["hf"] and len(t["hf"]) == len(t["hf_shapes"])
            assert t["shard"]["of"] == (2 if t["shard"]["group"] == "tp" else 1)
        ep = f"_{entry['rank']['ep']:03d}" if "--ep" in sizes else ""  # Megatron-LM names EP ranks only with EP
        assert entry["file"] == f"mp_rank_{entry['rank']['tp']:02d}_{entry['rank']['pp']:03d}{ep}"
    if model != MOE:
        return
    qkv = next(t for t in plan[1]["tensors"] if t["megatron"].endswith("linear_qkv.weight"))
    assert qkv["kind"] == "qkv" and [n.split(".")[-2] for n in qkv["hf"]] == ["q_proj", "k_proj", "v_proj"]
    assert qkv["shard"] == {"group": "tp", "rank": plan[1]["rank"]["tp"], "of": 2, "dim": 0}


def test_progress_units_are_what_they_say(monkeypatch):
    """5,000,000 bytes are 5.00M (a 1024 divisor printed 4.77M, MiB, with a rate in MB/s)."""
    from mconv.converter.pipelines import _bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with _bar(5_000_000, "x", True) as bar:
        bar.update(2_500_000)
        bar.refresh()
    assert "2.50M/5.00M " in terminal.getvalue(), terminal.getvalue()


SIZES = ["3GB", "100KB", "100kb", "100kB", "100Kb", "1GiB", "1gib", "5MiB", "7kib", "1000", "1.5GB", " 5GB", "5 GB",
         "+5MB", "-5MB", "5_000KB", "GB", "", "5TB", "5B", "0GB", "3XB", "8gb", "1mb", "9Mb", "12KiB", "0x10MB"]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from(SIZES), st.from_regex(r"[ +\-]?[0-9_]{0,4}[ ]?[kKmMgGtTiIbBx]{0,3}", fullmatch=True)))
def test_shard_sizes_are_read_as_transformers_reads_them(text):
    from transformers.utils.hub import convert_file_size_to_int

    from mconv.converter.options import parse_size

    try:
        expected = convert_file_size_to_int(text)
    except ValueError:
        expected = ValueError
    try:
        ours = parse_size(text)
    except ValueError:
        ours = ValueError
    assert ours == expected, text


def test_shard_size_in_bits_on_the_command_line(tmp_path):
    """`100kb` is 12,500 bytes, as transformers reads it: no shard holding several tensors has more
    tensor bytes (a larger tensor gets a shard of its own), and `100KB` gives fewer shards."""
    from safetensors import safe_open

    assert mconv("hf2mcore", TINY, tmp_path / "ckpt", "-q").exit_code == 0
    shards = {}
    for size in ("100kb", "100KB"):
        out = tmp_path / size
        assert mconv("mcore2hf", tmp_path / "ckpt", out, "--max-shard-size", size, "-q").exit_code == 0
        shards[size] = sorted(out.glob("*.safetensors"))
    for path in shards["100kb"]:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            data = sum(f.get_tensor(n).nbytes for n in names)
        assert len(names) == 1 or data <= 12_500, (path.name, data)
    assert len(shards["100kb"]) > len(shards["100KB"])


def test_shard_size_help_and_sizes_beyond_any_file():
    """--max-shard-size's help says how sizes are read; one beyond a 64-bit size is refused by click
    (exit 2) naming the option. Other help that said less than the commands do: verify compares
    quantization_config; Qwen3.5-MoE experts come back by default in the input's form."""
    from mconv.converter.options import MAX_SIZE

    assert "config.json quantization_config settings" in " ".join(mconv("verify", "--help").stdout.split())
    assert ("Qwen3.5-MoE: by default the experts come back as hf2mcore's input had them (fused or per expert"
            in " ".join(mconv("mcore2hf", "--help").stdout.split()))
    for command in ("mcore2hf", "export-lora"):
        text = " ".join(mconv(command, "--help").stdout.split())
        assert "GB, MB, KB are powers of 1000, GiB, MiB, KiB powers of 1024" in text, text
        assert "a lower-case final b means bits (100kb is 12,500 bytes)" in text, text
    for size in (f"{MAX_SIZE // 2**30 + 1}GiB", f"{10**10}GB"):
        done = mconv("mcore2hf", "ckpt", "out", "--max-shard-size", size)
        assert done.exit_code == 2 and "'--max-shard-size'" in done.output, done.output
        assert f"{size!r} is not a size from 1 byte to" in done.output, done.output


def test_verify_quiet_is_one_line(tmp_path):
    assert mconv("hf2mcore", TINY, tmp_path / "ckpt", "-q").exit_code == 0
    assert mconv("mcore2hf", tmp_path / "ckpt", tmp_path / "back", "-q").exit_code == 0
    result = mconv("verify", TINY, FIXTURES / "qwen3-tiny-tied", "-q")
    assert result.exit_code == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"mconv: error: {TINY} and {FIXTURES / 'qwen3-tiny-tied'} differ (") and "; the first: " in line
    assert len(mconv("verify", TINY, FIXTURES / "qwen3-tiny-tied").stderr.splitlines()) > 1  # the details without -q


def test_verify_compares_model_settings_and_tokenizer_files(tmp_path):
    """verify holds config.json's settings as mconv's table reads them (one setting spelled the 4.x
    way is no difference; another norm epsilon or rotary base is) and the tokenizer files byte for
    byte (new-user pass: a copy with other settings and no tokenizer.json verified identical)."""
    config = json.loads((TINY / "config.json").read_text())
    respelled = shutil.copytree(TINY, tmp_path / "respelled")
    theta = config["rope_parameters"]["rope_theta"]
    (respelled / "config.json").write_text(json.dumps(
        {**{k: v for k, v in config.items() if k != "rope_parameters"}, "rope_theta": theta}))
    same = mconv("verify", TINY, respelled)
    assert same.exit_code == 0 and "identical" in same.stdout, same.output
    changed = shutil.copytree(TINY, tmp_path / "changed")
    (changed / "config.json").write_text(json.dumps(
        {**config, "rms_norm_eps": 1e-5, "rope_parameters": {**config["rope_parameters"], "rope_theta": 10000.0},
         "eos_token_id": 7}))  # (a token id: the table does not read it, the engines do)
    (changed / "tokenizer.json").unlink()
    (changed / "tokenizer_config.json").write_text("{}")
    result = mconv("verify", TINY, changed)
    assert result.exit_code == 1, result.output
    assert "norm_eps 1e-06 vs 1e-05" in result.output and f"rope.rotary_base {theta} vs 10000.0" in result.output
    assert f"tokenizer.json: only in {TINY}" in result.output and "tokenizer_config.json: the files differ" in result.output
    assert f'config.json eos_token_id: {config["eos_token_id"]} vs 7' in result.output, result.output
    as_json = mconv("verify", TINY, changed, "--json")
    report = json.loads(as_json.stdout)
    assert as_json.exit_code == 1 and report["identical"] is False and report["tensors"] == 47, as_json.output
    assert f"tokenizer.json: only in {TINY}" in report["differences"] and len(report["differences"]) == 5
    assert json.loads(mconv("verify", TINY, respelled, "--json").stdout)["identical"] is True
    gelu = shutil.copytree(TINY, tmp_path / "gelu")  # a setting the table refuses: the configs compared as JSON
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    differs = mconv("verify", TINY, gelu)
    assert differs.exit_code == 1 and 'config.json hidden_act: "silu" vs "gelu"' in differs.output, differs.output


def test_a_merge_onto_an_fp8_base_says_it_wrote_it_dequantized(tmp_path):
    """export-lora --merge onto an FP8 base writes it dequantized (bf16), and says so as hf2mcore does
    (new-user pass: it did not); with --quantize fp8 it writes FP8 again and says nothing of it."""
    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path / "lora", TINY, Layout())
    assert mconv("hf2mcore", TINY, tmp_path / "m", "-q").exit_code == 0
    assert mconv("mcore2hf", tmp_path / "m", tmp_path / "fp8", "--quantize", "fp8", "-q").exit_code == 0
    merged = mconv("export-lora", lora, tmp_path / "merged", "--alpha", 8, "--merge", "--base-model", tmp_path / "fp8")
    assert merged.exit_code == 0, merged.output
    assert f"{tmp_path / 'fp8'} is FP8 (blocks 128x128): its weights are dequantized into bfloat16; pass --quantize " \
           "fp8 to export-lora --merge to write FP8 again" in " ".join(merged.output.split()), merged.output
    again = mconv("export-lora", lora, tmp_path / "again", "--alpha", 8, "--merge", "--base-model", tmp_path / "fp8",
                  "--quantize", "fp8")
    assert again.exit_code == 0 and "is FP8" not in again.output, again.output


def test_inspect_and_verify_take_peft_adapters(tmp_path):
    from peft import PeftConfig
    from safetensors.torch import save_file

    from tests.test_lora import lora_checkpoint

    lora, _ = lora_checkpoint(tmp_path / "lora", TINY, Layout(tp=2))
    adapter = tmp_path / "adapter"
    wrote = mconv("export-lora", lora, adapter, "--alpha", 16, "--base-model", "Qwen/Qwen3-8B")
    assert wrote.exit_code == 0 and wrote.stdout.startswith(f"wrote {adapter}: PEFT adapter"), wrote.output
    assert_readable_output(wrote)
    merged = mconv("export-lora", lora, tmp_path / "merged", "--alpha", 16, "--merge", "--base-model", TINY)
    assert merged.exit_code == 0 and merged.stdout.startswith(f"wrote {tmp_path / 'merged'}: merged model"), merged.output
    assert_readable_output(merged)
    info = json.loads(mconv("inspect", adapter, "--json").stdout)
    config, tensors = PeftConfig.from_pretrained(adapter), hf_tensors_of(adapter)
    assert info["adapter"] == {"peft_type": "LORA", "base_model": "Qwen/Qwen3-8B", "r": config.r,
                               "alpha": config.lora_alpha, "scale": config.lora_alpha / config.r,
                               "target_modules": sorted(config.target_modules)}
    assert info["size"] == {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()), "files": 1}
    text = mconv("inspect", adapter).stdout
    assert_readable(text)
    assert text.startswith(f"{adapter}: PEFT LORA adapter\n  base     Qwen/Qwen3-8B\n  adapter  r {config.r}, alpha 16")

    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    assert mconv("verify", adapter, copy).stdout.startswith(f"identical: {len(tensors)} tensors")
    changed = dict(tensors)
    name = sorted(changed)[0]
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1
    save_file(changed, copy / "adapter_model.safetensors")
    result = mconv("verify", adapter, copy, "-q")
    assert result.exit_code == 1 and f"the first: {name}: values differ" in result.stderr
    config_file = copy / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    save_file(tensors, copy / "adapter_model.safetensors")
    result = mconv("verify", adapter, copy, "-q")
    assert result.exit_code == 1 and "adapter_config.json: lora_alpha is 16 vs 32" in result.stderr
    config_file.write_text((adapter / "adapter_config.json").read_text())
    shutil.copy(TINY / "tokenizer.json", copy)  # an adapter served with its own tokenizer
    result = mconv("verify", adapter, copy, "-q")
    assert result.exit_code == 1 and f"tokenizer.json: only in {copy}" in result.stderr, result.stderr
    result = mconv("verify", adapter, TINY)
    assert result.exit_code == 2 and "is a PEFT adapter and" in result.stderr  # (not compared: verify's 1 is a difference)


def hf_tensors_of(adapter):
    from safetensors.torch import load_file

    return load_file(adapter / "adapter_model.safetensors")


def test_inspect_shows_a_hybrid_models_attention_kinds(tmp_path):
    """BailingMoeV3: MLA closes each group of layer_group_size layers, the others are KDA
    (reference/bailing-v3.md); the fixture has 4 layers in groups of 2."""
    assert json.loads((BAILING / "config.json").read_text())["layer_group_size"] == 2
    assert mconv("hf2mcore", BAILING, tmp_path / "ckpt", "-q").exit_code == 0
    for path in (BAILING, tmp_path / "ckpt"):
        assert "  layers   KDA (linear attention) 0, 2; MLA 1, 3\n" in mconv("inspect", path).stdout
        model = json.loads(mconv("inspect", path, "--json").stdout)["model"]
        assert model["kda_layers"] == [0, 2] and model["mla_layers"] == [1, 3]
    # Qwen3.5: gated attention every full_attention_interval layers (transformers' layer_types)
    from transformers import AutoConfig

    types = AutoConfig.from_pretrained(QWEN3_5).layer_types
    model = json.loads(mconv("inspect", QWEN3_5, "--json").stdout)["model"]
    assert model["linear_layers"] == [i for i, t in enumerate(types) if t == "linear_attention"] != []
    assert model["full_attention_layers"] == [i for i, t in enumerate(types) if t == "full_attention"] != []


def test_version_and_shell_completion():
    from importlib.metadata import version

    import mconv as package

    command = [sys.executable, "-m", "mconv"]
    done = subprocess.run(command + ["--version"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout == f"mconv {package.__version__}\n" and package.__version__ == version("mconv")
    env = {**os.environ, "_MCONV_COMPLETE": "bash_source"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "complete -o nosort -F _mconv_completion mconv" in done.stdout
    env = {**os.environ, "_MCONV_COMPLETE": "bash_complete", "COMP_WORDS": "mconv hf2", "COMP_CWORD": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["plain,hf2mcore"], done.stdout + done.stderr
    env.update(COMP_WORDS="mconv hf2mcore IN OUT --format ", COMP_CWORD="5")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["plain,torch_dist", "plain,torch"]
