"""Qwen3-VL dense and MoE: byte-exact round trips over layouts and both stacked-expert orientations,
transformers loading what mcore2hf writes, the orientation of square expert tensors decided
against transformers' own in-memory experts, and bad inputs."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fixtures.make_fixtures import make_qwen3_vl
from mconv import Layout, MconvError, hf2mcore, mcore2hf
from tests.conftest import FIXTURES, load_rank_file
from tests.qwen3_vl_oracle import PATCHES, example_inputs, hf_logits
from tests.test_errors import assert_refused, legacy, mconv
from tests.test_roundtrip import assert_bit_identical, read_all

DENSE, MOE = FIXTURES / "qwen3-vl-tiny", FIXTURES / "qwen3-vl-moe-tiny"
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def transposed_experts(tensors: dict) -> dict:
    """The other orientation of every stacked expert tensor ([E, a, b] -> [E, b, a])."""
    return {k: v.transpose(1, 2).contiguous() if k.endswith(STACKED) else v for k, v in tensors.items()}


@st.composite
def vl_case(draw):
    moe = draw(st.booleans())
    tp = draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(2, 4))
    deepstack = draw(st.sampled_from([[], [0], [0, 1]]))
    pp, vpp, first = 1, 1, None
    if layers - 1 >= max(1, len(deepstack)) and draw(st.booleans()):
        pp = 2  # the deepstack targets must stay on the first stage (chunk)
        if layers == 4 and len(deepstack) <= 1 and draw(st.booleans()):
            vpp = 2
        else:
            first = draw(st.integers(max(1, len(deepstack)), layers - 1))
    ep = draw(st.sampled_from([1, 2, 4])) if moe else 1
    etp = draw(st.sampled_from([e for e in (1, 2) if tp % e == 0])) if moe else 1
    text = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=16 * tp, num_key_value_heads=2,
                num_attention_heads=4, head_dim=8, vocab_size=draw(st.integers(60, 200)),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    if moe:
        text.update(num_local_experts=4, moe_intermediate_size=8 * etp * draw(st.sampled_from([1, 3])),
                    mlp_only_layers=sorted(draw(st.sets(st.integers(0, layers - 1), max_size=1))))
    vision = dict(depth=2, hidden_size=16, num_heads=2 * tp, intermediate_size=8 * tp, patch_size=2,
                  num_position_embeddings=16, out_hidden_size=32, deepstack_visual_indexes=deepstack)
    model = dict(moe=moe, text=text, vision=vision, tie_word_embeddings=draw(st.booleans()),
                 transposed_experts=draw(st.booleans()), dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])))
    layout = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first_stage_layers=first,
                    vocab_divisor=draw(st.sampled_from([1, 128])))
    return model, layout, draw(st.sampled_from(["local", "te"])), draw(st.sampled_from(["4.x", "5.x"]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=vl_case(), seed=st.integers(0, 2**16))
def test_round_trip_is_bit_identical(tmp_path_factory, case, seed):
    """HF -> Megatron -> HF gives back every byte; stacked experts in the orientation asked for."""
    model, layout, spec, orientation = case
    tmp = tmp_path_factory.mktemp("vl")
    hf = make_qwen3_vl(tmp / "hf", seed=seed, **model)
    hf2mcore(hf, tmp / "megatron", layout, spec=spec, fmt="torch", progress=False)
    mcore2hf(tmp / "megatron", tmp / "back", progress=False, expert_orientation=orientation if model["moe"] else None)
    original = read_all(hf)
    if model["transposed_experts"] != (orientation == "4.x"):
        original = transposed_experts(original)
    assert_bit_identical(original, read_all(tmp / "back"))


@pytest.mark.parametrize("fixture,orientation", [(DENSE, None), (MOE, "4.x"), (MOE, "5.x")])
def test_transformers_loads_output_without_missing_or_unexpected_keys(tmp_path, fixture, orientation):
    from transformers import AutoModelForImageTextToText

    hf2mcore(fixture, tmp_path / "m", Layout(tp=2, pp=2), spec="te", fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "back", max_shard_bytes=200_000, progress=False,
             expert_orientation=orientation)
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    model, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tensors = read_all(tmp_path / "back")
    expected = read_all(fixture)  # the fixture's experts are in the 4.x orientation
    assert_bit_identical(expected if orientation == "4.x" else transposed_experts(expected), tensors)
    # transformers' in-memory experts (5.x: nn.Linear orientation [E, 2I, h]) are the written ones.
    if fixture == MOE:
        written = tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"]
        memory = model.model.language_model.layers[0].mlp.experts.gate_up_proj.detach()
        assert torch.equal(memory, written if orientation == "5.x" else written.transpose(1, 2))


def test_config_written_for_transformers_4_and_5(tmp_path):
    """transformers 4.57 reads rope_theta + rope_scaling, num_experts and text_config's
    tie_word_embeddings; 5.x rope_parameters, num_local_experts and the top-level tie_word_embeddings
    (reference qwen3-vl.md, section 2: 4.57 crashes on a 5.x-only config). The 4.x expert orientation
    is [E, h, 2I] / [E, I, h], the shapes of 4.57's in-memory parameters."""
    hf2mcore(MOE, tmp_path / "m", Layout(ep=2), fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    text = json.loads((tmp_path / "back/config.json").read_text())["text_config"]
    assert text["rope_theta"] == text["rope_parameters"]["rope_theta"] == 1_000_000.0
    assert text["rope_scaling"]["mrope_section"] == text["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert text["num_experts"] == text["num_local_experts"] == 4
    assert text["norm_topk_prob"] is True  # vLLM 0.32 reads it; the model always renormalises its top-k
    # 4.57 ties lm_head by text_config's flag (5.x MoE text configs default it to true), 5.x by the top level.
    tensors = read_all(tmp_path / "back")
    assert text["tie_word_embeddings"] is False and "lm_head.weight" in tensors
    assert tuple(tensors["model.language_model.layers.2.mlp.experts.gate_up_proj"].shape) == (4, 64, 80)
    assert tuple(tensors["model.language_model.layers.2.mlp.experts.down_proj"].shape) == (4, 40, 64)


TRANSFORMERS_4 = Path(sys.prefix) / "tf-4.57"  # scripts/install.sh: transformers 4.57 and its hub/tokenizers


def transformers_4_logits(tmp_path: Path, dirs: list[Path], inputs: dict) -> dict[Path, dict]:
    """transformers 4.57's logits for `inputs` from each HF directory of `dirs`, loaded in one
    subprocess (tests/transformers4_load.py, from TRANSFORMERS_4), which must be 4.57 from there and
    match every key: no missing, unexpected or mismatched ones."""
    torch.save({**inputs, "__grid__": torch.tensor([PATCHES])}, tmp_path / "inputs.pt")
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("transformers4_load.py")),
                             str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt"), *map(str, dirs)],
                            env={**os.environ, "PYTHONPATH": str(TRANSFORMERS_4)}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(dirs):]]
    for report in reports:
        assert report["version"].startswith("4.57.") and report["file"].startswith(str(TRANSFORMERS_4)), report
        assert report["info"]["missing_keys"] == report["info"]["unexpected_keys"] == [], report
        assert report["info"]["mismatched_keys"] == [], report
    logits = torch.load(tmp_path / "logits.pt")
    return {path: logits[str(path)] for path in dirs}


