"""--merge: a HF model with an adapter's delta (alpha/r * B @ A) added to its base weights."""
from __future__ import annotations

from pathlib import Path

import torch

from mconv.converter import fp8
from mconv.converter.hf_config import side_files
from mconv.converter.hf_experts import fp8_per_expert, stacked_expert
from mconv.converter.hf_io import HFCheckpoint
from mconv.converter.hf_write import ShardedSafetensorsWriter
from mconv.converter.lora.peft import PeftAdapter
from mconv.converter.options import DEFAULT_SHARD_BYTES
from mconv.converter.transforms import cast_dtype, checked_cast, fp32_note
from mconv.errors import MconvError
from mconv.mappings import architecture_for


def merge_adapter(adapter: PeftAdapter, alpha: float, base_dir: str | Path, out: Path,
                  dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  quantize: str | None = None, fp8_scale: str | None = None) -> tuple[int, list[str]]:
    """Write base + alpha/r * B @ A (in float32, then cast to `dtype`, default each tensor's own; see
    transforms.cast_dtype for those kept in float32) as HF safetensors into `out`, one tensor in
    memory at a time; with `quantize="fp8"` the weights the architecture's FP8 releases quantize are
    quantized from the float32 sum (fp8.quantize). An FP8 base is read dequantized into `dtype`
    (default bfloat16). Returns how many tensors changed and the notes for the user: the tensors the
    cast kept in float32 (transforms.fp32_note), an FP8 base read dequantized and written so (as
    hf2mcore says it: fp8.dequantized_note), unless `quantize` quantizes again.
    Raises MconvError where the cast turns finite values into inf (transforms.check_cast)."""
    with HFCheckpoint(base_dir, dequantize=dtype or torch.bfloat16) as base:
        side_files(base.dir)  # a bad tokenizer file stops the merge now, not after the weights
        arch = architecture_for(base.config, base.dir / "config.json")
        quantization = fp8.writer_quantization(arch, quantize, fp8_scale, base.config)
        if arch.name != adapter.arch:
            raise MconvError(f"{base.dir} is a {arch.name}, the adapter is for {adapter.arch}")
        deltas = adapter.deltas()
        for name, (a, b) in deltas.items():
            if name not in base.tensors or base.tensors[name].shape != (b.shape[0], a.shape[1]):
                found = f"has it as {list(base.tensors[name].shape)}" if name in base.tensors else "lacks it"
                raise MconvError(f"{base.dir}: the adapter changes {name} [{b.shape[0]}, {a.shape[1]}], the base model "
                                 f"{found}; is it the model the adapter was trained on?")
        plain = [(name, cast_dtype(dtype, arch.fp32_kind(name) is not None) or info.dtype, info.shape)
                 for name, info in base.tensors.items()]
        # Experts come back in the base model's form: stacked in its orientation, or per expert where the
        # base holds them so (Qwen3.5-MoE's MTP layer beside fused decoder experts); in FP8, Qwen3.5-MoE's
        # all per expert, as its FP8 releases (hf_experts.fp8_per_expert).
        stack = None
        if arch.stacked_experts and not fp8_per_expert(arch, quantization, None):
            stack = "4.x" if any(info.transposed_stride for info in base.tensors.values()) else "5.x"

        def per_expert(name: str) -> bool:
            view = stacked_expert(name)
            return view is not None and view[0] not in base.stacked

        writer = ShardedSafetensorsWriter(out, plain, max_shard_bytes, stack_experts=stack, per_expert=per_expert,
                                          quantization=quantization)
        with writer.create():
            _merge_weights(base, writer, plain, deltas, alpha, adapter.rank, quantization)
        writer.finish(base.dir, base.config, base.config)
        dequantized = (fp8.dequantized_note(base.dir, base.block, dtype or torch.bfloat16, "export-lora --merge")
                       if base.block is not None and quantization is None else None)
        return len(deltas), [note for note in (fp32_note(arch, base.tensors, dtype), dequantized) if note]


def _merge_weights(base: HFCheckpoint, writer: ShardedSafetensorsWriter, plain: list, deltas: dict, alpha: float,
                   rank: int, quantization) -> None:
    """Write every tensor of `base` (`plain`: name, dtype written, shape) into `writer`, the adapted
    ones (`deltas`: name -> (A, B)) with alpha/rank * B @ A added in float32."""
    scale = alpha / rank
    for name, out_dtype, shape in plain:
        tensor = base.read(name)
        if name in deltas:
            a, b = deltas[name]
            tensor = tensor.float() + scale * (b.float() @ a.float())
            if quantization is not None and not torch.isfinite(tensor).all() and (
                    writer.quantizes(name) or quantization.applies(name, shape)):
                raise MconvError(f"{name} with its adapter merged (the weight of {base.dir} + "
                                 f"{alpha:g}/{rank} * B @ A) holds inf or NaN values, which FP8 cannot "
                                 "quantize: check the adapter's A and B and that weight")
        if writer.quantizes(name):  # an expert's module of stacked experts: the writer quantizes its expert
            writer.write(name, tensor)
        elif quantization is not None and quantization.applies(name, shape):
            for written, quantized in fp8.quantize_tensors([(name, tensor)], quantization):
                writer.write(written, quantized)
        else:
            writer.write(name, checked_cast(name, tensor, out_dtype))
