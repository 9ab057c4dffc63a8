"""Serve a LoRA adapter written by `mconv export-lora` with vLLM's offline engine and print the
greedy tokens it generates with the adapter applied:

    mconv export-lora CKPT adapter --base-model BASE
    python examples/lora_to_vllm.py BASE adapter '[7, 13, 19]'

BASE is the HF model the adapter was trained on (directory or hub name); the last argument is the
prompt as token ids (JSON). `add_lora` is vLLM's own adapter loader: it raises for an adapter it
rejects. The engine settings are small ones for vLLM's CPU build (tests/test_lora.py runs this
script on the tiny Qwen3 and checks the tokens against transformers + peft); on a GPU keep the LoRA
arguments and drop the rest.
"""
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the tokens print here

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    base, adapter, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        rank = json.load(f)["r"]
    # vLLM's LoRAConfig takes one of these sizes for the largest rank it serves
    max_lora_rank = next(n for n in (1, 8, 16, 32, 64, 128, 256, 320, 512) if n >= rank)
    llm = LLM(model=base, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
              dtype="float32", max_model_len=128, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=128,
              kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni")
    request = LoRARequest("exported", 1, adapter)
    llm.llm_engine.add_lora(request)
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora_request=request)
    print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)))
