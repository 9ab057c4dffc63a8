"""Weight sync into inference engines: `sync_weights` streams a live Megatron model's HF tensors in
flat buckets into an Engine adapter (vLLM, CUDA IPC into an engine that owns its parameters,
SGLang colocated and disaggregated, any callable), all ranks agreeing on the outcome. See docs/weight-sync.md."""
from mconv.live.sync.core import SyncResult, sync_weights
from mconv.live.sync.engines import CallableEngine, Engine, FlatBucket, RemoteEngine, SharedMemoryEngine
from mconv.live.sync.ipc import IPCEngine
from mconv.live.sync.sglang import SGLangDistributedEngine, SGLangEngine, sglang_payload
from mconv.live.sync.vllm import VLLMEngine, VLLMIPCEngine, VLLMServerEngine

__all__ = ["sync_weights", "SyncResult", "Engine", "CallableEngine", "FlatBucket", "RemoteEngine", "SharedMemoryEngine", "VLLMEngine", "VLLMIPCEngine", "VLLMServerEngine", "IPCEngine",
           "SGLangEngine", "SGLangDistributedEngine", "sglang_payload"]
