"""The engine side of a weight sync into vLLM (docs/weight-sync.md): an in-process vLLM `LLM`
(vLLM's CPU build here, float32) that takes a trainer's `mconv.live.sync.sync_weights` through
mconv's `Receiver` on SOCKET, and answers generation requests on SOCKET.gen (JSON {"op":
"generate"} -> {"tokens", "logprobs", "version"}: greedy, 8 tokens for each prompt of PROMPTS_JSON).
Prints READY when both listen. Run with the vLLM venv's Python (no megatron-core needed), from the
repository root or with it on PYTHONPATH; tests/test_weight_sync.py runs it. In the CPU venv
scripts/install-vllm.sh makes, tests/vllm_site goes on PYTHONPATH too: the index's torchvision there
is a CUDA build, whose import fails beside the CPU torch without it ("operator torchvision::nms
does not exist"; tests/vllm_site/sitecustomize.py says why).

    PYTHONPATH=tests/vllm_site .venv/vllm311/bin/python examples/vllm_sync_engine.py HF_DIR SOCKET AUTHKEY_HEX PROMPTS_JSON
"""
import json
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
# A small float32 engine for vLLM's CPU build, prefix caching on (the sync resets it); with
# **engine_args() as below. bench/sync_vllm_cpu.py builds its engine with these too.
LLM_ARGS = dict(dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=128,
                kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni", skip_tokenizer_init=True,
                enable_prefix_caching=True, block_size=32)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mconv.transport import shm
    from mconv.transport.vllm_receiver import Receiver, engine_args

    hf_dir, socket, authkey, prompts = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=hf_dir, **LLM_ARGS, **engine_args())
    receiver = Receiver(llm, socket, authkey)
    receiver.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=0)
    with shm.listen(socket + ".gen", authkey) as listener:
        print("READY", flush=True)
        with listener.accept() as conn:
            while True:
                try:
                    message = shm.receive(conn)
                except EOFError:
                    break
                with receiver.lock:
                    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                shm.send(conn, {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                "logprobs": [[step[t].logprob for step, t in zip(o.outputs[0].logprobs,
                                                                                 o.outputs[0].token_ids)]
                                             for o in outputs],
                                "version": llm.get_weight_version()})
