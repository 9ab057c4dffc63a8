"""`mconv inspect`: what a checkpoint is, for people (grouped text) and scripts (JSON).

Works on checkpoints mconv did not write: without an HF config it reports what the checkpoint
itself says (format, iteration, the layout and model in its saved Megatron-LM args, tensor keys,
dtypes, bytes); with one (stored by mconv, or `--hf-config`) it also checks the tensors against
the architecture table and counts them as `hf2mcore` does. No megatron-core import on this path
beyond what the checkpoint readers need.
"""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import torch

from mconv.converter import fp8
from mconv.converter import megatron_io as mio
from mconv.converter.adapter_dir import describe_adapter, is_adapter, render_adapter
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.hf2mcore import check_hf_tensors
from mconv.converter.hf_config import read_config
from mconv.converter.hub import check_revision, resolve_model
from mconv.converter.layout import Layout, count
from mconv.converter.megatron_checkpoint import ADAPTER, open_checkpoint
from mconv.converter.options import check_path, dtype_name, option
from mconv.converter.planner import make_plan, validate_layout
from mconv.converter.transforms import tp_sizes_for_padded_vocab
from mconv.errors import MconvError
from mconv.mappings import architecture_for

# Megatron-LM's command-line flag for each saved args field a trainer must match (the field, or
# the fields different writers use, first found wins), in the order people read them. Checked
# against Megatron-LM's own parser by tests/test_inspect.py.
MODEL_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("group_query_attention", "--group-query-attention"),
    ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
    ("normalization", "--normalization"), (("layernorm_epsilon", "norm_epsilon"), "--norm-epsilon"), ("qk_layernorm", "--qk-layernorm"),
    ("swiglu", "--swiglu"), ("add_bias_linear", "--disable-bias-linear"), ("add_qkv_bias", "--add-qkv-bias"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("position_embedding_type", "--position-embedding-type"), ("rotary_base", "--rotary-base"),
    ("rotary_percent", "--rotary-percent"), ("max_position_embeddings", "--max-position-embeddings"),
    ("num_experts", "--num-experts"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_router_topk", "--moe-router-topk"), ("moe_router_pre_softmax", "--moe-router-pre-softmax"),
    ("moe_router_score_function", "--moe-router-score-function"), ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("moe_router_num_groups", "--moe-router-num-groups"), ("moe_router_group_topk", "--moe-router-group-topk"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"), ("moe_router_dtype", "--moe-router-dtype"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate"),
    (("apply_layernorm_1p", "layernorm_zero_centered_gamma"), "--apply-layernorm-1p"),
    ("attention_output_gate", "--attention-output-gate"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("linear_attention_freq", "--linear-attention-freq"), ("linear_conv_kernel_dim", "--linear-conv-kernel-dim"),
    ("linear_key_head_dim", "--linear-key-head-dim"), ("linear_value_head_dim", "--linear-value-head-dim"),
    ("linear_num_key_heads", "--linear-num-key-heads"), ("linear_num_value_heads", "--linear-num-value-heads"),
    ("multi_latent_attention", "--multi-latent-attention"), ("q_lora_rank", "--q-lora-rank"),
    ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"), ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"),
    ("v_head_dim", "--v-head-dim"), ("rope_type", "--rope-type"), ("rotary_scaling_factor", "--rotary-scaling-factor"),
    ("mscale", "--mscale"), ("mscale_all_dim", "--mscale-all-dim"),
    ("mtp_num_layers", "--mtp-num-layers"), ("mtp_loss_scaling_factor", "--mtp-loss-scaling-factor"),
    ("moe_grouped_gemm", "--moe-grouped-gemm"), ("transformer_impl", "--transformer-impl"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"), ("bf16", "--bf16"), ("fp16", "--fp16"),
)
LAYOUT_FLAGS = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    (("num_virtual_stages_per_pipeline_rank", "virtual_pipeline_model_parallel_size"),
     "--num-virtual-stages-per-pipeline-rank"),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
)
INVERTED = {"add_bias_linear"}  # Megatron-LM sets these False with the flag
# Layout fields left out at Megatron-LM's default (ETP's is TP); the others are printed whenever set.
LAYOUT_DEFAULT_ONE = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "num_virtual_stages_per_pipeline_rank", "expert_model_parallel_size"}
# Flags Megatron-LM only uses for MoE models: left out of a dense model's flags.
MOE_ONLY = {"--moe-grouped-gemm", "--expert-model-parallel-size", "--expert-tensor-parallel-size"}


