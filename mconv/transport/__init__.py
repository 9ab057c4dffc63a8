"""The engine-side half of mconv's weight sync: flat buckets (many tensors in one contiguous buffer,
flat.py), the shared-memory buffers and control connection that carry them between processes
(shm.py) or CUDA IPC handles (cuda_ipc.py), and the receivers that run inside an inference engine's
process (update_receiver.py: the trainer's requests and the update session they all serve;
receiver.py for an engine that owns its parameters, vllm_receiver.py for vLLM).

Nothing here imports megatron-core: an engine's process (vLLM's Python 3.11 venv, say) imports it
with torch alone. The trainer's half is mconv.live.sync.
"""
