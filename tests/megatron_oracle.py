"""Oracle: megatron-core's own GPTModel, built per rank in gloo processes on the CPU.

Each process builds the model chunks of its (tp, pp) rank with the local layer spec and loads
them: a legacy rank file found with Megatron-LM's own `get_checkpoint_name`, or a torch_dist
checkpoint through `dist_checkpointing.load` of the model's own sharded state dict (resharding to
this layout), then `load_state_dict(strict=True)`. With `save_to`, it instead keeps its random
initialisation and saves it with `dist_checkpointing.save`. Then it runs the forward pass. Pipeline stages (and virtual chunks) are chained with point-to-point
sends of the hidden states between the ranks that megatron-core's parallel_state names as next
and previous, in the order megatron-core's interleaved schedule runs chunks for one microbatch.
The last stage's TP rank 0 saves the logits (gathered over TP: parallel_output=False).
MoE models use megatron-core's SequentialMLP experts with the allgather token dispatcher; the
world is pp * lcm(tp, etp * ep) processes (times dp replicas), as Megatron-LM needs for MoE parallel
folding. The same processes can then run further layouts (`MegatronRun.then`), each on a parallel
state set up afresh, saving its own logits.

With `args` (see `trainer_args`), the model is built as a Megatron-LM job builds it from its
arguments: the TransformerConfig from Megatron-LM's `core_transformer_config_from_args` (which also
sets megatron-core's YaRN settings) and GPTModel's position-embedding arguments as Megatron-LM's
`gpt_builders` passes them. Without it, the config is written here from the HF config.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import socket
import tempfile
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tests.conftest import load_rank_file
from tests.ranks import start_ranks


@dataclass
class MegatronRun:
    checkpoint: Path  # the save directory (with the tracker file)
    hf_config: dict
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1  # data-parallel replicas of the whole layout (each runs the same forward)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    padded_vocab: int = 0
    tokens: list[int] = field(default_factory=list)
    fmt: str = "torch"  # how to load `checkpoint`: legacy rank files or torch_dist
    save_to: Path | None = None  # instead of loading: random weights, saved with dist_checkpointing.save
    live_hf: Path | None = None  # instead of loading: mconv.live.load_hf_weights from this HF directory,
    live_out: Path | None = None  # then, after the forward, iter_hf_weights / save_hf_weights into this
    live_quantize: str | None = None  # their `quantize` (the gather_pp and refused-cast checks stay unquantized)
    # With live_hf: load `checkpoint` first (and check `same_as`), then zero every parameter and
    # load_hf_weights, which must give back every tensor megatron-core loaded, bit for bit
    live_over_checkpoint: bool = False
    args: argparse.Namespace | None = None  # Megatron-LM's validated args: build the model from them
    # (config, vp_stage) -> the decoder block spec, instead of megatron-core's local GPT spec (a
    # top-level function: it reaches the spawned workers by pickling)
    block_spec: Callable | None = None
    # (config, decoder block spec, vp_stage) -> GPTModel's mtp_block_spec, for a config with MTP layers
    mtp_spec: Callable | None = None
    # A legacy checkpoint of this layout whose rank files must hold exactly the tensors loaded from
    # `checkpoint` (a torch_dist one, resharded by megatron-core)
    same_as: Path | None = None
    # (torch_dist checkpoint, legacy checkpoint of this layout) of a vision-language model whose language
    # model (`language_model.*`) has this model's shape: after the forward, the same chunks load it from
    # the torch_dist one, check it against the rank files as `same_as`, and their logits are saved beside
    # the others' (`megatron_logits.pt`) as `language_model_logits.pt`
    language_model_of: tuple[Path, Path] | None = None
    # A second, independent mapping: after loading, Megatron-Bridge's AutoBridge loads this HF directory
    # into a second copy of the chunks, and each rank saves how the two differ (`bridge{rank}.pt`, see
    # `compare_chunks`); with `bridge_perturbed` also after one tensor of the copy (by this name suffix)
    # is moved by one float step
    bridge_hf: Path | None = None
    bridge_perturbed: str | None = None
    # chunks -> {rule: {parameter: what a converter following that wrong rule would have written}} (a
    # top-level function or partial): after the forward, each rule's tensors replace the loaded ones for
    # one more forward (logits beside this layout's, `..._wrong{j}.pt`, j in the dict's order), then are put back
    wrong_rules: Callable | None = None
    # Further layouts run by the same processes after this one (same world size): megatron-core's
    # parallel state is torn down and set up again at their sizes, and each builds its chunks, loads its
    # own `checkpoint` and saves its logits (`megatron_logits{i}.pt`, i from 1; see `layout_logits`)
    then: list[MegatronRun] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.pp * math.lcm(self.tp, self.etp * self.ep) * self.dp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_shims():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied-embedding all-reduce moves weights to the GPU
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.14's router names it without Transformer Engine
        moe_utils.te_general_gemm = None


def _transformer_config(run: MegatronRun):
    from megatron.core.transformer import TransformerConfig

    c = run.hf_config
    rope = c.get("rope_parameters") or {}
    moe = {}
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts:
        dense = set(c.get("mlp_only_layers") or [])
        step = c.get("decoder_sparse_step", 1)
        moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=c["moe_intermediate_size"],
                   moe_router_topk=c["num_experts_per_tok"], moe_router_pre_softmax=not c.get("norm_topk_prob"),
                   moe_layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(c["num_hidden_layers"])],
                   moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                   expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.etp)
    return TransformerConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
        kv_channels=c["head_dim"], ffn_hidden_size=c["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=c["rms_norm_eps"], qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, init_method_std=0.2,
        tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
        virtual_pipeline_model_parallel_size=run.vpp if run.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=run.first_stage_layers,
        num_layers_in_last_pipeline_stage=run.last_stage_layers, **moe,
    ), float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))


@contextlib.contextmanager
def one_process_gpt(run: MegatronRun, vocab_size: int = 384):
    """megatron-core's GPTModel (local spec) for `run`'s config, in a one-process gloo group at
    TP1/PP1 that is torn down on exit; for tests of mconv.live in a spawned worker."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    _cpu_shims()
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        config, theta = _transformer_config(run)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                          qk_l2_norm=False)
        try:
            yield GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                           max_sequence_length=256, position_embedding_type="rope", rotary_base=theta)
        finally:
            dist.destroy_process_group()