needs_transformers_4 = pytest.mark.skipif(  # skipped only outside CI: scripts/install.sh installs it
    not TRANSFORMERS_4.is_dir() and not os.environ.get("CI"),
    reason=f"no transformers 4.57 at {TRANSFORMERS_4} (scripts/install.sh installs it there)")


@pytest.mark.slow
@needs_transformers_4
@pytest.mark.parametrize("fixture", [DENSE, MOE])
def test_transformers_4_57_loads_default_output(tmp_path, fixture):
    """transformers 4.57 (in a subprocess, from its own target dir) loads what mcore2hf writes by
    default (4.x expert orientation, config.json with both versions' keys) with no missing, unexpected
    or mismatched keys, and its logits (text-only and text+image) equal transformers 5.x's on the
    same files."""
    hf2mcore(fixture, tmp_path / "m", Layout(tp=2, ep=2 if fixture == MOE else 1), fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False)
    inputs = example_inputs(json.loads((fixture / "config.json").read_text()))
    four = transformers_4_logits(tmp_path, [tmp_path / "back"], inputs)[tmp_path / "back"]
    five = hf_logits(tmp_path / "back", inputs)
    for name in inputs:
        assert (four[name] - five[name]).abs().max() < 1e-5, name
        assert five[name].abs().max() > 0.1


