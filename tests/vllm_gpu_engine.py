"""vLLM on a GPU, for tests/test_gpu_vllm.py: an in-process `LLM` of HF_DIR (its dtype; vLLM's Triton
attention and Triton delta-net kernels, as scripts/bundle-vllm-gpu.sh carries neither flash-attention
nor FlashInfer; a vision-language model served text only, its vision tower not built), serving mconv's Receiver
when SOCKET and AUTHKEY_HEX are given, with weight-transfer BACKEND: vLLM's own "ipc" (the default; the engine core
in this process) or mconv's "mconv_shm" (vLLM's default engine-core process; VLLM_ALLOW_INSECURE_SERIALIZATION=1
then, as this script's parameter dump and a verified sync hand functions to the worker; the engine core spawned,
finding mconv's backend through its plugin entry point, which the caller puts on PYTHONPATH). It prints
"MCONV READY" and then answers JSON lines on stdin, each with one "MCONV {json}" line on stdout:

    {"op": "dump", "path": P}  writes every parameter vLLM holds to P (safetensors) and answers
                               {"tokens": greedy tokens for each prompt, "logprobs": [{token: logprob}
                               of the top 20 at each prompt position], "version": the Receiver's}
    {"op": "quit"}

    python tests/vllm_gpu_engine.py HF_DIR [SOCKET AUTHKEY_HEX [BACKEND]]
"""
import contextlib
import json
import os
import sys

PROMPTS = [list(range(3, 60, 4)), [5, 9, 2, 7, 11, 30, 8]]
LLM_ARGS = dict(max_model_len=128, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=128,
                kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.3, distributed_executor_backend="uni",
                skip_tokenizer_init=True, enable_prefix_caching=True, attention_backend="TRITON_ATTN",
                additional_config={"gdn_prefill_backend": "triton"})
TEXT_ONLY = dict(limit_mm_per_prompt={"image": 0, "video": 0})


def _parameters(worker) -> dict:
    return {name: p.detach().cpu().contiguous().clone() for name, p in worker.model_runner.model.named_parameters()}


def main() -> None:
    backend = sys.argv[4] if len(sys.argv) > 4 else "ipc"
    # Before vLLM is imported. The bundle carries no FlashInfer: vLLM's sampler then uses its PyTorch top-k/top-p.
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0",
                      # spawned, not forked: the engine core finds mconv's backend through its plugin, as installed
                      **(dict(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                              VLLM_WORKER_MULTIPROC_METHOD="spawn")
                         if backend == "mconv_shm" else dict(VLLM_ENABLE_V1_MULTIPROCESSING="0")))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mconv.transport.vllm_receiver import Receiver, engine_args

    hf_dir, serve = sys.argv[1], len(sys.argv) > 2
    with open(os.path.join(hf_dir, "config.json")) as config:
        vision = "vision_config" in json.load(config)
    llm = LLM(model=hf_dir, **LLM_ARGS, **(TEXT_ONLY if vision else {}), **(engine_args(backend) if serve else {}))
    if serve and backend == "mconv_shm":
        from vllm.v1.engine.core_client import InprocClient

        assert not isinstance(llm.llm_engine.engine_core, InprocClient), "the engine core runs in this process"
    receiver = Receiver(llm, sys.argv[2], bytes.fromhex(sys.argv[3])) if serve else None
    if receiver is not None:
        receiver.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, prompt_logprobs=20)
    print("MCONV READY", flush=True)
    for line in sys.stdin:
        message = json.loads(line)
        if message["op"] == "quit":
            break
        with receiver.lock if receiver is not None else contextlib.nullcontext():
            (held,) = llm.collective_rpc(_parameters)
            save_file(held, message["path"])
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        answer = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                  "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.prompt_logprobs[1:]]
                               for o in outputs],
                  "version": receiver.version if receiver is not None else None}
        print("MCONV " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
