"""Run by test_live_build with whichever megatron-core is first on PYTHONPATH (0.19, or the 0.14
side install): two gloo processes on the CPU build the CASES named on the command line with
`mconv.live.build_model`, each in its own parallel_state, and for each:

- with Megatron-LM's own megatron.training at hand (0.19): the TransformerConfig of
  `mconv.live.transformer_config`, field by field, against `core_transformer_config_from_args` on
  the args mconv stored in the rank file (Megatron-LM's parser defaults under them, as a trainer
  passing exactly those flags: megatron_oracle.trainer_args) with CPU_RUN_ARGS; the trainer's
  runtime choices those args make (RUNTIME) are passed as overrides, which can set no model fact;
- build_model refuses the layout with the other TP size (OUT/<case>.mismatch.txt says why);
- `load_hf_weights` from the HF fixture, megatron-core's forward (rank 0 saves the logits);
- the rank file hf2mcore wrote for this rank loads into the built chunks with `strict=True`.

Usage: live_build_oracle.py OUT CASE CKPT [CASE CKPT ...] (CKPT written by hf2mcore at CASE's layout);
writes OUT/<case>.logits.pt, OUT/<case>.config.json (the differing fields) and OUT/version.
"""
import dataclasses
import functools
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mconv import Layout, MconvError  # noqa: E402
from mconv.converter.layout import Rank  # noqa: E402
from tests.conftest import FIXTURES, load_rank_file  # noqa: E402
from tests.megatron_oracle import (CPU_RUN_ARGS, MegatronRun, _config_from_args, _cpu_shims,  # noqa: E402
                                   forward_logits, read_config, trainer_args)
from tests.ranks import start_ranks  # noqa: E402

TOKENS = list(range(7, 80, 6))
# megatron-core 0.14 needs sequence parallelism with EP and TP, which its local spec's torch norms
# cannot do (Transformer Engine's can): on the CPU, 0.14 runs the MoE model at TP1/EP2.
CASES = {"dense-tp2": ("qwen3-tiny", dict(tp=2)), "moe-tp2-ep2": ("qwen3-moe-tiny", dict(tp=2, ep=2, etp=1)),
         "moe-ep2": ("qwen3-moe-tiny", dict(ep=2)), "dense-pp2-vpp2": ("qwen3-tiny", dict(pp=2, vpp=2))}
# The runtime choices of the Megatron-LM job the oracle parses (CPU_RUN_ARGS over its parser's defaults)
# where they differ from TransformerConfig's defaults: not facts of the model, so the trainer's to pass.
RUNTIME = dict(use_cpu_initialization=True, init_method_std=CPU_RUN_ARGS["init_method_std"],
               deallocate_pipeline_outputs=True, attention_softmax_in_fp32=False, bias_dropout_fusion=True,
               cp_comm_type="p2p", inference_sampling_seed=1234)
# With virtual pipeline stages Megatron-LM overlaps the pipeline's sends and receives by default.
VPP_RUNTIME = dict(overlap_p2p_comm=True, batch_p2p_comm=False)


def _comparable(value):
    """Config values as ==-comparable data: a torch.nn.init partial by its function and arguments."""
    if isinstance(value, functools.partial):
        return (value.func, value.args, tuple(sorted(value.keywords.items())))
    return value


def config_differences(ours, theirs) -> dict:
    """{field: [ours, theirs]} for every field of either config whose values differ."""
    names = {f.name for c in (ours, theirs) for f in dataclasses.fields(c)}
    # Megatron-LM's _apply_yarn_config_from_args sets GPTModel's YaRN settings as plain attributes.
    names |= {name for c in (ours, theirs) for name in vars(c) if name.startswith("yarn_")}
    return {name: [repr(getattr(ours, name, "<absent>")), repr(getattr(theirs, name, "<absent>"))]
            for name in sorted(names)
            if _comparable(getattr(ours, name, None)) != _comparable(getattr(theirs, name, None))}


def _worker(rank: int, out: Path, checkpoints: dict, store: Path) -> None:
    warnings.filterwarnings("ignore")
    _cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from mconv.live import build_model, load_hf_weights, transformer_config

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        import megatron.training  # noqa: F401  Megatron-LM's, shipped with the 0.19 install only
        oracle = True
    except ImportError:
        oracle = False
    for case, checkpoint in checkpoints.items():
        fixture, sizes = CASES[case]
        hf_dir, layout = FIXTURES / fixture, Layout(**sizes)
        ps.initialize_model_parallel(layout.tp, layout.pp, layout.vpp if layout.vpp > 1 else None,
                                     expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        run = MegatronRun(checkpoint, read_config(hf_dir), **sizes, tokens=TOKENS)
        rank_file = (checkpoint / "release" / layout.rank_dir(
            Rank(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                 ps.get_expert_model_parallel_rank() if layout.ep > 1 else 0))
            / "model_optim_rng.pt")
        stored = load_rank_file(rank_file, map_location="cpu")
        if oracle and rank == 0:
            theirs, _ = _config_from_args(trainer_args(stored["args"], run))
            ours = transformer_config(hf_dir, layout, dtype=torch.float32,
                                      **RUNTIME, **(VPP_RUNTIME if layout.vpp > 1 else {}))
            (out / f"{case}.config.json").write_text(json.dumps(config_differences(ours, theirs)))
        try:  # a layout other than parallel_state's is refused
            build_model(hf_dir, dataclasses.replace(layout, tp=3 - layout.tp))
        except MconvError as e:
            (out / f"{case}.mismatch.txt").write_text(str(e))
        chunks = build_model(hf_dir, layout, dtype=torch.float32, parallel_output=False, use_cpu_initialization=True)
        load_hf_weights(chunks, hf_dir)
        for model in chunks:
            model.eval()
        forward_logits(chunks, run, chunks[0].config.hidden_size, out / f"{case}.logits.pt")
        for v, model in enumerate(chunks):
            model.load_state_dict(stored["model"] if layout.vpp == 1 else stored[f"model{v}"], strict=True)
        dist.barrier()
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def main(out: str, *cases: str) -> None:
    import megatron.core

    out = Path(out)
    (out / "version").write_text(f"{megatron.core.__version__} {megatron.core.__file__}")
    checkpoints = {case: Path(checkpoint) for case, checkpoint in zip(cases[::2], cases[1::2])}
    start_ranks(_worker, args=(out, checkpoints, out / "store"), nprocs=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