@pytest.fixture(scope="module")
def square(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """Qwen3-VL-MoE models with a square stacked tensor, by moe_intermediate_size: 32 (hidden == 2I:
    gate_up_proj [4, 64, 64]) and 64 (hidden == I: down_proj [4, 64, 64]); each as transformers 5.17
    saves it (5.x orientation, float32) and converted to Megatron at EP2."""
    tmp = tmp_path_factory.mktemp("square")
    models = {}
    for moe_ffn in (32, 64):
        text = dict(hidden_size=64, moe_intermediate_size=moe_ffn, num_hidden_layers=2, mlp_only_layers=[])
        hf = make_qwen3_vl(tmp / f"hf-{moe_ffn}", moe=True, transposed_experts=False, text=text, dtype=torch.float32)
        hf2mcore(hf, tmp / f"m-{moe_ffn}", Layout(ep=2), fmt="torch", progress=False)
        models[moe_ffn] = hf, tmp / f"m-{moe_ffn}"
    return models


@pytest.mark.parametrize("moe_ffn", [32, 64])  # hidden == 2 * I (gate_up square), hidden == I (down square)
def test_square_expert_tensors_read_as_transformers_holds_them(tmp_path, square, moe_ffn):
    """With a square stacked tensor the orientation is decided from the other one: in both files
    (5.x as transformers 5.17 saved it, and its 4.x transpose) every expert's Megatron fc1 / fc2 is
    transformers' own in-memory expert (5.17 holds gate_up_proj [E, 2I, h], down_proj [E, h, I])."""
    from transformers import AutoModelForImageTextToText

    five, five_megatron = square[moe_ffn]
    four = Path(shutil.copytree(five, tmp_path / "four"))
    save_file(transposed_experts(load_file(four / "model.safetensors")), four / "model.safetensors",
              metadata={"format": "pt"})
    hf2mcore(four, tmp_path / "4", Layout(ep=2), fmt="torch", progress=False)
    experts = AutoModelForImageTextToText.from_pretrained(five).model.language_model.layers[1].mlp.experts
    for megatron in (five_megatron, tmp_path / "4"):
        for ep in range(2):
            state = load_rank_file(megatron / f"release/mp_rank_00_{ep:03d}/model_optim_rng.pt")["model"]
            for local in range(2):
                prefix = f"language_model.decoder.layers.1.mlp.experts.local_experts.{local}."
                assert torch.equal(state[prefix + "linear_fc1.weight"], experts.gate_up_proj[2 * ep + local])
                assert torch.equal(state[prefix + "linear_fc2.weight"], experts.down_proj[2 * ep + local])


@pytest.mark.parametrize("moe_ffn,tensor", [(32, "gate_up_proj"), (64, "down_proj")])
def test_square_stacked_experts_need_an_orientation(tmp_path, square, moe_ffn, tensor):
    """transformers 5.x transposes a stacked tensor only where its shape differs from its own, so it
    misreads a square one in the 4.x orientation, silently (logits off by > 0.1), and 4.57 refuses the
    5.x one: mcore2hf (which wrote 4.x without a word), save_hf_weights and
    iter_hf_weights(stacked_experts=True) refuse to choose, naming the tensor and the option. With
    5.x, transformers 5.x gives the original model's logits."""
    from mconv.live import iter_hf_weights, save_hf_weights

    hf, megatron = square[moe_ffn]
    square_tensor = f"model.language_model.layers.*.mlp.experts.{tensor} [4, 64, 64] are square"
    assert_refused(mconv("mcore2hf", megatron, tmp_path / "out"), tmp_path / "out", square_tensor,
                   "give --expert-orientation 4.x for transformers 4.x or vLLM, or --expert-orientation 5.x for "
                   "transformers 5.x")
    library = re.escape(square_tensor) + r".*give expert_orientation='4\.x' for transformers 4\.x"
    with pytest.raises(MconvError, match=library):
        mcore2hf(megatron, tmp_path / "out", progress=False)
    with pytest.raises(MconvError, match=library):  # checked before the model is looked at
        next(iter_hf_weights([], hf, stacked_experts=True))
    with pytest.raises(MconvError, match=library):
        save_hf_weights([], tmp_path / "live", hf)
    inputs = example_inputs(json.loads((hf / "config.json").read_text()))
    original = hf_logits(hf, inputs)
    for orientation, error in (("5.x", lambda e: e < 1e-5), ("4.x", lambda e: e > 0.1)):
        mcore2hf(megatron, tmp_path / orientation, progress=False, expert_orientation=orientation)
        logits = hf_logits(tmp_path / orientation, inputs)
        for name in inputs:
            assert error((logits[name] - original[name]).abs().max()), (orientation, name)


@pytest.mark.slow
@needs_transformers_4
def test_transformers_4_57_reads_square_experts_given_4x(tmp_path, square):
    """The other half: transformers 4.57 loads `--expert-orientation 4.x` output of both square
    models with every key matched and gives the original model's logits (transformers 5.17's on the
    files it saved)."""
    dirs, expected = [], {}
    for moe_ffn, (hf, megatron) in square.items():
        dirs.append(tmp_path / str(moe_ffn))
        mcore2hf(megatron, dirs[-1], progress=False, expert_orientation="4.x")
        inputs = example_inputs(json.loads((hf / "config.json").read_text()))
        expected[dirs[-1]] = hf_logits(hf, inputs)
    four = transformers_4_logits(tmp_path, dirs, inputs)  # the configs differ in moe_intermediate_size only
    for out in dirs:
        for name in inputs:
            assert (four[out][name] - expected[out][name]).abs().max() < 1e-5, (out.name, name)


def test_dry_run_and_inspect(tmp_path):
    result = mconv("hf2mcore", MOE, tmp_path / "m", "--tp", "2", "--ep", "2", "--format", "torch", "--dry-run")
    assert result.exit_code == 0 and "mp_rank_00_000" in result.output and not (tmp_path / "m").exists()
    result = mconv("inspect", MOE)
    assert result.exit_code == 0 and "Qwen3VLMoeForConditionalGeneration" in result.output


def _edit(tmp_path, source, edit) -> str:
    hf = shutil.copytree(source, tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


def test_missing_vision_tensor(tmp_path):
    hf = _edit(tmp_path, DENSE, lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"))
    assert_refused(legacy(hf, tmp_path / "out"), tmp_path / "out", "model.visual.blocks.1.attn.qkv.bias", "missing")


def test_missing_vision_tensor_in_megatron_checkpoint(tmp_path):
    """mcore2hf: a rank file without one of its vision tensors (TP rank 1 of 2) names file and tensor."""
    assert legacy(DENSE, tmp_path / "m", "--tp", "2").exit_code == 0
    path = tmp_path / "m/release/mp_rank_01/model_optim_rng.pt"
    state = load_rank_file(path)
    del state["model"]["vision_model.decoder.layers.1.self_attention.linear_qkv.bias"]
    torch.save(state, path)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "out"), tmp_path / "out",
                   "mp_rank_01/model_optim_rng.pt: tensor vision_model.decoder.layers.1.self_attention.linear_qkv.bias",
                   "missing")


def test_stacked_experts_of_no_known_orientation(tmp_path):
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    hf = _edit(tmp_path, MOE, lambda t: t.update({name: t[name].transpose(1, 2).contiguous()}))
    assert_refused(legacy(hf, tmp_path / "out"), tmp_path / "out", "cannot tell the orientation",
                   "layers.2.mlp.experts.gate_up_proj [4, 64, 80]", "down_proj [4, 64, 40]")


def test_vision_heads_not_divisible_by_tp(tmp_path):
    hf = make_qwen3_vl(tmp_path / "hf", text={"num_key_value_heads": 4}, vision={"num_heads": 2})
    assert_refused(legacy(hf, tmp_path / "out", "--tp", "4", "--vocab-divisor", "1"), tmp_path / "out",
                   "vision_config.num_heads=2 is not divisible by --tp 4")


@pytest.mark.parametrize("options", [("--pp", "2", "--first-stage-layers", "1"), ("--pp", "3", "--vpp", "2")])
def test_deepstack_off_the_first_stage(tmp_path, options):
    """Uneven PP, and VPP (6 layers: one per chunk): the first chunk, which holds the vision tower, must
    hold the language layers the deepstack mergers feed."""
    assert_refused(legacy(DENSE, tmp_path / "out", *options), tmp_path / "out",
                   "2 deepstack_visual_indexes", "first pipeline stage (chunk) holds only 1 layer")


@pytest.mark.parametrize("fixture,moe", [(DENSE, False), (MOE, True)])
def test_torch_dist_round_trip_and_keys(tmp_path, fixture, moe):
    """torch_dist keys come from mbridge's Qwen3VLModel: layers stacked in the dense model; per layer in
    the MoE model with a dense layer (its moe_layer_freq list), the vision blocks too (their config is a
    copy of the language one); vision norms under their local names. megatron-core's loader reading
    them into the model is tested in test_qwen3_vl_oracle.py."""
    from mconv.converter.torch_dist_io import TorchDistReader

    hf2mcore(fixture, tmp_path / "m", Layout(tp=2), progress=False)
    keys = TorchDistReader.open(tmp_path / "m/release").tensors
    if moe:
        assert keys["vision_model.decoder.layers.2.input_layernorm.bias"].shape == (32,)
        assert keys["language_model.decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].shape == (4, 80, 64)
    else:
        assert keys["vision_model.decoder.layers.input_layernorm.bias"].shape == (3, 32)
        assert keys["language_model.decoder.layers.mlp.linear_fc1.weight"].shape == (6, 160, 64)
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False, expert_orientation="5.x" if moe else None)
    expected = read_all(fixture)
    assert_bit_identical(transposed_experts(expected) if moe else expected, read_all(tmp_path / "back"))


def test_torch_dist_needs_more_layers_than_deepstack_targets(tmp_path):
    hf = make_qwen3_vl(tmp_path / "hf", text={"num_hidden_layers": 2})
    assert_refused(mconv("hf2mcore", hf, tmp_path / "out", "-q"), tmp_path / "out",
                   "needs more language layers (2) than deepstack targets (2)")


def test_mrope_section_must_cover_head_dim(tmp_path):
    hf = shutil.copytree(DENSE, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(MconvError, match="mrope_section"):
        hf2mcore(hf, tmp_path / "out", Layout(), fmt="torch", progress=False)


def test_workers_write_the_same_bytes(tmp_path):
    """Worker processes stack the experts they write (4.x: an expert's gate and up are written together)."""
    hf2mcore(MOE, tmp_path / "m", Layout(ep=2), fmt="torch", progress=False)
    mcore2hf(tmp_path / "m", tmp_path / "one", progress=False, max_shard_bytes=150_000)
    mcore2hf(tmp_path / "m", tmp_path / "two", progress=False, max_shard_bytes=150_000, workers=2)
    for path in sorted((tmp_path / "one").iterdir()):
        assert path.read_bytes() == (tmp_path / "two" / path.name).read_bytes(), path.name


@pytest.mark.parametrize("fixture,options,message", [
    ("qwen3-moe-tiny", dict(stacked_experts=True), "Qwen3MoeForCausalLM checkpoints keep their experts per expert"),
    ("qwen3-vl-moe-tiny", dict(stacked_experts=True, expert_orientation="6.x"), "must be one of 4.x, 5.x, got '6.x'"),
    ("qwen3-vl-moe-tiny", dict(expert_orientation="5.x"), "applies with stacked_experts=True"),
])
def test_live_stacked_experts_refused(fixture, options, message):
    """Checked before the model is looked at (no parallel state needed here)."""
    from mconv.live import iter_hf_weights

    with pytest.raises(MconvError, match=message):
        next(iter_hf_weights([], FIXTURES / fixture, **options))


@pytest.mark.parametrize("fixture,why", [("qwen3-vl-tiny", "; Qwen3VLForConditionalGeneration has no experts"),
                                         ("qwen3-moe-tiny", "; Qwen3MoeForCausalLM checkpoints keep their experts per expert")])
def test_expert_orientation_is_refused_for_models_without_stacked_experts(tmp_path, fixture, why):
    """An option that would change nothing is refused, not ignored (CLI: one line, exit 1, no output),
    saying why: a dense model has no experts at all."""
    hf2mcore(FIXTURES / fixture, tmp_path / "m", Layout(), fmt="torch", progress=False)
    assert_refused(mconv("mcore2hf", tmp_path / "m", tmp_path / "back", "--expert-orientation", "5.x"), tmp_path / "back",
                   "--expert-orientation applies to stacked HF experts (Qwen3-VL-MoE, Qwen3.5-MoE)" + why)


def test_buckets_keep_a_stacked_tensors_experts_together():
    """The live schedule's bucketing: items of one stacked tensor (same key) never split, others by size."""
    from mconv.live.chunks import _buckets

    items = [("a", None), ("e0", "s"), ("e1", "s"), ("e2", "s"), ("b", None), ("f0", "t"), ("f1", "t")]
    buckets = list(_buckets(items, lambda item: 10, 25, lambda item: item[1]))
    assert [[name for name, _ in b] for b in buckets] == [["a"], ["e0", "e1", "e2"], ["b"], ["f0", "f1"]]
    assert [[n for n, _ in b] for b in _buckets(items, lambda item: 10, 25)] == [
        ["a", "e0"], ["e1", "e2"], ["b", "f0"], ["f1"]]


def test_verify_tells_stacked_experts_of_another_orientation(tmp_path):
    """verify presents stacked experts per expert (as every command reads them), so files in the
    two orientations hold equal experts; they are still not the same files, and verify says so
    (it reported them bit-identical)."""
    other = tmp_path / "5.x"
    shutil.copytree(MOE, other)
    tensors = load_file(other / "model.safetensors")
    stacked = sorted(name for name in tensors if name.endswith(STACKED))
    save_file({name: t.transpose(1, 2).contiguous() if name in stacked else t for name, t in tensors.items()},
              other / "model.safetensors", metadata={"format": "pt"})
    result = mconv("verify", MOE, other)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    name = stacked[0]
    shape = list(tensors[name].shape)
    assert f"  {name}: stored as {shape} vs {[shape[0], shape[2], shape[1]]} (stacked experts" in lines[0]
    assert all(line.endswith(": the same values, stored differently") for line in lines[:-1]), lines
    assert len(lines) == len(stacked) + 1 and lines[-1].startswith("mconv: error:")
    tensors[name][1, 0, 0] += 1  # expert 1's first module now differs: said on its stacked tensor's line too
    save_file({n: t.transpose(1, 2).contiguous() if n in stacked else t for n, t in tensors.items()},
              other / "model.safetensors", metadata={"format": "pt"})
    lines = mconv("verify", MOE, other).output.splitlines()
    assert lines[0].endswith(f"{name}: stored as {shape} vs {[shape[0], shape[2], shape[1]]} (stacked experts in "
                             "another orientation or form): its experts' values differ (listed apart)"), lines
    assert sum(".experts.1." in line for line in lines) == 1 and len(lines) == len(stacked) + 2, lines
    assert mconv("verify", MOE, MOE, "-q").exit_code == 0