def megatron_lm_args(argv: list[str], world: int = 1, overlay: dict | None = None) -> argparse.Namespace:
    """Megatron-LM's own `parse_args` for a command line, with `overlay` set on the result, then its
    `validate_args`, on this CPU machine: the GPU generation check answers Hopper and
    CUDA_DEVICE_MAX_CONNECTIONS is 1 (what validate_args asks of a TP>1 job); neither changes a
    stored arg. Its printout is swallowed."""
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 9
    saved_argv = sys.argv
    saved_env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            args = arguments.parse_args()
            for name, value in (overlay or {}).items():
                setattr(args, name, value)
            arguments.validate_args(args)
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return args


# Args a CPU oracle run sets whatever the checkpoint stores: float32 compute (the bf16 weights
# are exact in it), CPU initialisation, no fused GPU kernels (nor grouped GEMM experts: SequentialMLP), the
# allgather dispatcher and no auxiliary loss.
CPU_RUN_ARGS = dict(bf16=False, fp16=False, use_cpu_initialization=True, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                    moe_aux_loss_coeff=0.0, init_method_std=0.2, apply_rope_fusion=False, masked_softmax_fusion=False,
                    bias_swiglu_fusion=False, gradient_accumulation_fusion=False, no_persist_layer_norm=True)