def saved_value(args: dict, dests):
    """The saved args' value of a field (or of the first of several names it has)."""
    for dest in (dests,) if isinstance(dests, str) else dests:
        if args.get(dest) is not None:
            return args[dest]
    return None


def trainer_flags(args: dict, layout: bool = True) -> list[str]:
    """Megatron-LM flags reproducing the saved args' model (and, with `layout`, parallel layout,
    uneven pipeline stages and VPP included): one argv item each (`shell_line` quotes them),
    booleans as bare flags, lists in Megatron-LM's `[1,0,1]` syntax, unset fields left out, and
    no MoE-only flags for a dense model."""
    flags = []
    dense = not args.get("num_experts")
    for dests, flag in MODEL_FLAGS + (LAYOUT_FLAGS if layout else ()):
        value = saved_value(args, dests)
        if dests in INVERTED:
            value = value is False
        if value is None or value is False or (dense and (flag in MOE_ONLY or flag.startswith("--moe-"))):
            continue
        first = dests if isinstance(dests, str) else dests[0]
        if first in LAYOUT_DEFAULT_ONE and value == 1:
            continue
        if first == "expert_tensor_parallel_size" and value == args.get("tensor_model_parallel_size"):
            continue  # Megatron-LM's default ETP is TP
        if first == "mtp_loss_scaling_factor" and not args.get("mtp_num_layers"):
            continue  # Megatron-LM stores its default without MTP layers
        if first == "num_virtual_stages_per_pipeline_rank" and args.get("num_layers_per_virtual_pipeline_stage"):
            continue  # Megatron-LM takes one of the two VPP flags; the saved one is printed
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, "[" + ",".join(str(v) for v in value) + "]"]
        elif isinstance(value, float) and value.is_integer() and abs(value) >= 1:
            flags += [flag, str(int(value))]  # e.g. --rotary-base, an int in Megatron-LM's parser
        else:
            flags += [flag, str(getattr(value, "name", value))]
    return flags


def other_settings(arch, dims) -> dict:
    """The architecture's Megatron settings that the flags above do not carry (e.g. Qwen3-VL's
    vision tower), for the trainer's model provider; dropout rates are training choices."""
    covered = {d for dests, _ in MODEL_FLAGS + LAYOUT_FLAGS for d in ((dests,) if isinstance(dests, str) else dests)}
    return {k: _plain(v) for k, v in arch.megatron_args(dims).items()
            if k not in covered and k not in ("attention_dropout", "hidden_dropout")}


