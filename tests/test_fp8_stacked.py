"""Stacked FP8 experts (Qwen3-VL-MoE, transformers' fused form: `mlp.experts.gate_up_proj` float8_e4m3fn
with `gate_up_proj_scale_inv` [E, ceil(rows/128), ceil(cols/128)], the block grid of each expert's
matrix as stored), in both stored orientations: read as the plain-torch dequantization formula gives them
(transformers drops such scales: reference fp8.md 3.1), written as compressed-tensors' block
quantization of each expert's stored matrix, and FP8 -> Megatron -> FP8 gives the input's bytes.
hidden 300 and moe_intermediate 100: edge blocks on both sides, and a block of gate_up_proj holding
rows of gate and of up; ETP2 reads each expert's module in halves (50 rows or columns)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from mconv import Layout, hf2mcore, mcore2hf
from tests.test_fp8 import KEYS, bits, needs_compressed_tensors, reference_quantize

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
LAYOUT = dict(tp=2, ep=2, etp=2)


def stored_experts(tensors: dict, orientation: str) -> dict:
    """The fixture's tensors (stacked experts in the 4.x orientation [E, h, 2I]) with the stacked
    experts in `orientation` (5.x: [E, 2I, h])."""
    return {k: v.transpose(1, 2).contiguous() if orientation == "5.x" and k.endswith(STACKED) else v
            for k, v in tensors.items()}


def write(directory: Path, tensors: dict, config: dict) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def quantized(name: str) -> bool:
    return name.endswith(("_proj.weight", *STACKED)) and not name.startswith("model.visual.")


def formula(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-wise dequantization written out: each element times its 128x128 block's scale, over the
    last two dimensions (each expert's stored matrix)."""
    per_element = scale.float().repeat_interleave(128, -2).repeat_interleave(128, -1)
    return (q.float() * per_element[..., :q.shape[-2], :q.shape[-1]]).to(torch.bfloat16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """"bf16": a tiny Qwen3-VL-MoE (4.x experts); "fp8-4.x" / "fp8-5.x": it in FP8, every language
    projection and each expert's stored matrix quantized by compressed-tensors (float32 scales), the
    vision tower bf16 and, with the other kept modules, in modules_to_not_convert."""
    from safetensors.torch import load_file

    from fixtures.make_fixtures import make_qwen3_vl

    root = tmp_path_factory.mktemp("fp8-stacked")
    bf16 = make_qwen3_vl(root / "bf16", moe=True, text=dict(
        hidden_size=300, moe_intermediate_size=100, num_hidden_layers=2, mlp_only_layers=[], num_local_experts=2),
        vision=dict(out_hidden_size=300, depth=1, deepstack_visual_indexes=[0]))
    made = {"bf16": bf16}
    config = json.loads((bf16 / "config.json").read_text())
    for orientation in ("4.x", "5.x"):
        tensors, kept = {}, []
        for name, tensor in stored_experts(load_file(bf16 / "model.safetensors"), orientation).items():
            if quantized(name):
                pairs = [reference_quantize(matrix) for matrix in (tensor if tensor.dim() == 3 else [tensor])]
                q, scale = (torch.stack(x) for x in zip(*pairs)) if tensor.dim() == 3 else pairs[0]
                tensors[name], tensors[name + "_scale_inv"] = q, scale
            else:
                tensors[name] = tensor
                kept += [name.removesuffix(".weight")] if name.endswith(".weight") else []
        made[f"fp8-{orientation}"] = write(root / f"fp8-{orientation}", tensors, {
            **config, "quantization_config": {**KEYS, "modules_to_not_convert": kept}})
    return made


@needs_compressed_tensors
@pytest.mark.parametrize("orientation", ["4.x", "5.x"])
def test_stacked_fp8_read_as_the_formula_and_round_trip(models, tmp_path, orientation):
    """hf2mcore of stacked FP8 writes the rank files hf2mcore writes of a bf16 checkpoint holding the
    formula's dequantization of it; `mcore2hf --quantize fp8` of them gives the input back bit for bit
    (`mconv verify`), in the input's orientation; inspect says it is FP8."""
    from safetensors.torch import load_file

    from mconv.converter import megatron_io as mio
    from tests.conftest import load_rank_file
    from tests.test_errors import mconv

    source = models[f"fp8-{orientation}"]
    tensors = load_file(source / "model.safetensors")
    plain = {name: formula(t, tensors[name + "_scale_inv"]) if name + "_scale_inv" in tensors else t
             for name, t in tensors.items() if not name.endswith("_scale_inv")}
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    dequantized = write(tmp_path / "dequantized", plain, config)
    layout = Layout(**LAYOUT)
    for hf, out in ((source, tmp_path / "m"), (dequantized, tmp_path / "m-plain")):
        hf2mcore(hf, out, layout, fmt="torch", progress=False)
    for rank in layout.ranks():
        ours, theirs = (load_rank_file(mio.rank_file(d / "release", layout, rank))["model"]
                        for d in (tmp_path / "m", tmp_path / "m-plain"))
        assert ours.keys() == theirs.keys()
        for key, tensor in ours.items():
            assert tensor is None if theirs[key] is None else torch.equal(bits(tensor), bits(theirs[key])), key
    mcore2hf(tmp_path / "m", tmp_path / "back", progress=False, quantize="fp8", expert_orientation=orientation)
    result = mconv("verify", source, tmp_path / "back")
    assert result.exit_code == 0 and "identical" in result.output, result.output
    said = " ".join(mconv("inspect", source).stdout.split())
    assert "block-wise FP8" in said and "dequantize them" in said, said


@needs_compressed_tensors
def test_stacked_fp8_written_as_compressed_tensors(models, tmp_path):
    """`mcore2hf --quantize fp8` of the bf16 model (TP2/EP2/ETP2), in both orientations: each expert's
    FP8 bytes and scales are compressed-tensors' quantization of that expert's stored matrix, the
    other language projections' too; the vision tower is bf16 as given and in modules_to_not_convert."""
    from tests.conftest import hf_tensors

    original = hf_tensors(models["bf16"])
    hf2mcore(models["bf16"], tmp_path / "m", Layout(**LAYOUT), fmt="torch", progress=False)
    for orientation in ("4.x", "5.x"):
        out = tmp_path / orientation
        mcore2hf(tmp_path / "m", out, progress=False, quantize="fp8", expert_orientation=orientation)
        written = hf_tensors(out)
        expected = stored_experts(original, orientation)
        for name, tensor in expected.items():
            if not quantized(name):
                assert torch.equal(bits(written[name]), bits(tensor)), name
                continue
            for i, matrix in enumerate(tensor if tensor.dim() == 3 else [tensor]):
                q, scale = reference_quantize(matrix)
                if tensor.dim() == 3:
                    assert written[name + "_scale_inv"].shape == (len(tensor), *scale.shape)
                ours_q, ours_scale = ((written[name][i], written[name + "_scale_inv"][i]) if tensor.dim() == 3
                                      else (written[name], written[name + "_scale_inv"]))
                assert torch.equal(bits(ours_q), bits(q)) and torch.equal(ours_scale, scale), (name, i)
        assert len(written) == len(expected) + sum(map(quantized, expected))
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        kept = set(config.pop("modules_to_not_convert"))
        assert config == KEYS and "model.visual.blocks.0.attn.qkv" in kept and "model.visual.merger.linear_fc2" in kept
        assert {n.removesuffix(".weight") for n in expected if n.endswith(".weight") and not quantized(n)} == kept


@needs_compressed_tensors
def test_bad_stacked_fp8_refused_in_one_line(models, tmp_path):
    """A stacked scale of the other orientation's grid, one holding NaN, and a missing one: one line
    naming the tensor (and the file holding a bad value); inspect says the shape."""
    from safetensors.torch import load_file, save_file

    from tests.test_errors import assert_refused, mconv

    weight = "model.language_model.layers.1.mlp.experts.gate_up_proj"  # 4.x [2, 300, 200]: grid [2, 3, 2]

    def variant(label, change) -> Path:
        hf = Path(shutil.copytree(models["fp8-4.x"], tmp_path / label))
        tensors = load_file(hf / "model.safetensors")
        change(tensors)
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
        return hf

    def transposed(t):
        t[weight + "_scale_inv"] = t[weight + "_scale_inv"].transpose(1, 2).contiguous()

    def nan(t):
        t[weight + "_scale_inv"][1, 2, 1] = float("nan")

    cases = [(variant("shape", transposed), (f"tensor {weight}_scale_inv is float32 [2, 2, 3]", "[2, 3, 2]")),
             (variant("nan", nan), (f"nan/model.safetensors: tensor {weight}_scale_inv", "inf, NaN or negative")),
             (variant("missing", lambda t: t.pop(weight + "_scale_inv")), (weight, "no block scale"))]
    for hf, fragments in cases:
        assert_refused(mconv("hf2mcore", hf, tmp_path / "out"), tmp_path / "out", *fragments)
    said = " ".join(mconv("inspect", tmp_path / "shape").stdout.split())
    assert f"tensor {weight}_scale_inv is float32 [2, 2, 3]" in said and "refuse it" in said, said
