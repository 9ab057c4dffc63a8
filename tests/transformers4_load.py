"""Run by test_qwen3_vl with PYTHONPATH pointing at transformers 4.57 (scripts/install.sh installs it
in its own target dir with the huggingface_hub / tokenizers it needs): load an HF Qwen3-VL directory
with that release's `from_pretrained`, print its version and loading info, and save its fp32 logits
for the inputs in INPUTS (name -> (input_ids, pixel_values or None), image grid `GRID`).
Usage: transformers4_load.py HF_DIR INPUTS OUT."""
import json
import sys
import warnings

import torch


def main(hf_dir: str, inputs_path: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    inputs = torch.load(inputs_path, weights_only=True)
    grid = inputs.pop("__grid__")
    logits = {}
    with torch.no_grad():
        for name, (ids, pixels) in inputs.items():
            extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": grid}
            logits[name] = model.eval()(input_ids=ids, **extra).logits
    torch.save(logits, out)
    # The parent checks the version and where it came from, and that every key matched.
    print(json.dumps({"version": transformers.__version__, "file": transformers.__file__,
                      "info": {k: sorted(map(str, v)) for k, v in info.items()}}))


if __name__ == "__main__":
    main(*sys.argv[1:])
