"""Oracle for Qwen3-VL: mbridge's own Megatron `Qwen3VLModel` (the model mbridge, Megatron-Bridge and
AReaL train), built per rank in gloo processes on the CPU, against transformers'
Qwen3VL(Moe)ForConditionalGeneration.

Each process builds its (tp, pp, ep) rank of the model from megatron-core's local specs (vision
blocks: `get_vit_layer_with_local_spec`; mergers: WrappedTorchNorm / ColumnParallelLinear /
RowParallelLinear; language model: `get_gpt_decoder_block_spec`), with the CPU shims of
tests/megatron_oracle.py, loads its legacy rank file (Megatron-LM's `get_checkpoint_name`) with
`load_state_dict(strict=True)`, and runs a text-only and a text+image forward pass. Two test-only
adjustments, both model-implementation differences rather than conversion ones (reference
qwen3-vl.md, sections 0.4 and 4): the vision tower gets no packed-sequence params (megatron-core's
local attention has no THD path; for one single-frame image this is the same full attention over
its patches), and the patch mergers use exact GELU, as transformers does (mbridge gives them the
vision config's tanh GELU).

Virtual pipeline stages: mbridge's Qwen3VLModel takes no `vp_stage`; Megatron-Bridge 0.6's takes one
and uses it only to build its language model (`Qwen3VLGPTModel(..., vp_stage=vp_stage)`, the vision
tower where `pre_process`, i.e. on virtual stage 0 of pipeline rank 0). Each chunk here is mbridge's
model built the same way: its `Qwen3VLGPTModel` (a megatron-core GPTModel, which takes `vp_stage`)
given the chunk's virtual stage, and the chunk's layer specs from `get_gpt_decoder_block_spec(vp_stage=)`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.conftest import load_rank_file
from tests.megatron_oracle import MegatronRun, _cpu_shims, _free_port, _transformer_config, compare_chunks
from tests.ranks import start_ranks

PATCHES = (1, 4, 4)  # image_grid_thw: one frame of 4 x 4 patches -> 4 merged image tokens


@dataclass
class VLRun(MegatronRun):
    """A MegatronRun of mbridge's Qwen3VLModel (`checkpoint` None with `live_hf`)."""

    inputs: dict = field(default_factory=dict)  # name -> (input_ids, pixel_values or None)
    dist_checkpoint: Path | None = None  # also load this torch_dist checkpoint with megatron-core and compare


