"""Weight sync into inference engines: `sync_weights` streams a live Megatron model's HF tensors in
flat buckets into an Engine adapter (vLLM, CUDA IPC into a colocated engine, SGLang's NCCL broadcast,
any callable), all ranks agreeing on the outcome; and the payload SGLang's `update_weights_from_tensor` reads. See docs/weight-sync.md."""
from mconv.live.sync.core import SyncResult, sync_weights
from mconv.live.sync.engines import CallableEngine, Engine, FlatBucket, RemoteEngine, SharedMemoryEngine
from mconv.live.sync.ipc import IPCEngine
from mconv.live.sync.sglang import SGLangDistributedEngine, sglang_payload
from mconv.live.sync.vllm import VLLMEngine

__all__ = ["sync_weights", "SyncResult", "Engine", "CallableEngine", "FlatBucket", "RemoteEngine", "SharedMemoryEngine", "VLLMEngine", "IPCEngine",
           "SGLangDistributedEngine", "sglang_payload"]