def trainer_args(stored: argparse.Namespace, run: MegatronRun) -> argparse.Namespace:
    """The args of a Megatron-LM job that trains on a checkpoint: Megatron-LM's parser defaults with
    every arg the checkpoint stores laid over them (a trainer passing exactly those flags), the
    run's parallel sizes and CPU_RUN_ARGS, then Megatron-LM's `validate_args`."""
    sizes = dict(tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
                 num_virtual_stages_per_pipeline_rank=run.vpp if run.vpp > 1 else None,
                 num_layers_per_virtual_pipeline_stage=None,
                 expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.etp,
                 decoder_first_pipeline_num_layers=run.first_stage_layers,
                 decoder_last_pipeline_num_layers=run.last_stage_layers,
                 world_size=run.world, rank=0, micro_batch_size=1, global_batch_size=None, data_parallel_size=None)
    return megatron_lm_args([], run.world, {**vars(stored), **sizes, **CPU_RUN_ARGS})


def _config_from_args(args: argparse.Namespace):
    """Megatron-LM's TransformerConfig for the args, and GPTModel's rotary arguments as Megatron-LM's
    `gpt_builders.gpt_builder` passes them."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    return config, dict(position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)


def forward_logits(chunks: list, run: MegatronRun, hidden_size: int, out: Path) -> None:
    """megatron-core's forward of `run.tokens` (one microbatch) through this rank's model chunks.
    Pipeline stages (and virtual chunks) are chained with point-to-point sends of the hidden states
    between the ranks that parallel_state names as next and previous, in the order megatron-core's
    interleaved schedule runs chunks for one microbatch; the last stage's TP rank 0 saves the logits
    to `out` ([1 + MTP depths, s, vocab]: the model's, then each depth of its MTP block through the
    output layer)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp_rank = ps.get_pipeline_model_parallel_rank()
    tokens = torch.tensor([run.tokens])
    seq = tokens.shape[1]
    positions = torch.arange(seq).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked
    hidden_shape = (seq, 1, hidden_size)
    with torch.no_grad():
        for v in range(run.vpp):
            for p in range(run.pp):
                if p != pp_rank:
                    continue
                model = chunks[v]
                if not (v == 0 and p == 0):
                    hidden = torch.empty(hidden_shape)
                    dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                    model.set_input_tensor(hidden)
                mtp_hidden = []
                if getattr(model, "mtp", None) is not None:  # its output: [decoder output; depth 1; ...] on dim 0
                    model.mtp.register_forward_hook(lambda module, args, output: mtp_hidden.append(output))
                output = model(tokens, positions, mask)
                for hidden in mtp_hidden[0].chunk(1 + model.config.mtp_num_layers)[1:] if mtp_hidden else ():
                    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
                    output = torch.cat([output, model.output_layer(hidden, weight=weight)[0].transpose(0, 1)])
                if v == run.vpp - 1 and p == run.pp - 1:
                    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                        torch.save(output.float(), out)
                else:
                    dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())