def example_inputs(config: dict, length: int = 12, seed: int = 0) -> dict:
    """A text-only sequence, and one with an image: vision start, the image's merged tokens, vision end."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 250, (length,), generator=generator)
    vision = config["vision_config"]
    t, h, w = PATCHES
    image_tokens = t * h * w // vision["spatial_merge_size"] ** 2
    ids = torch.cat([text[:4], torch.tensor([config["vision_start_token_id"]] + [config["image_token_id"]] * image_tokens
                                            + [config["vision_end_token_id"]]), text[4:]])
    patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixels = torch.randn(t * h * w, patch, generator=generator)
    return {"text": (text.unsqueeze(0), None), "image": (ids.unsqueeze(0), pixels)}


def _config(run: VLRun):
    from mbridge.models.qwen3_vl.transformer_config import Qwen3VLTransformerConfig, get_vision_model_config

    c = run.hf_config
    text, vision = c["text_config"], c["vision_config"]
    # The Qwen3-VL-MoE router always renormalises its top-k weights (as norm_topk_prob does).
    base, theta = _transformer_config(MegatronRun(None, {**text, "norm_topk_prob": True}, tp=run.tp, pp=run.pp,
                                                  vpp=run.vpp, ep=run.ep, etp=run.etp))
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    config = Qwen3VLTransformerConfig(**{
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init},
        "mrope_section": rope["mrope_section"]}, patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"], in_channels=vision["in_channels"],
        spatial_merge_size=vision["spatial_merge_size"], num_position_embeddings=vision["num_position_embeddings"],
        out_hidden_size=vision["out_hidden_size"], deepstack_visual_indexes=list(vision["deepstack_visual_indexes"]))
    return config, get_vision_model_config(deepcopy(config), SimpleNamespace(**vision)), theta


def build_model(run: VLRun, vp_stage: int = 0):
    """mbridge's Qwen3VLModel for this rank and virtual stage (see the module docstring), from local
    specs, merger activation set to exact GELU."""
    from unittest import mock

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from mbridge.models.qwen3_vl import model as mbridge_model
    from mbridge.models.qwen3_vl.utils import PatchMergerSubmodules
    from mbridge.models.qwen3_vl.vision_model import Qwen3VLVisionModel

    config, vision_config, theta = _config(run)
    Qwen3VLVisionModel.build_packed_seq_params = lambda self, grid_thw: None
    c = run.hf_config
    vp = vp_stage if run.vpp > 1 else None
    torch.manual_seed(1234)
    with mock.patch.object(mbridge_model, "Qwen3VLGPTModel",
                           functools.partial(mbridge_model.Qwen3VLGPTModel, vp_stage=vp)):
        model = mbridge_model.Qwen3VLModel(
            language_transformer_config=config,
            language_transformer_layer_spec=get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm", qk_l2_norm=False, vp_stage=vp),
            language_vocab_size=run.padded_vocab,
            language_max_sequence_length=c["text_config"]["max_position_embeddings"],
            vision_transformer_config=vision_config, vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
            vision_patch_merger_spec=PatchMergerSubmodules(WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear),
            parallel_output=False, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            language_rotary_base=theta,
            language_share_embeddings_and_output_weights=bool(c.get("tie_word_embeddings", False)),
            image_token_id=c["image_token_id"], video_token_id=c["video_token_id"],
            vision_start_token_id=c["vision_start_token_id"])
    if model.vision_model is not None:
        for merger in [model.vision_model.merger, *model.vision_model.decoder.deepstack_merger_list]:
            merger.activation_func = torch.nn.functional.gelu
    return model.eval()


def _import_megatron_bridge_mapping():
    """Megatron-Bridge 0.6's Qwen3-VL bridges without Transformer Engine: `import megatron.bridge`
    needs TE (its PEFT LoRA layers import it), so the package `__init__`s are bypassed (bare packages
    over the installed directories) and the two TE-only LoRA layer modules are stubbed; the conversion
    code itself runs unchanged."""
    import importlib
    import sys
    import types

    import megatron

    root = next(Path(p) / "bridge" for p in megatron.__path__ if (Path(p) / "bridge").is_dir())
    for sub in ("", "models", "models/conversion", "models/qwen_vl", "models/qwen_vl/modelling_qwen3_vl",
                "models/qwen", "models/hf_pretrained", "peft", "utils", "training"):
        name = "megatron.bridge" + ("." + sub.replace("/", ".") if sub else "")
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root / sub)]
            sys.modules[name] = package

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            setattr(self, name, type(name, (), {}))
            return getattr(self, name)

    for name in ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.dora_layers"):
        sys.modules.setdefault(name, Stub(name))
    return importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_bridge")


def load_with_megatron_bridge(model, hf_dir: Path) -> None:
    """Load the HF checkpoint into `model` with Megatron-Bridge's own Qwen3-VL mapping registry and
    loader (`load_weights_hf_to_megatron`: its TP/EP scatter, QKV and GLU merges, vision QKV interleave,
    stacked-expert handling)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    bridges = _import_megatron_bridge_mapping()
    config = AutoConfig.from_pretrained(hf_dir)
    tensors = load_file(Path(hf_dir) / "model.safetensors")

    class State(dict):
        source = SimpleNamespace(get_all_keys=lambda: list(tensors))

    bridge = (bridges.Qwen3VLMoEBridge if config.model_type == "qwen3_vl_moe" else bridges.Qwen3VLBridge)()
    hf = SimpleNamespace(config=config, state=State(tensors), model_name_or_path=str(hf_dir))
    bridge.load_weights_hf_to_megatron(hf, [model])


