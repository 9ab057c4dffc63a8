"""GPU benchmark of the live-engine API (run on a GPU machine; see README "Benchmarks").

For a Qwen3-8B-shaped dense model and a Qwen3-30B-A3B-shaped MoE model (layers reduced), bf16,
TP1, megatron-core GPTModel on the GPU, it measures in one run:
  - export: mconv.live.iter_hf_weights over the whole model vs a per-tensor device-to-device copy
    of the same bytes (the floor) vs a per-parameter convert_to_hf in the style of slime / AReaL
    (regex per parameter, QKV / GLU split by views, .contiguous() before sending);
  - import: mconv.live.load_hf_weights from safetensors vs reading the same files into GPU memory
    with safetensors.torch.load_file(device="cuda") (the floor).
Prints one JSON line per model with times (best of 3) and ratios.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
                          tie_word_embeddings=False),
}


DEVICE = "cuda"


def require_gpu(script: str) -> None:
    """Exit with one line where no CUDA GPU is visible: `script` measures on one."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} measures on a CUDA GPU and none is visible here"
                 + (" (python3 bench/live_bench.py --smoke checks the script on the CPU)" if script == "live_bench.py" else ""))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(*parts):
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def timed(fn, repeats=2):
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def build(hf: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mconv.converter import megatron_io as mio
    from mconv.converter.layout import Layout
    from tests.megatron_dist_oracle import core_config
    from mconv.converter.transforms import padded_vocab_size
    from mconv.mappings import architecture_for

    arch = architecture_for(hf)
    dims = arch.dims(hf)
    padded = padded_vocab_size(dims.vocab, 128, 1)
    args = mio.megatron_lm_args(Layout(), dims, arch.megatron_args(dims), "local", padded, torch.bfloat16, "torch_dist")
    config = core_config(args, torch.bfloat16)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", qk_l2_norm=False)
    with torch.device(DEVICE):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded, max_sequence_length=4096,
                         position_embedding_type="rope", rotary_base=1e6)
    model = model.to(torch.bfloat16)  # as Megatron's Float16Module does (local-spec norms are built in fp32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model, dims


def convert_to_hf_style(model, dims):
    """A per-parameter exporter as RL trainers write them: one regex and one conversion per
    parameter, fused tensors split with views, each output made contiguous for the collective."""
    out = []
    per_group = dims.heads // dims.groups
    for name, param in model.named_parameters():
        param = param.detach()
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m and m.group(2) == "self_attention.linear_qkv.weight":
            grouped = param.view(dims.groups, per_group + 2, dims.head_dim, dims.hidden)
            q, k, v = grouped.split([per_group, 1, 1], dim=1)
            out += [q.reshape(-1, dims.hidden).contiguous(), k.reshape(-1, dims.hidden).contiguous(),
                    v.reshape(-1, dims.hidden).contiguous()]
        elif m and m.group(2).endswith("linear_fc1.weight"):
            gate, up = param.chunk(2)
            out += [gate.contiguous(), up.contiguous()]
        elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out.append(param[: dims.vocab].contiguous())
        else:
            out.append(param.contiguous())
    return out


def verify(model, hf: dict, hf_dir: Path) -> bool:
    """After load_hf_weights, iter_hf_weights must give back every HF tensor bit for bit."""
    from mconv.converter.hf_io import HFCheckpoint
    from mconv.live import iter_hf_weights

    source, seen = HFCheckpoint(hf_dir), set()
    for bucket in iter_hf_weights([model], hf):
        for name, tensor in bucket:
            expected = source.read(name)
            if not torch.equal(tensor.cpu().to(expected.dtype).view(torch.int16), expected.view(torch.int16)):
                log("mismatch", name, tuple(tensor.shape), tensor.dtype, expected.dtype)
                return False
            seen.add(name)
    return seen == set(source.tensors)


def run(name: str, layers: int, workdir: Path) -> dict:
    from transformers import AutoConfig

    from fixtures.make_fixtures import make_synthetic
    from mconv.live import LiveModel, iter_hf_weights, load_hf_weights

    hf = dict(MODELS[name], num_hidden_layers=layers)
    log(name, "building the model")
    model, dims = build(hf)
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)

    def mconv_export():
        for bucket in iter_hf_weights([model], hf, bucket_bytes=1 << 30):
            for _, tensor in bucket:
                pass

    result = {"model": name, "layers": layers, "bytes": nbytes}
    log(name, f"{nbytes / 2**30:.2f} GiB of parameters; timing the copy floor")
    result["floor_copy_s"] = timed(lambda: [p.clone() for p in params])
    log(name, "timing iter_hf_weights")
    result["mconv_export_s"] = timed(mconv_export, repeats=5)
    result["plan_s"] = timed(lambda: LiveModel.of([model], hf), repeats=1)
    log(name, "timing the per-parameter baseline")
    result["per_param_baseline_s"] = timed(lambda: convert_to_hf_style(model, dims), repeats=5)
    result["export_vs_floor"] = result["mconv_export_s"] / result["floor_copy_s"]
    result["export_vs_baseline"] = result["mconv_export_s"] / result["per_param_baseline_s"]

    hf_dir = workdir / name
    config = AutoConfig.for_model(**{**{"model_type": "qwen3" if "Moe" not in hf["architectures"][0] else "qwen3_moe"},
                                     **hf})
    log(name, "export done", json.dumps(result))
    log(name, "writing the synthetic HF checkpoint")
    make_synthetic(hf_dir, config, shard_bytes=2_000_000_000, device=DEVICE)
    log(name, "timing reads")
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    result["floor_read_to_gpu_s"] = timed(lambda: [load_file(f, device=DEVICE) for f in files])
    result["mconv_load_s"] = timed(lambda: load_hf_weights([model], hf_dir))
    result["verified"] = verify(model, hf, hf_dir)
    result["load_vs_floor"] = result["mconv_load_s"] / result["floor_read_to_gpu_s"]
    result["hf_bytes"] = sum(f.stat().st_size for f in files)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense-layers", type=int, default=8)
    parser.add_argument("--moe-layers", type=int, default=6)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    options = parser.parse_args()
    global DEVICE
    if not options.smoke:
        require_gpu("live_bench.py")
    if options.smoke:
        DEVICE = "cpu"
        for hf in MODELS.values():
            hf.update(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
            if "num_experts" in hf:
                hf.update(num_experts=8, moe_intermediate_size=32)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo" if options.smoke else "nccl", init_method=f"file://{store}/store",
                                rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        if not options.smoke:
            model_parallel_cuda_manual_seed(0)
        workdir = Path(options.workdir or tempfile.mkdtemp())
        for name, layers in (("qwen3-8b", options.dense_layers), ("qwen3-30b-a3b", options.moe_layers)):
            print(json.dumps(run(name, layers, workdir)), flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