def _build_chunks(run: MegatronRun, config, rotary: dict, tied: bool) -> list:
    """This rank's GPTModel chunks (one per virtual stage), randomly initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    chunks = []
    for v in range(run.vpp):
        torch.manual_seed(1234)  # random init must agree across the ranks that replicate a tensor
        spec = (run.block_spec(config, v) if run.block_spec is not None else
                get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           qk_l2_norm=False, vp_stage=v))
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=run.padded_vocab,
                         max_sequence_length=run.hf_config["max_position_embeddings"],
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                         share_embeddings_and_output_weights=tied, parallel_output=False, vp_stage=v,
                         mtp_block_spec=(run.mtp_spec(config, spec, v) if run.mtp_spec and config.mtp_num_layers
                                         else None), **rotary)
        chunks.append(model.eval())
    return chunks


def _worker(rank: int, run: MegatronRun, store: Path, out: Path):
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # A file store, not a TCP port: a port found free can be taken by another test before rank 0
    # binds it (seen once in CI-like runs: a rank aborted at start-up).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=run.world)
    for i, layout in enumerate([run, *run.then]):
        _run_layout(rank, layout, out.with_name(f"{out.stem}{i or ''}.pt"))
        # What megatron-core's own tests do between layouts in one process: its groups, global memory
        # buffer and the rest of parallel_state dropped (the RNG tracker is reset when set up again)
        ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def _run_layout(rank: int, run: MegatronRun, out: Path) -> None:
    """One layout's part of `_worker`, in its process group: parallel state, chunks, load, checks,
    forward."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ps.initialize_model_parallel(run.tp, run.pp, run.vpp if run.vpp > 1 else None,
                                 expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.etp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if run.args is not None:
        config, rotary = _config_from_args(run.args)
    else:
        config, rope_theta = _transformer_config(run)
        rotary = dict(position_embedding_type="rope", rotary_base=rope_theta)
    tied = (not run.args.untie_embeddings_and_output_weights if run.args is not None
            else bool(run.hf_config.get("tie_word_embeddings", False)))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = _build_chunks(run, config, rotary, tied)
    if run.save_to is not None:
        for model in chunks:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:  # norms start at one; make a misplaced norm visible
                        torch.manual_seed(len(name))
                        param.uniform_(0.5, 1.5)
        state = {"model": chunks[0].sharded_state_dict()} if run.vpp == 1 else {
            f"model{v}": m.sharded_state_dict() for v, m in enumerate(chunks)}
        dist_checkpointing.save(state, str(run.save_to))
    elif run.live_hf is not None and not run.live_over_checkpoint:
        from mconv.live import load_hf_weights

        load_hf_weights(chunks, run.live_hf)
    elif run.fmt == "torch_dist":
        _load_torch_dist(chunks, run.checkpoint)
    else:
        _load_rank_files(chunks, run)
    if run.same_as is not None:
        _assert_same_as(chunks, run.same_as, run)
    if run.live_over_checkpoint:
        _load_live_over(chunks, run.live_hf)
    if run.bridge_hf is not None:
        others = _build_chunks(run, config, rotary, tied)
        _load_with_megatron_bridge(others, run.bridge_hf)
        compare_chunks(chunks, others, out.with_name(f"bridge{rank}.pt"), run.bridge_perturbed)

    forward_logits(chunks, run, config.hidden_size, out)
    for j, wrong in enumerate(run.wrong_rules(chunks).values() if run.wrong_rules is not None else ()):
        loaded = {param: param.detach().clone() for param in wrong}
        with torch.no_grad():
            for param, tensor in wrong.items():
                param.copy_(tensor)
            forward_logits(chunks, run, config.hidden_size, out.with_name(f"{out.stem}_wrong{j}.pt"))
            for param, tensor in loaded.items():
                param.copy_(tensor)
    if run.live_out is not None:
        from mconv.live import iter_hf_weights, save_hf_weights

        import mconv.live.export as export
        from megatron.core import parallel_state as ps

        gathers, all_gather = [], export._all_gather  # which group gathered which dtypes (FP8 before the gather?)

        def recorded(tensors, group):
            kind = ("tp" if group is ps.get_tensor_model_parallel_group() else
                    "ep" if group is ps.get_expert_model_parallel_group() else "etp")
            gathers.append((kind, sorted({str(t.dtype) for t in tensors})))
            return all_gather(tensors, group)

        export._all_gather = recorded
        yielded = [[(name, tensor.clone()) for name, tensor in bucket]
                   for bucket in iter_hf_weights(chunks, run.live_hf, bucket_bytes=40_000, quantize=run.live_quantize)]
        export._all_gather = all_gather
        torch.save({"pp": pp_rank, "buckets": yielded, "gathers": gathers}, run.live_out / f"rank{rank}.pt")
        everything = [name for bucket in iter_hf_weights(chunks, run.live_hf, gather_pp=True) for name, _ in bucket]
        torch.save(everything, run.live_out / f"all{rank}.pt")
        if run.pp > 1:  # a cast refused on the last stage only: every rank is told, none waits for its buckets
            from mconv import MconvError

            norm = chunks[-1].decoder.final_layernorm.weight if pp_rank == run.pp - 1 else None
            if norm is not None:
                kept, norm.data[0] = norm.data[0].item(), 1e30
            try:
                list(iter_hf_weights(chunks, run.live_hf, gather_pp=True, dtype=torch.float16))
                refused = None
            except MconvError as e:
                refused = str(e)
            if norm is not None:
                norm.data[0] = kept
            (run.live_out / f"refused{rank}.txt").write_text(str(refused))
        save_hf_weights(chunks, run.live_out / "saved", run.live_hf, max_shard_bytes=100_000, quantize=run.live_quantize)
        qkv = getattr(chunks[0].decoder.layers[0].self_attention, "linear_qkv", None) if pp_rank == 0 else None
        if run.live_quantize and qkv is not None:  # a NaN in layer 0's query weights, in every rank's shard
            from mconv import MconvError

            qkv = qkv.weight
            kept, qkv.data[0, 0], count = qkv.data[0, 0].item(), float("nan"), 0
            try:
                for _ in iter_hf_weights(chunks, run.live_hf, bucket_bytes=40_000, quantize=run.live_quantize):
                    count += 1
                refused = None
            except MconvError as e:
                refused = str(e)
            finally:
                qkv.data[0, 0] = kept
            torch.save({"refused": refused, "yielded": count}, run.live_out / f"nan{rank}.pt")
    if run.language_model_of is not None:
        prefix = "language_model."
        _load_torch_dist(chunks, run.language_model_of[0], prefix)
        _assert_same_as(chunks, run.language_model_of[1], run, prefix)
        forward_logits(chunks, run, config.hidden_size, out.with_name("language_model_logits.pt"))


