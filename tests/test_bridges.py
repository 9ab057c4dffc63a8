"""mconv.live on Megatron models built by the two bridges trainers use (AReaL's `bridge_type`):
mbridge (`AutoBridge.from_config(...).get_model(...)`) and Megatron-Bridge
(`AutoBridge.from_hf_pretrained(...).to_megatron_provider(...)`, `provide_distributed_model(...)`),
tiny Qwen3 (TP2) and all-MoE Qwen3-MoE (TP2/EP2/ETP1), in gloo processes on the CPU.

Oracles (none of them ours): transformers' logits for the forward after `load_hf_weights`; the
HF files for every tensor `iter_hf_weights` yields; each bridge's own HF export and HF save for
the same model (tensor bytes); megatron-core's `dist_checkpointing.save` of the mbridge-built
model and Megatron-Bridge's `save_megatron_model`, read back by `mcore2hf` (bytes of the HF
source); each bridge's own HF loader reading what `save_hf_weights` wrote (parameter bytes).

How the bridges are made to build on a CPU without Transformer Engine (see README, "Training
engines and the bridges"):
- mbridge hard-codes `use_transformer_engine=True` in `_get_transformer_layer_spec` and names only
  Transformer Engine's fused norms in its tables; the bridge instance gets megatron-core's local
  spec and the two local-spec norm names (`input_layernorm`, `pre_mlp_layernorm`) in its own
  mapping tables. transformers 5 configs keep `rope_theta` in `rope_parameters`; it is copied to
  the attribute mbridge reads. Its DDP wrapper (megatron-core's) is used.
- Megatron-Bridge is installed with `--no-deps` (plus omegaconf). Its package `__init__`s import
  every model family, several of which import Transformer Engine; so `megatron.bridge`,
  `.models` and `.models.qwen` are entered as bare namespace packages and only the modules a
  Qwen3 conversion needs are imported. One of those, `peft/lora_layers.py`, imports
  `transformer_engine.pytorch` at module level for its TE-fused LoRA class, which a local-spec
  model never instantiates; it is imported with a placeholder module standing for
  `transformer_engine.pytorch` (three class names used in annotations and isinstance checks),
  removed from sys.modules right after, so megatron-core never sees it. `peft.utils.HAVE_TE` is
  computed True from placeholder names megatron-core defines without Transformer Engine, and is
  set to False (the truth) so its LoRA takes the non-TE branches. Its own
  `local_layer_spec` builds the model; its DDP wrapper needs a CUDA stream, so the model is left
  unwrapped, and its LoRA wrapping (`LoRA(...)(model)`, `.to_wrap.` / `.adapter.` names) is
  applied instead.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import FIXTURES, load_rank_file
from tests.megatron_oracle import _cpu_shims, _free_port, hf_logits, import_megatron_bridge, read_config
from tests.ranks import start_ranks

TOKENS = list(range(7, 80, 6))
HUB_NAME = "tiny-org/qwen3-tiny-fp32"


def mbridge_model(hf: str, tp: int, ep: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from transformers import AutoConfig

    from mbridge import AutoBridge

    config = AutoConfig.from_pretrained(hf)
    config.rope_theta = config.rope_parameters["rope_theta"]
    bridge = AutoBridge.from_config(config, dtype=torch.float32)
    bridge.set_extra_args(use_cpu_initialization=True, sequence_parallel=False, variable_seq_lengths=False,
                          moe_token_dispatcher_type="allgather", masked_softmax_fusion=False,
                          persist_layer_norm=False, moe_grouped_gemm=False, bias_activation_fusion=False,
                          bias_dropout_fusion=False)
    bridge._get_transformer_layer_spec = lambda vp_stage=None: get_gpt_decoder_block_spec(
        bridge.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    layer = "model.layers.{layer_number}."
    bridge._OTHER_MAPPING = {"input_layernorm.weight": [layer + "input_layernorm.weight"]}
    bridge._MLP_MAPPING = {"pre_mlp_layernorm.weight": [layer + "post_attention_layernorm.weight"],
                           **bridge._MLP_MAPPING}
    model = bridge.get_model(wrap_with_ddp=True, bf16=False, use_cpu_initialization=True,
                             ddp_config={"use_distributed_optimizer": False, "grad_reduce_in_fp32": False})
    return bridge, model


def megatron_bridge_model(hf: str, tp: int, ep: int):
    AutoBridge, local_layer_spec = import_megatron_bridge()
    bridge = AutoBridge.from_hf_pretrained(hf)
    provider = bridge.to_megatron_provider(load_weights=False)
    settings = dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                    sequence_parallel=False, transformer_layer_spec=local_layer_spec, params_dtype=torch.float32,
                    pipeline_dtype=torch.float32, bf16=False, fp16=False, moe_token_dispatcher_type="allgather",
                    attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
                    gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                    bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                    moe_permute_fusion=False, moe_grouped_gemm=False)
    for key, value in settings.items():
        setattr(provider, key, value)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True, bf16=False,
                                               fp16=False)
    return bridge, model


def mconv_layout(info: dict):
    """The layout hf2mcore --dry-run needs to count a torch_dist checkpoint's tensors: TP1 with the
    checkpoint's padded vocabulary."""
    from mconv import Layout

    return Layout(vocab_divisor=info["model"]["padded_vocab"])


