"""A trainer's weight sync with mconv.live, on the CPU: build the Megatron model of an HF checkpoint,
load its weights, take one optimizer step, and stream the new weights out as HF-named tensors, in
buckets (where an RL trainer would hand each bucket to its inference engine).

    torchrun --nproc_per_node 2 examples/weight_sync_gloo.py [--hf fixtures/qwen3-tiny] [--tp 2] [--save OUT.pt]

Every rank runs the same code (megatron-core's collectives); `--save` writes the streamed tensors
(rank 0's copy) to OUT.pt.
"""
import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import initialize_rng_tracker

from mconv import Layout
from mconv.live import build_model, iter_hf_weights, load_hf_weights

TOKENS = list(range(7, 80, 6))  # the training batch: one sequence of token ids
LR = 0.5  # plain SGD, so the step is easy to check against transformers' own gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", default="fixtures/qwen3-tiny", help="HF model directory or hub name")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the world size by default)")
    parser.add_argument("--save", help="write the streamed HF tensors here (torch.save)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # megatron-core puts RoPE frequencies on the current device
    dist.init_process_group("gloo")  # torchrun's environment gives the rank, world size and address
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    # megatron-core's RNG states for dropout: on a GPU, tensor_parallel.model_parallel_cuda_manual_seed(seed);
    # on the CPU its tracker without CUDA states (Qwen3 has no dropout).
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    layout = Layout(tp=args.tp)

    # 1. The rank's model chunks, built by megatron-core from the HF config, and the HF weights in them.
    chunks = build_model(args.hf, layout, dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(chunks, args.hf)

    # 2. One training step: next-token cross entropy on TOKENS.
    tokens = torch.tensor([TOKENS[:-1]])
    labels = torch.tensor([TOKENS[1:]])
    seq = tokens.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked
    optimizer = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=LR)
    loss = chunks[0](tokens, torch.arange(seq).unsqueeze(0), causal, labels=labels).mean()
    loss.backward()
    # As megatron-core's finalize_model_grads does (a trainer's DDP wrapper runs it): the per-head norms
    # see only this rank's heads, so their gradients are summed over TP.
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    optimizer.step()

    # 3. The weight sync: HF-named tensors, gathered over TP, in buckets of at most bucket_bytes.
    streamed = {}
    for i, bucket in enumerate(iter_hf_weights(chunks, args.hf, bucket_bytes=64 * 1024)):
        if dist.get_rank() == 0:
            print(f"bucket {i}: {len(bucket)} tensors, {sum(t.nbytes for _, t in bucket)} bytes", flush=True)
        streamed.update((name, tensor.clone()) for name, tensor in bucket)  # an engine would take them here
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}; streamed {len(streamed)} tensors, "
              f"{sum(t.nbytes for t in streamed.values())} bytes", flush=True)
        if args.save:
            torch.save(streamed, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
