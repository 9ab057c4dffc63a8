"""mconv's vLLM plugin (setup.cfg's `vllm.general_plugins` entry point, which vLLM calls in each of its
processes as it starts): the `mconv_shm` weight-transfer backend registered by name, its module
(vllm_receiver) imported only when an engine is built with it."""

BACKEND = "mconv_shm"


def register() -> None:
    """Register the `mconv_shm` backend with vLLM's weight-transfer factory (once, lazily). A
    `vllm serve --weight-transfer-config '{"backend": "mconv_shm"}'` with mconv installed beside it
    has the backend in its engine core and workers; `vllm_receiver.engine_args()` calls this too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "mconv.transport.vllm_receiver", "FlatBucketTransfer")