def import_megatron_bridge():
    """Megatron-Bridge's AutoBridge (its Qwen3, Qwen3-MoE, Qwen3.5 and Qwen3-Next bridges registered) and
    local layer spec, without Transformer Engine (how: tests/test_bridges.py's docstring)."""
    if "megatron.bridge.models.conversion.auto_bridge" not in sys.modules:
        root = Path(importlib.util.find_spec("megatron.core").origin).parent.parent / "bridge"
        for name, path in (("megatron.bridge", root), ("megatron.bridge.models", root / "models"),
                           ("megatron.bridge.models.qwen", root / "models" / "qwen")):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        importlib.import_module("megatron.core.transformer.moe.moe_utils")  # before the placeholder exists
        importlib.import_module("megatron.bridge.peft.adapter_wrapper")
        importlib.import_module("megatron.bridge.peft.lora_merge")
        te = types.ModuleType("transformer_engine")
        te.pytorch = types.ModuleType("transformer_engine.pytorch")
        te.pytorch.Linear = type("Linear", (), {})
        te.pytorch.LayerNormLinear = type("LayerNormLinear", (), {})
        te.pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
        sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
        try:
            importlib.import_module("megatron.bridge.peft.lora_layers")
        finally:
            del sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"]
        for family in ("qwen3_bridge", "qwen3_moe_bridge", "qwen35_bridge", "qwen3_next_bridge"):
            importlib.import_module(f"megatron.bridge.models.qwen.{family}")
        # peft.utils decides "Transformer Engine present" from names megatron-core defines even
        # without it (as None); say what is true, so LoRA takes its non-TE branches.
        importlib.import_module("megatron.bridge.peft.utils").HAVE_TE = False
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec
    return AutoBridge, local_layer_spec