def _plain(value):
    """JSON-ready values: dtypes and enums by name, sets as sorted lists."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "itemsize") and hasattr(value, "is_floating_point"):  # a torch.dtype
        return dtype_name(value)
    if hasattr(value, "name") and hasattr(value, "value"):  # an enum
        return value.name
    return value


def _model(args: dict, name: str | None) -> dict:
    """The architecture a set of Megatron-LM args describes."""
    model = {"name": name or "unknown (no HF config)", "layers": args.get("num_layers"),
             "hidden": args.get("hidden_size"), "ffn": args.get("ffn_hidden_size"),
             "attention_heads": args.get("num_attention_heads"),
             "query_groups": args.get("num_query_groups") or args.get("num_attention_heads"),
             "head_dim": args.get("kv_channels"), "vocab": args.get("vocab_size"),
             "padded_vocab": args.get("padded_vocab_size"),
             "tied_embeddings": (None if args.get("untie_embeddings_and_output_weights") is None
                                 else not args["untie_embeddings_and_output_weights"])}
    if args.get("num_experts"):
        freq = args.get("moe_layer_freq")
        layers = args.get("num_layers") or 0
        moe_layers = ([i for i, f in enumerate(freq) if f] if isinstance(freq, (list, tuple))
                      else [i for i in range(layers) if i % (freq or 1) == 0])
        model.update({"experts": args["num_experts"], "top_k": args.get("moe_router_topk"),
                      "expert_ffn": args.get("moe_ffn_hidden_size"), "moe_layers": moe_layers,
                      "router": ("sigmoid scores, then top-k" if args.get("moe_router_score_function") == "sigmoid"
                                 else "softmax over all experts, then top-k (norm_topk_prob false)"
                                 if args.get("moe_router_pre_softmax") else
                                 "top-k, then softmax over them (norm_topk_prob true)"),
                      "expert_modules": ("TE grouped GEMM" if args.get("moe_grouped_gemm") else
                                         "SequentialMLP" if "moe_grouped_gemm" in args else None)})
    return {k: _plain(v) for k, v in model.items() if v is not None}


# Attention kinds of hybrid models (BailingMoeV3: KDA linear attention, MLA every layer_group_size
# layers; Qwen3.5 / Qwen3-Next: gated delta-net, gated attention every full_attention_interval
# layers), as the architecture's dims list them by layer.
ATTENTION_KINDS = (("kda_layers", "KDA (linear attention)"), ("mla_layers", "MLA"),
                   ("linear_layers", "gated delta-net (linear attention)"),
                   ("full_attention_layers", "gated attention"))


def _attention_layers(dims) -> dict:
    """{"kda_layers": [...], "mla_layers": [...]} for a model whose layers differ in attention kind
    (Qwen3.5's full-attention layers: those its dims do not list as linear)."""
    kinds = {key: getattr(dims, key, None) for key, _ in ATTENTION_KINDS}
    if kinds["linear_layers"] is not None:
        kinds["full_attention_layers"] = set(range(dims.layers)) - kinds["linear_layers"]
    return {key: sorted(layers) for key, layers in kinds.items() if layers is not None}


def _sizes(dtypes: dict) -> dict:
    return {"tensors": sum(n for n, _ in dtypes.values()), "bytes": sum(b for _, b in dtypes.values())}


def _count(counts: dict, dtype, nbytes: int) -> None:
    n, b = counts.get(_plain(dtype), (0, 0))
    counts[_plain(dtype)] = (n + 1, b + nbytes)


def fp8_note(ckpt: HFCheckpoint, where) -> str | None:
    """What inspect says of a quantized checkpoint (`ckpt`, opened as stored): block-wise FP8
    (config.json's `quantization_config` with quant_method fp8, or `weight_scale_inv` block scales)
    is read dequantized, unless the checks hf2mcore makes from the headers it read
    (`HFCheckpoint.dequantized`: each scale's shape and dtype) refuse it, which it then says; None
    otherwise. Scale values are not read, nor the headers again."""
    config, tensors = ckpt.config, ckpt.tensors
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    scales = sum(name.endswith(fp8.SCALE_SUFFIX) for name in tensors)
    if method is None and not scales:
        return None
    if method not in ("fp8", None):
        return f"{where} is a quantized checkpoint (quant_method {method!r}), which mconv does not convert"
    if method is None:
        return (f"{where} has {scales} weights with weight_scale_inv block scales but config.json has no FP8 "
                "quantization_config, which says what they mean; hf2mcore and load_hf_weights refuse it")
    try:
        block = fp8.block_size(config, where)
        ckpt.dequantized(torch.bfloat16)
    except MconvError as e:  # what hf2mcore would refuse, said here rather than promised to work
        return f"{e}; hf2mcore and load_hf_weights refuse it"
    return (f"{where} is block-wise FP8 (quant_method 'fp8', blocks {list(block)}): {scales} weights in "
            "float8_e4m3fn with their weight_scale_inv; hf2mcore and load_hf_weights dequantize them "
            "(bfloat16 by default), the other tensors are kept as stored")


def _check_tensors(ckpt: HFCheckpoint, arch) -> None:
    """The HF tensors' names and shapes against config.json, as hf2mcore checks them (MconvError
    naming a missing, mis-shaped or unexpected tensor), an FP8 checkpoint's weights as hf2mcore
    reads them (dequantized, their scales hidden) from the headers already read; nothing where its
    quantization is refused (fp8_note says why)."""
    try:
        presented = ckpt.dequantized(torch.bfloat16)[2]
    except MconvError:
        return
    view = copy.copy(ckpt)  # (its files, the weights as hf2mcore's checkpoint presents them)
    view.tensors = presented
    check_hf_tensors(make_plan(arch, ckpt.config, Layout(), "local"), view)


def _describe_hf(path: Path, shown: str) -> dict:
    with HFCheckpoint(path) as ckpt:  # (its headers: no tensor is read)
        arch = architecture_for(ckpt.config, ckpt.dir / "config.json")
        dims = arch.dims(ckpt.config)
        _check_tensors(ckpt, arch)
    args = {"num_layers": dims.layers, "hidden_size": dims.hidden, "num_attention_heads": dims.heads,
            "vocab_size": dims.vocab, "untie_embeddings_and_output_weights": not dims.tied,
            **arch.megatron_args(dims)}
    dtypes: dict = {}
    for info in ckpt.tensors.values():
        _count(dtypes, info.dtype, info.nbytes)
    quantized = fp8_note(ckpt, shown)
    mtp = {"mtp_layers": dims.hf_mtp_layers} if getattr(dims, "hf_mtp_layers", 0) else {}
    return {"kind": "huggingface", "path": shown,
            "model": {**_model(args, arch.name), **_attention_layers(dims), **mtp},
            "dtypes": {k: {"tensors": n, "bytes": b} for k, (n, b) in dtypes.items()},
            "size": {**_sizes(dtypes), "files": len({i.file for i in ckpt.tensors.values()})},
            "trainer_flags": trainer_flags(args, layout=False),
            **({"other_settings": other_settings(arch, dims)} if other_settings(arch, dims) else {}),
            **({"note": quantized} if quantized else {})}


def inspect_path(path: str | Path, hf_config: str | Path | None = None, revision: str | None = None,
                 progress: bool = True) -> dict:
    """Describe an HF model (a directory or a hub name at `revision`), a Megatron checkpoint
    (legacy `torch` or `torch_dist`, from mconv or any other tool) or a local PEFT adapter directory
    (adapter_dir.describe_adapter). Returns a JSON-ready dict of groups: `checkpoint` (format,
    iteration, writer, files), `model` (architecture, from the HF config and the saved args;
    `mtp_layers` for an HF model with MTP layers), `layout`, `dtypes` ({dtype: {tensors, bytes}}), `size`
    (`tensors` counted as hf2mcore counts them, `stored tensors` for torch_dist's stacked keys)
    and `trainer flags` (the Megatron-LM flags the training job must pass). `hf_config` (a
    directory or hub name) names the HF model of a checkpoint that stores none; `progress` shows
    huggingface_hub's download bars for a hub name. Raises MconvError for what is neither."""
    check_path(path, "path")
    local = Path(path)
    if is_adapter(local):
        if hf_config or revision:
            raise MconvError(f"{path} is a PEFT adapter, described by its own adapter_config.json; --hf-config and "
                             "--revision do not apply")
        return describe_adapter(local)
    if not local.is_dir() or ((local / "config.json").is_file() and not (local / mio.TRACKER).is_file()):
        if hf_config:
            raise MconvError(f"{path} is an HF model, which has its own config.json; {option('hf_config')} is for "
                             "Megatron checkpoints that store none")
        return _describe_hf(resolve_model(path, revision, progress=progress), str(path))
    if not (local / mio.TRACKER).is_file() and local.name != "release" and not local.name.startswith("iter_"):
        raise MconvError(f"{path} is neither an HF model (no config.json) nor a Megatron checkpoint (no "
                         f"{mio.TRACKER}, not an iter_*/release directory)")
    location = mio.locate(local)
    check_revision(revision, hf_config)
    if hf_config:
        hf_config = resolve_model(hf_config, revision, weights=False, progress=progress, parameter="hf_config")
    dist = location.format == "torch_dist"
    metadata = mio.read_metadata(location.save_dir) or {}
    stored_config = (location.save_dir / mio.HF_CONFIG_DIR / "config.json").is_file()
    dtypes: dict = {}
    shapes: dict[str, tuple] = {}  # of each stored tensor (a legacy checkpoint's: each rank's), by name
    if dist:
        from mconv.converter.torch_dist_io import TorchDistReader

        reader = TorchDistReader.open(location.iter_dir)
        args = reader.args
        for name, entry in reader.tensors.items():
            _count(dtypes, entry.dtype, entry.nbytes)
            shapes[name] = entry.shape
        stored = len(reader.tensors)
    else:
        args, layout, chunks, _ = mio.read_legacy_ranks(location)
        for rank_chunks in chunks.values():
            for chunk in rank_chunks:
                for name, tensor in chunk.items():
                    if hasattr(tensor, "dtype"):
                        _count(dtypes, tensor.dtype, tensor.nbytes)
                        shapes[name] = tuple(tensor.shape)
        stored = None
    adapters = _adapters(shapes)
    args = dict(vars(args)) if args is not None else {}  # a Namespace: the readers check it
    info = {"kind": "megatron", "path": str(path),
            "checkpoint": {"format": location.format,
                           "iteration": location.iteration if location.iteration is not None else "release",
                           "written_by": f"mconv {metadata['mconv_version']}" if metadata else "another tool",
                           "files": len(list(location.iter_dir.glob("*.distcp" if dist else "mp_rank_*")))}}
    name, vocab, plan = None, args.get("vocab_size"), None
    size = _sizes(dtypes)
    if adapters:  # export-lora's input: its base weights (if any) are not checked against the HF config here
        info["adapters"] = adapters
        if hf_config or stored_config:
            name = architecture_for(read_config(Path(hf_config) if hf_config else
                                                location.save_dir / mio.HF_CONFIG_DIR)).name
    elif hf_config or stored_config:
        ckpt = open_checkpoint(location.iter_dir, hf_config)  # checks the tensors against the HF config
        plan = ckpt.plan
        name, vocab = plan.arch.name, plan.dims.vocab
        args.setdefault("padded_vocab_size", ckpt.plan.padded_vocab)
        info["other_settings"] = other_settings(ckpt.plan.arch, ckpt.plan.dims)
        if dist:  # hf2mcore counts megatron-core's parameters, which torch_dist stores stacked by layer
            size["tensors"] = sum(1 for task in ckpt.plan.ranks[0].chunks[0] if task.shape is not None)
    elif not adapters:
        info["note"] = ("no HF config stored in the checkpoint: the architecture is not checked; pass "
                        f"{option('hf_config')} (a directory or hub name) to check it and to convert it")
    info["model"] = {**_model(args, name), **(_attention_layers(plan.dims) if plan is not None else {})}
    if dist:
        short = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP",
                 "expert_model_parallel_size": "EP", "expert_tensor_parallel_size": "ETP"}
        saved = " ".join(f"{label}{args[dest]}" for dest, label in short.items() if args.get(dest))
        info["layout"] = {**_dist_layouts(args, vocab, plan),
                          "saved_by": saved or "unknown (no args)"}
    else:
        info["layout"] = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "etp": layout.etp,
                          "first_stage_layers": layout.first_stage_layers,
                          "last_stage_layers": layout.last_stage_layers, "text": layout.describe()}
        info["layout"] = {k: v for k, v in info["layout"].items() if v is not None}
    spec = metadata.get("spec") or ("te" if args.get("transformer_impl") == "transformer_engine" else
                                    "local" if args.get("transformer_impl") else None)
    if spec:
        info["layout"]["spec"] = spec
    info["dtypes"] = {k: {"tensors": n, "bytes": b} for k, (n, b) in dtypes.items()}
    info["size"] = {**size, **({"stored_tensors": stored} if dist else {}), "files": info["checkpoint"]["files"]}
    info["trainer_flags"] = trainer_flags(args, layout=not dist)
    return info


