"""Run by test_qwen3_vl with PYTHONPATH pointing at transformers 4.57 (scripts/install.sh installs it
in its own target dir with the huggingface_hub / tokenizers it needs): load each HF Qwen3-VL directory
with that release's `from_pretrained`, print its version and loading info (one JSON line per
directory), and save its fp32 logits for the inputs in INPUTS (name -> (input_ids, pixel_values or
None), image grid `__grid__`) as {HF_DIR: {name: logits}}.
Usage: transformers4_load.py INPUTS OUT HF_DIR..."""
import json
import sys
import warnings

import torch


def main(inputs_path: str, out: str, *hf_dirs: str) -> None:
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import AutoModelForImageTextToText

    inputs = torch.load(inputs_path, weights_only=True)
    grid = inputs.pop("__grid__")
    logits = {}
    for hf_dir in hf_dirs:
        model, info = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32,
                                                                  output_loading_info=True)
        logits[hf_dir] = {}
        with torch.no_grad():
            for name, (ids, pixels) in inputs.items():
                extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": grid}
                logits[hf_dir][name] = model.eval()(input_ids=ids, **extra).logits
        # The parent checks the version and where it came from, and that every key matched.
        print(json.dumps({"dir": hf_dir, "version": transformers.__version__, "file": transformers.__file__,
                          "info": {k: sorted(map(str, v)) for k, v in info.items()}}))
    torch.save(logits, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