def _load_with_megatron_bridge(chunks: list, hf_dir: Path) -> None:
    """Megatron-Bridge's `AutoBridge.from_hf_pretrained(hf_dir).load_hf_weights(chunks)`. Two of its limits
    leave a parameter as built, for the comparison to name, instead of failing the load: at TP1 it does not
    pad the vocabulary (ColumnParallelMapping returns early), so a padded embedding / output layer is a
    shape mismatch, allowed; and its task list keeps a None for a parameter its table has no row for,
    on which its loader fails (`'NoneType' object has no attribute 'megatron_module'`), so those are dropped."""
    auto_bridge = import_megatron_bridge()[0]
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    build = MegatronModelBridge.build_conversion_tasks
    MegatronModelBridge.build_conversion_tasks = lambda self, *args, **kwargs: [
        task for task in build(self, *args, **kwargs) if task is not None]
    try:
        auto_bridge.from_hf_pretrained(str(hf_dir)).load_hf_weights(
            chunks, allowed_mismatched_params=["embedding.word_embeddings.weight", "output_layer.weight"])
    finally:
        MegatronModelBridge.build_conversion_tasks = build


def _differing(models: list, others: list) -> dict:
    ours, theirs = ({f"{v}.{k}": t for v, m in enumerate(chunks) for k, t in m.state_dict().items()
                     if isinstance(t, torch.Tensor)} for chunks in (models, others))
    return {"names": sorted(ours), "keys_equal": ours.keys() == theirs.keys(),
            "differ": sorted(k for k in ours if not (k in theirs and torch.equal(ours[k], theirs[k])))}


def compare_chunks(models: list, others: list, report: Path, perturbed: str | None = None) -> None:
    """Save to `report` which tensors of two sets of model chunks of this rank differ, bit for bit (keys
    `{chunk}.{name}`); with `perturbed`, also which differ once the first parameter of `others` whose name
    ends so is moved by one float step in one element (a check that the comparison sees it)."""
    result = _differing(models, others)
    if perturbed is not None:
        name, param = next((f"{v}.{n}", p) for v, m in enumerate(others) for n, p in m.named_parameters()
                           if n.endswith(perturbed))
        with torch.no_grad():
            param.view(-1)[0] = torch.nextafter(param.view(-1)[0], torch.tensor(float("inf")))
        result["perturbed"] = (name, _differing(models, others)["differ"])
    torch.save(result, report)


def assert_same(workdir: Path, label: str, world: int, gap: str | None = None) -> None:
    """Every rank's `compare_chunks` report says its tensors are equal, bit for bit, except exactly those
    whose name matches the regex `gap` (which every rank must have); where a tensor was perturbed, it
    differs too. The AssertionError names the first unexpected difference."""
    for rank in range(world):
        report = torch.load(Path(workdir) / f"{label}{rank}.pt")
        expected = [n for n in report["names"] if gap and re.search(gap, n)]
        unexpected = [n for n in report["differ"] if n not in expected]
        assert report["keys_equal"] and len(report["names"]) > 10, report
        assert not unexpected, f"rank {rank}: {unexpected[0]} differs ({len(unexpected)} tensors)"
        assert report["differ"] == expected and bool(expected) == bool(gap), (rank, report["differ"])
        if "perturbed" in report:
            name, differ = report["perturbed"]
            assert differ == sorted(expected + [name]), (rank, name, differ)