def _adapters(shapes: dict[str, tuple]) -> dict | None:
    """The LoRA adapters (Megatron-Bridge's: `<module>.adapter.linear_in.weight` [r, in] and
    `linear_out.weight` [out, r], docs/lora.md) among a checkpoint's tensors (`shapes`: name -> shape): their
    count, ranks, the modules they adapt (by Megatron-LM's names, layers and experts folded) and
    whether the base weights are stored beside them; None without adapters."""
    names = [name for name in shapes if ADAPTER in name]
    if not names:
        return None
    # r from linear_out [out, r], whole on every TP rank (a column-parallel linear_in is split along r)
    ranks = sorted({shapes[name][-1] for name in names if name.endswith("linear_out.weight") and shapes[name]})
    modules = sorted({re.sub(r"\.\d+(?=\.|$)", "", name.split(ADAPTER)[0]).rsplit(".", 1)[-1] for name in names})
    export = ("mconv export-lora CKPT OUT (a PEFT adapter), or with --merge --base-model a merged HF model"
              if len(ranks) < 2 else "export-lora refuses adapters of different ranks (a PEFT adapter holds one r)")
    return {"tensors": len(names), "ranks": ranks, "modules": modules,
            "base_weights": any(ADAPTER not in name and not name.endswith("_extra_state") for name in shapes),
            "export": export}