def bridge_io(kind: str, ep: int) -> bool:
    """Whether the bridge's own export, save and load run on this model. mbridge's tables name
    experts only as Transformer Engine's grouped GEMM (`mlp.experts.linear_fc1.weight{i}`), which
    cannot be built without Transformer Engine; a local-spec MoE model has SequentialMLP experts."""
    return not (kind == "mbridge" and ep > 1)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _worker(rank: int, kind: str, hf: str, hf_dir: Path, tp: int, ep: int, port: int, out: Path):
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    world = max(tp, ep)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    import mconv.live

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(0)
    bridge, model = (mbridge_model if kind == "mbridge" else megatron_bridge_model)(hf, tp, ep)
    for chunk in model:
        chunk.eval()
    result = {"wrapper": type(model[0]).__name__}

    mconv.live.load_hf_weights(model, hf)  # `hf` may be a hub name
    # The bridge route's Megatron checkpoint: the model's own sharded state dict saved by
    # megatron-core, as trainers using mbridge do (slime) and as Megatron-Bridge's
    # save_megatron_model does inside megatron.bridge.training (which needs nvidia-modelopt and
    # cannot be imported here).
    if rank == 0:
        (out / "bridge-ckpt" / "release").mkdir(parents=True)
        (out / "bridge-ckpt" / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()
    core = mconv.live.chunks._unwrap(model[0])
    dist_checkpointing.save({"model": core.sharded_state_dict()}, str(out / "bridge-ckpt" / "release"))
    if kind == "megatron-bridge" and ep == 1:
        from megatron.bridge.peft.lora import LoRA

        model = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=4, alpha=8)(
            model, training=False)  # B starts at zero: the merged weights are the base weights
        result["lora_names"] = [n for n, _ in model[0].named_parameters() if ".to_wrap." in n or ".adapter." in n][:4]
    loaded = {n: p.detach().clone() for n, p in model[0].named_parameters() if ".adapter." not in n}

    tokens = torch.tensor([TOKENS])
    mask = torch.triu(torch.ones(1, 1, len(TOKENS), len(TOKENS), dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model[0](tokens, torch.arange(len(TOKENS)).unsqueeze(0), mask)
        # The bridges build models with parallel_output (vocabulary-parallel logits): gather them.
        result["logits"] = gather_from_tensor_model_parallel_region(logits).float()

    result["mconv"] = {n: _bytes(t) for bucket in mconv.live.iter_hf_weights(model, hf, bucket_bytes=50_000)
                       for n, t in bucket}
    mconv.live.save_hf_weights(model, out / "mconv-hf", hf, max_shard_bytes=200_000)
    if not bridge_io(kind, ep):
        torch.save(result, out / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
        return
    exported = (bridge.export_weights(model) if kind == "mbridge" else
                bridge.export_hf_weights(model, cpu=True, show_progress=False))
    result["bridge"] = {n: _bytes(t) for n, t in exported}
    if kind == "mbridge":
        # mbridge's save lays its shards out like the source checkpoint's index, which its own
        # load_weights records; mconv loaded this model, so point it at the source.
        bridge.safetensor_io = bridge._get_safetensor_io(hf)
        bridge.save_weights(model, str(out / "bridge-hf"))
    # (Megatron-Bridge's save_hf_weights imports nvidia-modelopt, which is not installed here; it
    # writes what export_hf_weights yields, compared above.)
    dist.barrier()

    # What mconv wrote loads through the bridge's own HF loader into the same parameters.
    with torch.no_grad():
        for p in model[0].parameters():
            p.zero_()
    if kind == "mbridge":
        bridge.load_weights(model, str(out / "mconv-hf"))
    else:
        bridge.load_hf_weights(model, str(out / "mconv-hf"))
    reloaded = dict(model[0].named_parameters())
    result["reload_mismatch"] = [n for n, p in loaded.items() if _bytes(p) != _bytes(reloaded[n])]
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """fp32 HF models (the bridges build fp32 models here, so every comparison is bit-exact): a
    tiny Qwen3, and an all-MoE Qwen3-MoE (Megatron-Bridge's Qwen3-MoE bridge makes every layer
    MoE), both with the fixtures' shapes."""
    from fixtures.make_fixtures import make_qwen3, make_qwen3_moe

    tmp = tmp_path_factory.mktemp("bridges")
    return {"dense": make_qwen3(tmp / "dense", dtype=torch.float32),
            "moe": make_qwen3_moe(tmp / "moe", dtype=torch.float32, mlp_only_layers=[])}


@pytest.mark.slow
@pytest.mark.parametrize("kind,model,tp,ep", [
    ("mbridge", "dense", 2, 1),
    ("mbridge", "moe", 2, 2),
    ("megatron-bridge", "dense", 2, 1),
    ("megatron-bridge", "moe", 2, 2),
])
def test_bridge_built_model(models, tmp_path, monkeypatch, kind, model, tp, ep):
    from safetensors.torch import load_file

    from mconv import mcore2hf
    from mconv.converter.hf_io import HFCheckpoint
    from tests.test_hub import add_snapshot

    hf_dir = models[model]
    hf = str(hf_dir)
    if kind == "mbridge" and model == "dense":
        # A hub name, resolved in the worker processes from an offline cache (both by mconv and by
        # the bridge's transformers AutoConfig).
        add_snapshot(tmp_path / "hf-home" / "hub", HUB_NAME, hf_dir, "c" * 40, "main")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        hf = HUB_NAME
    out = tmp_path / "out"
    out.mkdir()
    start_ranks(_worker, args=(kind, hf, hf_dir, tp, ep, _free_port(), out), nprocs=max(tp, ep))
    results = [load_rank_file(out / f"rank{r}.pt") for r in range(max(tp, ep))]
    config = read_config(hf_dir)
    source = HFCheckpoint(hf_dir)
    expected = {name: _bytes(source.read(name)) for name in source.tensors}

    # load_hf_weights: the forward equals transformers'.
    logits = results[0]["logits"][..., : config["vocab_size"]]
    assert (logits - hf_logits(hf_dir, TOKENS)).abs().max().item() < 1e-4
    for result in results:
        # iter_hf_weights: every HF tensor, bit for bit, on every rank; the bridge's export agrees.
        assert result["mconv"] == expected
        if bridge_io(kind, ep):
            assert result["bridge"].keys() == expected.keys()
            assert result["bridge"] == result["mconv"]
            assert not result["reload_mismatch"]  # the bridge's loader reads mconv's files to the same weights
    if kind == "mbridge":
        assert results[0]["wrapper"] == "DistributedDataParallel"
    if "lora_names" in results[0]:
        assert results[0]["lora_names"]  # Megatron-Bridge's LoRA wrapping was in place

    # save_hf_weights writes the tensors the bridge's own HF save (mbridge) or HF export
    # (Megatron-Bridge, above) gives, byte for byte.
    ours = {n: _bytes(t) for f in (out / "mconv-hf").glob("*.safetensors") for n, t in load_file(f).items()}
    assert ours == expected
    if kind == "mbridge" and bridge_io(kind, ep):
        theirs = {n: _bytes(t) for f in (out / "bridge-hf").glob("*.safetensors") for n, t in load_file(f).items()}
        assert theirs == ours

    # The bridge route's Megatron checkpoint reads back through mcore2hf, bit for bit.
    mcore2hf(out / "bridge-ckpt", out / "back", hf_config=hf_dir, progress=False)
    back = HFCheckpoint(out / "back")
    assert {name: _bytes(back.read(name)) for name in back.tensors} == expected

    # inspect describes it (megatron-core stored no args): as torch's DCP metadata says, and with
    # --hf-config the tensors counted as hf2mcore counts them.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mconv import hf2mcore, inspect_path
    from mconv.converter.describe import render

    metadata = FileSystemReader(str(out / "bridge-ckpt" / "release")).read_metadata().state_dict_metadata
    stored = [md for md in metadata.values() if isinstance(md, TensorStorageMetadata)]
    bare = inspect_path(out / "bridge-ckpt")
    assert bare["checkpoint"] == {"format": "torch_dist", "iteration": "release", "written_by": "another tool",
                                  "files": len(list((out / "bridge-ckpt" / "release").glob("*.distcp")))}
    assert bare["size"]["stored_tensors"] == bare["size"]["tensors"] == len(stored)
    assert bare["size"]["bytes"] == sum(md.properties.dtype.itemsize * md.size.numel() for md in stored)
    assert all("None" not in line for line in render(bare))
    described = inspect_path(out / "bridge-ckpt", hf_config=hf_dir)
    planned = hf2mcore(hf_dir, out / "planned", mconv_layout(described), dry_run=True, progress=False)
    assert described["size"]["tensors"] == planned.tensors


os.environ.setdefault("OMP_NUM_THREADS", "1")