def _load_torch_dist(chunks: list, checkpoint: Path, prefix: str = "") -> None:
    """megatron-core's `dist_checkpointing.load` of the chunks' sharded state dicts (their keys under
    `prefix`, as a VL model saves its language model), then `load_state_dict(strict=True)` of each."""
    from megatron.core import dist_checkpointing

    tracker = (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip()
    iter_dir = checkpoint / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    # As Megatron-LM does: every chunk's sharded state dict in one call, under "model" (or "model{v}" with
    # virtual stages), the common state beside them.
    names = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
    loaded = dist_checkpointing.load({name: model.sharded_state_dict(prefix=prefix) for name, model in zip(names, chunks)},
                                     str(iter_dir))
    for name, model in zip(names, chunks):
        model.load_state_dict({key.removeprefix(prefix): t for key, t in loaded[name].items()}, strict=True)


def _assert_same_as(chunks: list, checkpoint: Path, run: MegatronRun, prefix: str = "") -> None:
    """The legacy rank files of `checkpoint` hold exactly the chunks' tensors (those under `prefix`,
    the prefix dropped), bit for bit."""
    for v, model in enumerate(chunks):
        theirs = {n: t for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
        ours = {_sequential_experts(n.removeprefix(prefix)): t
                for n, t in _rank_state(checkpoint, run, v).items() if isinstance(t, torch.Tensor) and n.startswith(prefix)}
        assert ours.keys() == theirs.keys(), (ours.keys() ^ theirs.keys())
        for name, tensor in ours.items():
            assert tensor.shape == theirs[name].shape and torch.equal(tensor.to(theirs[name].dtype), theirs[name]), name


def _sequential_experts(name: str) -> str:
    # TE's grouped experts' `linear_fcN.weight{e}` is SequentialMLP's `local_experts.{e}.linear_fcN.weight`
    # (one torch_dist key, `experts.experts.linear_fcN.weight`, for both).
    return re.sub(r"experts\.(linear_fc[12])\.weight(\d+)$", r"experts.local_experts.\2.\1.weight", name)


def _load_rank_files(chunks: list, run: MegatronRun) -> None:
    """`load_state_dict(strict=True)` of each chunk's legacy rank file; `--spec te` files' grouped experts
    under SequentialMLP's names, and their `_extra_state` entries that the model lacks (None in mconv's
    files: the stand-ins for Transformer Engine's norms and core attention have none) left out."""
    for v, model in enumerate(chunks):
        own = model.state_dict().keys()
        state = {_sequential_experts(n): t for n, t in _rank_state(run.checkpoint, run, v).items()}
        model.load_state_dict({n: t for n, t in state.items() if n in own or not (n.endswith("._extra_state")
                                                                                 and t is None)}, strict=True)


def _load_live_over(chunks: list, hf_dir: Path) -> None:
    """load_hf_weights into the chunks, their parameters zeroed first, must give back the tensors
    they held (loaded by megatron-core), bit for bit: none missed, none misplaced."""
    from mconv.live import load_hf_weights

    loaded = [{n: t.clone() for n, t in m.state_dict().items() if isinstance(t, torch.Tensor)} for m in chunks]
    with torch.no_grad():
        for model in chunks:
            for param in model.parameters():
                param.zero_()
    load_hf_weights(chunks, hf_dir)
    for model, before in zip(chunks, loaded):
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, before[name]), f"load_hf_weights: {name} differs"


def _rank_state(checkpoint: Path, run: MegatronRun, v: int) -> dict:
    """Model chunk `v` of this rank's legacy rank file, found with Megatron-LM's `get_checkpoint_name`."""
    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import get_checkpoint_name

    tracker = (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip()
    release = tracker == "release"
    path = get_checkpoint_name(str(checkpoint), 0 if release else int(tracker), release,
                               expert_parallel=run.ep > 1, expert_rank=ps.get_expert_model_parallel_rank())
    state = load_rank_file(path, map_location="cpu")
    return state["model"] if run.vpp == 1 else state[f"model{v}"]


def megatron_logits(run: MegatronRun, workdir: Path) -> torch.Tensor:
    """Logits [1, seq, vocab] of megatron-core's forward on the checkpoint (padding rows dropped), then
    those of each depth of its MTP block."""
    out = Path(workdir) / "megatron_logits.pt"
    store = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    assert all(layout.world == run.world for layout in run.then), "layouts of one run share its processes"
    start_ranks(_worker, args=(run, store, out), nprocs=run.world)
    return layout_logits(run, workdir, out.name)


def layout_logits(run: MegatronRun, workdir: Path, name: str) -> torch.Tensor:
    """Logits a `megatron_logits` run saved beside its own, as `name` (`megatron_logits1.pt`: its first
    further layout; `megatron_logits_wrong0.pt`: its first wrong rule), padding rows dropped."""
    return torch.load(Path(workdir) / name)[..., : run.hf_config["vocab_size"]]


def hf_logits(hf_dir: Path, tokens: list[int]) -> torch.Tensor:
    """Logits of transformers' implementation, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


os.environ.setdefault("OMP_NUM_THREADS", "1")