def _dist_layouts(args: dict, vocab: int | None, plan) -> dict:
    """The layouts a torch_dist checkpoint loads at. TP: the sizes at which Megatron pads the
    vocabulary (`vocab`, None if unknown) to the padded vocabulary stored (`padded_vocab_size`) with
    the args' make_vocab_size_divisible_by (transforms.tp_sizes_for_padded_vocab) and, where the
    HF model is known (`plan`, None if not), that the layout check hf2mcore runs accepts
    (planner.validate_layout with the architecture's check_layout); PP and EP: the sizes that check
    accepts at TP1. JSON fields `tp_sizes`, `pp_sizes`, `ep_sizes` (None where unknown), `tp_text`
    and `others_text`."""
    padded = args.get("padded_vocab_size")
    divisor = args.get("make_vocab_size_divisible_by") or 128
    pp_sizes = ep_sizes = None
    if plan is not None:
        pp_sizes = [pp for pp in range(1, plan.dims.layers + 1) if _accepts(plan, pp=pp)]
        ep_sizes = [ep for ep in range(1, getattr(plan.dims, "experts", 0) + 1) if _accepts(plan, ep=ep)] or [1]
        others = (f"PP {_either(pp_sizes)} (even stages of its {count(plan.dims.layers, 'layer')}; uneven "
                  f"first/last stages too), VPP dividing each stage's layers, EP {_either(ep_sizes)}")
    else:
        others = "the PP, VPP and EP the model allows (not checked without its HF config)"
    result = {"pp_sizes": pp_sizes, "ep_sizes": ep_sizes, "others_text": others}
    if not isinstance(padded, int):
        return {"tp_sizes": None, "tp_text": "TP unknown (no padded vocabulary in the args)", **result}
    sizes = tp_sizes_for_padded_vocab(padded, vocab, divisor)
    if plan is not None:
        sizes = [tp for tp in sizes if _accepts(plan, tp=tp)]
    checks = "pass the model's layout checks and " if plan is not None else ""
    why = f"{'vocab ' + str(vocab) if vocab else 'a vocabulary'} to the stored {padded} rows with " \
          f"make_vocab_size_divisible_by {divisor}"
    text = f"TP {_either(sizes)} (only these {checks}pad {why})" if sizes else \
        f"no TP size (none {checks}pads {why})"
    return {"tp_sizes": sizes, "tp_text": text, **result}


