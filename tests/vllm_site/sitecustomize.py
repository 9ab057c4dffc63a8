"""Put on PYTHONPATH of the vLLM CPU venv's processes (tests only) so that torchvision imports there.

vLLM's Qwen3-VL model module imports transformers' Qwen2-VL image processor, which imports
torchvision. The package index has torchvision 0.28.0 (the release for vLLM's torch 2.13) only as a
CUDA build: its C++ ops library (`torchvision/_C.so`) needs libtorch_cuda and does not load beside
the CPU torch, and its import then still registers fake kernels for `torchvision::nms` / `::qnms`,
which fails ("operator torchvision::nms does not exist"). Declaring those two ops' schemas (no
kernels) lets the import finish. The image transforms Qwen3-VL uses are torchvision's Python code on
torch ops and run; torchvision's C++ ops (detection: nms, roi_align, ...) stay unavailable.
"""
import torch

for _op in ("nms", "qnms"):
    torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