def _worker(rank: int, run: VLRun, port: int, out: Path):
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=run.world)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.training.checkpointing import get_checkpoint_name
    from mbridge.models.qwen3_vl.rope_utils import get_rope_index

    ps.initialize_model_parallel(run.tp, run.pp, run.vpp if run.vpp > 1 else None,
                                 expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.etp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    chunks = [build_model(run, v) for v in range(run.vpp)]
    if run.live_hf is not None:
        from mconv.live import load_hf_weights

        load_hf_weights(chunks, run.live_hf)
    else:
        tracker = (run.checkpoint / "latest_checkpointed_iteration.txt").read_text().strip()
        release = tracker == "release"
        path = get_checkpoint_name(str(run.checkpoint), 0 if release else int(tracker), release,
                                   expert_parallel=run.ep > 1, expert_rank=ps.get_expert_model_parallel_rank())
        state = load_rank_file(path, map_location="cpu")
        for v, model in enumerate(chunks):
            model.load_state_dict(state["model"] if run.vpp == 1 else state[f"model{v}"], strict=True)
    if run.bridge_hf is not None:  # a second, independent mapping into a second model of this rank
        others = [build_model(run, v) for v in range(run.vpp)]
        for other in others:
            load_with_megatron_bridge(other, run.bridge_hf)
        compare_chunks(chunks, others, out.with_name(f"bridge{rank}.pt"))
    if run.dist_checkpoint is not None:  # megatron-core's own loader, resharding to this rank's chunks
        from megatron.core import dist_checkpointing

        others = [build_model(run, v) for v in range(run.vpp)]
        # As Megatron-LM loads: every chunk's sharded state dict (global layer numbers) in one call.
        state = {"model": others[0].sharded_state_dict()} if run.vpp == 1 else {
            f"model{v}": other.sharded_state_dict() for v, other in enumerate(others)}
        loaded = dist_checkpointing.load(state, str(run.dist_checkpoint / "release"))
        for v, other in enumerate(others):
            other.load_state_dict(loaded["model"] if run.vpp == 1 else loaded[f"model{v}"], strict=True)
        compare_chunks(chunks, others, out.with_name(f"dist{rank}.pt"))

    c = run.hf_config
    pp_rank, results = ps.get_pipeline_model_parallel_rank(), {}
    with torch.no_grad():
        for name, (ids, pixels) in run.inputs.items():
            seq = ids.shape[1]
            grid = torch.tensor([PATCHES]) if pixels is not None else None
            positions, _ = get_rope_index(c["vision_config"]["spatial_merge_size"], c["image_token_id"],
                                          c["video_token_id"], c["vision_start_token_id"], ids, image_grid_thw=grid,
                                          attention_mask=torch.ones_like(ids))
            mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked
            for v, model in enumerate(chunks):  # virtual stage v of every pipeline rank, in turn
                for p in range(run.pp):
                    if p != pp_rank:
                        continue
                    if (v, p) != (0, 0):
                        hidden = torch.empty(seq, 1, c["text_config"]["hidden_size"])
                        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                        model.set_input_tensor(hidden)
                    output = model(ids, positions, mask, pixel_values=pixels, image_grid_thw=grid)
                    if (v, p) == (run.vpp - 1, run.pp - 1):
                        results[name] = output.float()
                    else:
                        dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_expert_model_parallel_rank() == 0):
        torch.save(results, out)
    if run.live_out is not None:
        from mconv.live import iter_hf_weights, save_hf_weights

        for label, options in (("yielded", {}), ("stacked4", {"stacked_experts": True}),
                               ("stacked5", {"stacked_experts": True, "expert_orientation": "5.x"}),
                               ("stacked4-fp8", {"stacked_experts": True, "quantize": "fp8"}),
                               ("stacked5-fp8", {"stacked_experts": True, "expert_orientation": "5.x", "quantize": "fp8"})):
            buckets = [[(name, tensor.clone()) for name, tensor in bucket]
                       for bucket in iter_hf_weights(chunks, run.live_hf, bucket_bytes=40_000, gather_pp=True, **options)]
            torch.save(buckets, run.live_out / f"{label}{rank}.pt")
        save_hf_weights(chunks, run.live_out / "saved", run.live_hf, max_shard_bytes=200_000)
        save_hf_weights(chunks, run.live_out / "saved5", run.live_hf, max_shard_bytes=200_000,
                        expert_orientation="5.x")
        save_hf_weights(chunks, run.live_out / "saved-fp8", run.live_hf, max_shard_bytes=200_000, quantize="fp8")
    dist.barrier()
    dist.destroy_process_group()


def megatron_logits(run: VLRun, workdir: Path) -> dict[str, torch.Tensor]:
    """Logits [1, seq, vocab] of mbridge's Qwen3VLModel for each input (padding rows dropped)."""
    out = Path(workdir) / "qwen3_vl_logits.pt"
    start_ranks(_worker, args=(run, _free_port(), out), nprocs=run.world)
    vocab = run.hf_config["text_config"]["vocab_size"]
    return {name: logits[..., :vocab] for name, logits in torch.load(out).items()}


def hf_logits(hf_dir: Path, inputs: dict) -> dict[str, torch.Tensor]:
    """transformers' logits (float32) for the same inputs; it computes its own mrope positions."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    results = {}
    with torch.no_grad():
        for name, (ids, pixels) in inputs.items():
            extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": torch.tensor([PATCHES]),
                                               # what the processor returns beside input_ids: 1 marks image tokens
                                               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
            results[name] = model(input_ids=ids, **extra).logits
    return results


os.environ.setdefault("OMP_NUM_THREADS", "1")