def _accepts(plan, **sizes) -> bool:
    try:
        validate_layout(plan.dims, Layout(**sizes), plan.arch.check_layout)  # ETP 1, as hf2mcore --tp N
    except MconvError:
        return False
    return True


def _either(sizes: list[int]) -> str:
    return " or ".join(filter(None, (", ".join(map(str, sizes[:-1])), str(sizes[-1]))))


def render(info: dict) -> list[str]:
    """The text `mconv inspect` prints: one line per group, most wanted first."""
    if info["kind"] == "peft_adapter":
        return render_adapter(info)
    lines = []
    if info["kind"] == "huggingface":
        lines.append(f"{info['path']}: Hugging Face model")
    else:
        c = info["checkpoint"]
        iteration = "release" if c["iteration"] == "release" else f"iteration {c['iteration']}"
        lines.append(f"{info['path']}: Megatron checkpoint, {c['format']} format, {iteration}, "
                     f"written by {c['written_by']}")
    m = dict(info["model"])
    text = f"{m.pop('name')}: " + ", ".join(f"{k.replace('_', ' ')} {_text(v)}" for k, v in m.items()
                                             if k not in ("router", "expert_modules", "moe_layers", "experts",
                                                          "top_k", "expert_ffn", "mtp_layers",
                                                          *dict(ATTENTION_KINDS)))
    lines.append(("model", text))
    kinds = [f"{label} {_text(m[key])}" for key, label in ATTENTION_KINDS if key in m]
    if kinds:
        lines.append(("layers", "; ".join(kinds)))
    if "experts" in m:
        # Args of another tool may lack the router's top-k or the expert ffn, which Megatron-LM always stores.
        lines.append(("experts", f"{m['experts']} experts, top {m.get('top_k', 'unknown')}, "
                                 f"expert ffn {m.get('expert_ffn', 'unknown')}, "
                                 f"MoE layers {_text(m['moe_layers'])}, router {m['router']}"
                                 + (f", {m['expert_modules']}" if "expert_modules" in m else "")))
    if "mtp_layers" in m:
        lines.append(("mtp", f"{count(m['mtp_layers'], 'MTP layer')} (multi-token prediction), which hf2mcore "
                             "leaves out unless --mtp"))
    if "layout" in info:
        layout = info["layout"]
        if "saved_by" in layout:
            text = f"{layout['tp_text']}, {layout['others_text']} (torch_dist reshards on load); " \
                   f"saved by {layout['saved_by']}"
        else:
            text = layout["text"]
        lines.append(("layout", text + (f", spec {layout['spec']}" if "spec" in layout else "")))
    lines.append(("dtypes", "; ".join(f"{d}: {v['tensors']} tensors, {v['bytes']:,} bytes"
                                      for d, v in info["dtypes"].items())))
    s = info["size"]
    stored = f" (stored as {s['stored_tensors']} torch_dist tensors)" if "stored_tensors" in s else ""
    lines.append(("size", f"{s['tensors']} tensors{stored}, {s['bytes']:,} bytes, {count(s['files'], 'file')}"))
    lines.append(("trainer", shell_line(info["trainer_flags"])))
    if info.get("other_settings"):
        lines.append(("also", "model settings beyond these flags: " + ", ".join(
            f"{k} {_text(v)}" for k, v in info["other_settings"].items())))
    if "adapters" in info:
        a = info["adapters"]
        lines.append(("adapters", f"LoRA, rank {_text(a['ranks'])}, on {_text(a['modules'])} "
                                  f"({a['tensors']} tensors; base weights {'stored' if a['base_weights'] else 'not stored'}"
                                  f"): {a['export']}"))
    if "note" in info:
        lines.append(("note", info["note"]))
    return [line if isinstance(line, str) else f"  {line[0]:<8} {line[1]}" for line in lines]


def shell_line(flags: list[str]) -> str:
    """The flags as one line a shell reads back into the same argv (`'[1,0,1,1]'` quoted)."""
    return shlex.join(flags)


def _text(value) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


__all__ = ["inspect_path", "render", "shell_line", "trainer_flags"]
