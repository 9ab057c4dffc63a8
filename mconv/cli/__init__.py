"""The `mconv` command line: its commands and their options (how the program runs as a process,
its errors, exit statuses and signals: `process`)."""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

import click

from mconv import __version__
from mconv.converter.layout import Layout, count, parse_layout_string
from mconv.converter.options import (DTYPES, FORMATS, FP8_SCALES, MAX_ITERATION, MAX_SIZE, MAX_WORKERS, QUANTIZATIONS,
                                    SPECS, command_line_names, parse_size)
from mconv.converter.parallel import torchrun_rank
from mconv.cli.process import Group, _on_signal, _stopped, fail, run


SIZE_HELP = (" Read as transformers reads max_shard_size: GB, MB, KB are powers of 1000, GiB, MiB, KiB powers "
             "of 1024 (any case), but a lower-case final b means bits (100kb is 12,500 bytes).")


class Size(click.ParamType):
    """A byte size as transformers reads max_shard_size: 3GB, 500MB, 1GiB (`options.parse_size`;
    click names the option in its error)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(value)
        except ValueError:
            self.fail(f"{value!r} is not a size such as 3GB, 500MB or 1GiB (read as transformers reads "
                      "max_shard_size: a lower-case final b means bits)", param, ctx)
        if not 0 < size <= MAX_SIZE:
            self.fail(f"{value!r} is not a size from 1 byte to {MAX_SIZE:,} bytes", param, ctx)
        return size


def default_workers() -> int:
    """Half the CPUs, at most 4: measured with bench/convert.py --workers 1,2,4,8 (README,
    Benchmarks). On 16 cores 4 threads were the fastest or within noise of it for every command
    (more add nothing: the page cache and the single torch.save stream are the limit); on 2 cores
    this gives 1, which leaves a core to the kernel's writeback."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


POSITIVE = click.IntRange(min=1)  # (a size or count: 0 is refused by click, exit 2, as --workers 0)
REVISION_HELP = ("Branch, tag or commit of a hub model name (default: its default branch). Hub names are "
                 "resolved as transformers does: the hub cache under HF_HOME, HF_HUB_OFFLINE, HF_TOKEN.")
WORKERS_HELP = ("Threads that convert disjoint tensors of the output (default: half the CPUs, at most 4; "
                f"1 to {MAX_WORKERS}). "
                "Under torchrun, the ranks share the work, each with this many threads. On machines of fewer "
                "than 4 CPUs tensor bytes are copied file to file in the kernel (copy_file_range), on larger "
                "ones through memory (pread/pwrite), the faster of the two on each as measured; "
                "MCONV_COPY_FILE_RANGE=1 or 0 chooses.")


def report(summary, started: float, as_json: bool, text: str) -> None:
    """The closing line, or a JSON summary for scripts (tensors, bytes, seconds, peak RSS); under
    torchrun from rank 0 only, which speaks for the job."""
    if torchrun_rank()[0]:
        return
    if as_json:
        click.echo(json.dumps({"tensors": summary.tensors, "bytes": summary.bytes, "files": summary.files,
                               "seconds": round(time.perf_counter() - started, 3), "peak_rss_bytes": peak_rss()}))
    else:
        click.echo(text)


def peak_rss() -> int:
    """The peak resident memory of this process or of any child it waited for, in bytes."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024


def print_notes(summary, quiet: bool) -> None:
    """What the user must know about a conversion (Summary.notes, LoraExport.notes), on stderr; not
    with -q, and under torchrun from rank 0 only."""
    for note in summary.notes if not quiet and not torchrun_rank()[0] else ():
        click.echo(f"mconv: note: {note}", err=True)


def fp8_scale_needs_quantize(quantize, fp8_scale) -> None:
    """--fp8-scale without --quantize: a usage error (exit 2), as click's own."""
    if fp8_scale is not None and quantize is None:
        raise click.UsageError(f"--fp8-scale {fp8_scale} applies with --quantize fp8")


def not_empty(ctx, param, value):
    """An option given as "" (an unset shell variable) is a usage error, not the option left out."""
    if value == "":
        raise click.BadParameter("is empty: give a value, or leave the option out", ctx, param)
    return value


QUIET_HELP = "Quiet: no progress bars and no informational lines (errors are still printed)."


def show_progress(quiet: bool, as_json: bool = False) -> bool:
    """Progress bars only for a person watching: not with -q or --json, and not when stderr is a
    file or a pipe (a log would fill with carriage-return fragments)."""
    return not (quiet or as_json) and sys.stderr.isatty()


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mconv", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context):
    """Convert model weights between Hugging Face and Megatron-Core, exactly.

    \b
    mconv hf2mcore HF_DIR OUT --tp 2 --pp 2      HF safetensors -> Megatron checkpoint
    mconv mcore2hf OUT HF_OUT                    Megatron checkpoint -> HF safetensors
    mconv inspect PATH                           what a checkpoint is
    mconv export-lora CKPT ADAPTER_OUT           Megatron LoRA -> HF PEFT adapter (or --merge)
    mconv verify FIRST SECOND                    are two HF models bit-identical?

    Outputs are written to a temporary sibling directory and renamed into place only when
    complete; inputs are never modified.

    \b
    Environment (unset: the measured default; anything but 0 or 1 is refused):
      MCONV_COPY_FILE_RANGE=1|0  copy tensor bytes file to file in the kernel (default: 1 on
                                 machines of fewer than 4 CPUs) or through memory
      MCONV_WRITEBACK=1|0        start each large write's write-back to disk at once (default 1),
                                 so the closing fsync has little left, or leave it all to fsync
    """
    ctx.with_resource(command_line_names())  # messages name this command's flags, not library parameters


@main.command("hf2mcore", short_help="HF safetensors -> Megatron checkpoint.")
@click.argument("hf_dir", type=click.Path(file_okay=False), metavar="HF_DIR|HUB_NAME")
@click.argument("out_dir", type=click.Path())
@click.option("--revision", default=None, callback=not_empty, help=REVISION_HELP)
@click.option("--tp", type=POSITIVE, default=1, show_default=True, help="Tensor parallel size.")
@click.option("--pp", type=POSITIVE, default=1, show_default=True, help="Pipeline parallel size.")
@click.option("--vpp", type=POSITIVE, default=1, show_default=True, help="Virtual pipeline chunks per pipeline rank.")
@click.option("--ep", type=POSITIVE, default=1, show_default=True, help="Expert parallel size (MoE).")
@click.option("--etp", type=POSITIVE, default=1, show_default=True,
              help="Expert tensor parallel size (MoE parallel folding; 1 = experts not split by TP).")
@click.option("--layout", "layout_string", default=None,
              help="AReaL-style layout instead of --tp/--pp/--ep/--etp, e.g. 'attn:d1p4t2c2|ffn:d1p4t1e4' "
                   "(attention dp/pp/tp/cp, experts dp/pp/tp/ep; dp and cp do not change weights).")
@click.option("--first-stage-layers", type=POSITIVE, default=None,
              help="Layers on the first pipeline stage (uneven pipeline; Megatron-LM "
                   "--decoder-first-pipeline-num-layers).")
@click.option("--last-stage-layers", type=POSITIVE, default=None,
              help="Layers on the last pipeline stage (Megatron-LM --decoder-last-pipeline-num-layers).")
@click.option("--vocab-divisor", type=POSITIVE, default=128, show_default=True,
              help="Megatron's --make-vocab-size-divisible-by; the vocabulary is padded to a multiple "
                   "of this times --tp.")
@click.option("--spec", type=click.Choice(SPECS), default="local", show_default=True,
              help="Megatron layer spec the trainer builds: 'te' (Transformer Engine names, fused layer "
                   "norms; with --format torch only) or 'local'.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="torch_dist", show_default=True,
              help="Megatron checkpoint format: 'torch_dist' (Megatron-LM's default; layout-independent, "
                   "the trainer reshards on load) or 'torch' (legacy, one file per rank).")
@click.option("--iteration", type=click.IntRange(0, MAX_ITERATION), default=None,
              help="Write iter_NNNNNNN/ with this iteration instead of release/.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Cast every tensor to this dtype (torch's cast), recorded in the checkpoint's args as "
                   "Megatron-LM's --bf16/--fp16 record it, but those the model keeps in float32 (BailingMoeV3's "
                   "router expert_bias, KDA A_log / dt_bias), which stay float32 (a note counts them). Default: "
                   "each tensor keeps its HF dtype (FP8 weights are dequantized into bfloat16).")
@click.option("--mtp", is_flag=True,
              help="Keep the multi-token-prediction layers (config.json num_nextn_predict_layers; Qwen3.5's "
                   "mtp_num_hidden_layers) in megatron-core's MTP block (mtp.layers.N., last pipeline stage; stored "
                   "args mtp_num_layers); by default they are left out with a note. mcore2hf brings them back.")
@click.option("--dry-run", is_flag=True, help="Print the plan (ranks, tensors, bytes) and write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists (only once the new one is complete).")
@click.option("--workers", type=click.IntRange(1, MAX_WORKERS), default=None, help=WORKERS_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON summary (tensors, bytes, seconds, peak RSS; with --dry-run: tensors, bytes, files, "
                   "plan).")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)
def hf2mcore_command(hf_dir, out_dir, revision, tp, pp, vpp, ep, etp, layout_string, first_stage_layers, last_stage_layers,
                     vocab_divisor, spec, fmt, iteration, dtype, mtp, dry_run, overwrite, workers, as_json, quiet):
    """Convert the HF model HF_DIR (a directory, or a hub name such as Qwen/Qwen3-8B) into a
    Megatron checkpoint in OUT_DIR.

    The layout (--tp/--pp/--vpp...) and --spec must match the Megatron job that will load it.
    The HF config and tokenizer are stored in the checkpoint, so `mconv mcore2hf` can reverse
    the conversion with no other argument.
    """
    sizes = dict(tp=tp, pp=pp, ep=ep, etp=etp)
    if layout_string:
        ctx = click.get_current_context()
        given = [f"--{k}" for k in sizes if ctx.get_parameter_source(k).name != "DEFAULT"]
        if given:
            fail(f"--layout replaces {', '.join(given)}; give one or the other")
        sizes = run(lambda: parse_layout_string(layout_string))
    layout = run(lambda: Layout(vpp=vpp, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                                vocab_divisor=vocab_divisor, **sizes))
    from mconv.converter.hf2mcore import hf2mcore  # imports torch: not needed for --help

    started = time.perf_counter()
    summary = run(lambda: hf2mcore(hf_dir, out_dir, layout, spec=spec, fmt=fmt, iteration=iteration, mtp=mtp,
                                   overwrite=overwrite, dry_run=dry_run, progress=show_progress(quiet, as_json),
                                   workers=workers or default_workers(), revision=revision,
                                   dtype=dtype, torchrun=True))
    plan = summary.plan
    print_notes(summary, quiet)
    header = (f"{plan.arch.name}: {plan.dims.layers} layers, {layout.describe()}, spec {spec}, "
              f"padded vocab {plan.padded_vocab}")
    if dry_run and as_json:
        click.echo(json.dumps({"tensors": summary.tensors, "bytes": summary.bytes, "files": summary.files,
                               "plan": summary.files_plan}))
    elif dry_run:
        click.echo(f"plan for {out_dir} ({header})")
        for line in summary.lines:
            click.echo(f"  {line}")
        click.echo(f"total: {summary.tensors} tensors, {summary.bytes:,} bytes")
    elif not quiet or as_json:
        report(summary, started, as_json,
               f"wrote {out_dir} ({fmt}): {summary.tensors} tensors, {summary.bytes:,} bytes ({header})")


@main.command("mcore2hf", short_help="Megatron checkpoint -> HF safetensors.")
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--hf-config", type=click.Path(file_okay=False), default=None, callback=not_empty, metavar="DIR|HUB_NAME",
              help="Directory or hub name with the HF config.json (and tokenizer) of the model; needed for "
                   "checkpoints not written by mconv, and overrides the one stored in the checkpoint.")
@click.option("--revision", default=None, callback=not_empty, help=REVISION_HELP)
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Cast every tensor to this dtype (e.g. a float32 training checkpoint to bfloat16), but those "
                   "the model keeps in float32 (BailingMoeV3's router expert_bias, KDA A_log / dt_bias), which "
                   "stay float32 (a note counts them). Default: each tensor keeps its dtype. config.json's dtype "
                   "follows what is written.")
@click.option("--max-shard-size", type=Size(), default="3GB", show_default=True,
              help="Largest safetensors shard (a larger tensor gets a shard of its own)." + SIZE_HELP)
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists (only once the new one is complete).")
@click.option("--expert-orientation", type=click.Choice(["4.x", "5.x"]), default=None,
              help="Stacked HF experts (Qwen3-VL-MoE and Qwen3.5-MoE; refused for other models): for "
                   "Qwen3-VL-MoE 4.x (default) writes gate_up_proj [E, hidden, 2I] / down_proj "
                   "[E, I, hidden], which transformers 4.57 and 5.x both load; 5.x writes [E, 2I, hidden] / "
                   "[E, hidden, I], as transformers 5.x saves. Required when hidden == 2I or hidden == I: a "
                   "square stacked tensor is read right by only one of transformers 4.x and 5.x. Qwen3.5-MoE: "
                   "by default the experts come back as hf2mcore's input had them (fused or per expert, as "
                   "mconv.json records), with --quantize fp8 per expert (the FP8 releases' form); 5.x (the only "
                   "stacked form transformers loads) fuses them, in FP8 too (vLLM loads stacked FP8 experts, "
                   "transformers 5.17 does not).")
@click.option("--quantize", type=click.Choice(QUANTIZATIONS), default=None,
              help="Write block-wise FP8 (128x128 blocks, float8_e4m3fn weights with float32 weight_scale_inv) "
                   "as the model's FP8 releases hold it: the linear projections quantized, embeddings, lm_head, "
                   "norms, router and vision tower kept (in --dtype, or as stored; Qwen3.5 and Qwen3-Next also "
                   "keep the delta-net's in_proj_b/in_proj_a, conv1d, shared_expert_gate and mtp.fc). For Qwen3, "
                   "Qwen3-MoE, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5/3.6 (text and VL) and Qwen3-Next (stacked experts "
                   "quantized expert by expert; Qwen3.5/3.6-MoE experts written per expert unless "
                   "--expert-orientation is given) and BailingMoeV3 (KDA b_proj and MLA g_proj kept, as vLLM "
                   "loads it). "
                   "See docs/fp8.md.")
@click.option("--fp8-scale", type=click.Choice(FP8_SCALES), default=None,
              help="With --quantize fp8: 'float' (amax/448) or 'ue8m0' (powers of two, DeepGEMM / SGLang). "
                   "Default: the stored HF config's quantization_config.scale_fmt (a UE8M0 model comes back "
                   "UE8M0), else 'float'.")
@click.option("--workers", type=click.IntRange(1, MAX_WORKERS), default=None, help=WORKERS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary (tensors, bytes, seconds, peak RSS).")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)
def mcore2hf_command(ckpt_dir, out_dir, hf_config, revision, dtype, max_shard_size, overwrite, expert_orientation,
                     quantize, fp8_scale, workers, as_json, quiet):
    """Convert the Megatron checkpoint in CKPT_DIR into an HF model directory OUT_DIR.

    CKPT_DIR is the save directory (with latest_checkpointed_iteration.txt) or an iter_*/release
    directory. The parallel layout is read from the checkpoint's saved args.
    """
    fp8_scale_needs_quantize(quantize, fp8_scale)
    from mconv.converter.mcore2hf import mcore2hf

    started = time.perf_counter()
    summary = run(lambda: mcore2hf(ckpt_dir, out_dir, hf_config=hf_config, max_shard_bytes=max_shard_size,
                                   overwrite=overwrite, progress=show_progress(quiet, as_json),
                                   workers=workers or default_workers(), dtype=dtype,
                                   revision=revision, expert_orientation=expert_orientation,
                                   quantize=quantize, fp8_scale=fp8_scale, torchrun=True))
    print_notes(summary, quiet)
    if not quiet or as_json:
        report(summary, started, as_json, f"wrote {out_dir}: {count(summary.files, 'safetensors shard')}, "
                                          f"{summary.tensors} tensors, {summary.bytes:,} bytes ({summary.plan.arch.name})")


@main.command("inspect", short_help="What a checkpoint or HF model is, and the flags its trainer needs.")
@click.argument("path")
@click.option("--hf-config", default=None, callback=not_empty, metavar="DIR|HUB_NAME",
              help="Directory or hub name with the HF config.json of the model, for checkpoints that store none: "
                   "the tensors are then checked against the architecture.")
@click.option("--revision", default=None, callback=not_empty, help=REVISION_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of text.")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP + " The description itself is printed.")
def inspect_command(path, hf_config, revision, as_json, quiet):
    """Describe PATH: a Megatron checkpoint (legacy torch or torch_dist, written by any tool; its
    LoRA adapters too), an HF model (directory or hub name; its FP8 quantization too) or a PEFT
    adapter directory: format, model, layout, dtypes, size, and the Megatron-LM flags the training
    job must pass."""
    from mconv.converter.describe import inspect_path, render

    info = run(lambda: inspect_path(path, hf_config=hf_config, revision=revision,
                                    progress=show_progress(quiet, as_json)))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for line in render(info):
        click.echo(line)


@main.command("verify", short_help="Are two HF models (or PEFT adapters) bit-identical?")
@click.argument("first", type=click.Path(file_okay=False))
@click.argument("second", type=click.Path(file_okay=False))
@click.option("--revision", default=None, callback=not_empty, help=REVISION_HELP + " Applies to each of FIRST and "
              "SECOND that is a hub name.")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON for scripts instead of text: identical, tensors, bytes and every difference "
                   "(the exit status is the same).")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)
def verify_command(first, second, revision, as_json, quiet):
    """Check that two HF model directories hold the same tensors, bit for bit (names, dtypes,
    shapes and bytes; shard layout may differ) and the same config.json quantization_config
    settings (method, FP8 format, block size, activation scheme, scale format), or two PEFT adapters the same tensors
    and adapter settings (r, alpha, target modules...). Stacked experts stored in another form
    (fused vs per expert, or another orientation) differ, and verify says whether their values
    are the same. Also the model settings mconv reads from config.json, and the generation config
    and tokenizer files. Exit status 0 if they are the same, 1 if they differ (with -q: one line),
    2 if they could not be compared (a model missing or unreadable), as cmp's."""
    from mconv.converter.pipelines import compare_hf

    tensors, nbytes, differences = run(lambda: compare_hf(first, second, progress=show_progress(quiet, as_json), revision=revision),
                                       status=2)
    if as_json:
        click.echo(json.dumps({"identical": not differences, "tensors": tensors, "bytes": nbytes,
                               "differences": differences}, indent=2))
        sys.exit(1 if differences else 0)
    if differences:
        for line in differences[:20] if not quiet else ():
            click.echo(f"  {line}", err=True)
        more = f" (first 20 of {len(differences)})" if len(differences) > 20 and not quiet else ""
        fail(f"{first} and {second} differ{more}" if not quiet else
             f"{first} and {second} differ ({count(len(differences), 'difference')}; the first: {differences[0]})")
    if not quiet:
        click.echo(f"identical: {tensors} tensors, {nbytes:,} bytes, bit for bit")


@main.command("export-lora", short_help="Megatron LoRA -> HF PEFT adapter (or a merged model).")
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path())
@click.option("--hf-config", type=click.Path(file_okay=False), default=None, callback=not_empty, metavar="DIR|HUB_NAME",
              help="Directory or hub name with the base model's HF config.json; needed for checkpoints not "
                   "written by mconv.")
@click.option("--rank", type=POSITIVE, default=None,
              help="Expected LoRA rank r (Megatron-Bridge's `dim`); the export stops if the adapters have another. "
                   "Read from the tensors either way.")
@click.option("--alpha", type=float, default=None,
              help="LoRA alpha (scale = alpha / r). Default: peft.alpha from Megatron-Bridge's run_config.yaml in the "
                   "checkpoint; required when there is none.")
@click.option("--base-model", default=None, callback=not_empty, metavar="DIR|HUB_NAME",
              help="Written as base_model_name_or_path (a hub name or path). With --merge: the HF model "
                   "(directory or hub name) whose weights the delta is added to.")
@click.option("--revision", default=None, callback=not_empty, help=REVISION_HELP + " Applies to --hf-config and --merge's --base-model.")
@click.option("--merge", is_flag=True,
              help="Write a full HF model (base + alpha/r * B @ A) instead of an adapter, for serving merged weights.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="With --merge: dtype of the written tensors (default: each base tensor's own). The delta is "
                   "added in float32 either way.")
@click.option("--max-shard-size", type=Size(), default="3GB", show_default=True, help="With --merge: largest safetensors shard." + SIZE_HELP)
@click.option("--quantize", type=click.Choice(QUANTIZATIONS), default=None,
              help="With --merge: write the merged model as block-wise FP8, as `mcore2hf --quantize fp8` does "
                   "(merged first, then quantized; Qwen3, Qwen3-MoE, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5/3.6 (text and "
                   "VL; MoE experts written per expert), Qwen3-Next and BailingMoeV3). See docs/fp8.md.")
@click.option("--fp8-scale", type=click.Choice(FP8_SCALES), default=None,
              help="With --quantize fp8: 'float' (amax/448) or 'ue8m0' (powers of two). Default: the base "
                   "model config's quantization_config.scale_fmt (a UE8M0 model comes back UE8M0), else 'float'.")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists (only once the new one is complete).")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON summary for scripts: what was written (adapter or merged model), architecture, r, "
                   "alpha, target modules, tensors, the checkpoint's format and layout, notes, seconds, peak RSS.")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)
def export_lora_command(ckpt_dir, out_dir, hf_config, rank, alpha, base_model, revision, merge, dtype,
                        max_shard_size, quantize, fp8_scale, overwrite, as_json, quiet):
    """Export the Megatron-Bridge LoRA adapter in CKPT_DIR as a HF PEFT adapter in OUT_DIR.

    CKPT_DIR is a legacy (torch) or torch_dist checkpoint, adapter-only or with the base weights,
    at any TP/PP/VPP/EP/ETP layout (read from its saved args). Adapter tensors are named
    <module>.adapter.linear_in.weight (A) and .adapter.linear_out.weight (B) (CanonicalLoRA:
    .adapter.adapter_q.linear_in.weight, ...). Fused adapters are split for HF: linear_qkv ->
    q_proj/k_proj/v_proj and linear_fc1 -> gate_proj/up_proj (same A, B split by query groups or
    by the GLU rule), linear_proj -> o_proj, linear_fc2 -> down_proj; expert adapters become
    per-expert modules (mlp.experts.{e}.gate_proj, ...), an adapter shared by a rank's experts
    copied to each of them; stacked HF experts (Qwen3-VL-MoE) take peft's target_parameters form
    (mlp.experts.base_layer.lora_A/B: gate_up_proj, mlp.experts.lora_A/B: down_proj), which vLLM
    reads. A Qwen3-VL vision tower's adapters become model.visual.* modules (attn.qkv, ...).

    \b
    OUT_DIR/adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, bias none
    OUT_DIR/adapter_model.safetensors    base_model.model.<module>.lora_A.weight / lora_B.weight

    Loads with peft.PeftModel.from_pretrained and vLLM (one r and alpha for all modules;
    adapters with different ranks are refused).
    """
    ctx = click.get_current_context()
    for name, why in (("dtype", "an adapter keeps the dtype it was trained in"), ("max_shard_size", "an adapter is one file")):
        if not merge and ctx.get_parameter_source(name).name != "DEFAULT":
            fail(f"--{name.replace('_', '-')} applies only with --merge ({why})")
    fp8_scale_needs_quantize(quantize, fp8_scale)
    from mconv.converter.lora import export_lora

    started = time.perf_counter()
    result = run(lambda: export_lora(ckpt_dir, out_dir, hf_config=hf_config, rank=rank, alpha=alpha,
                                     base_model=base_model, merge_into=merge, dtype=dtype,
                                     overwrite=overwrite, max_shard_bytes=max_shard_size,
                                     revision=revision, progress=show_progress(quiet, as_json), quantize=quantize,
                                     fp8_scale=fp8_scale))
    adapter = result.adapter
    layout = result.layout.describe() if result.format == "torch" else "any layout"
    print_notes(result, quiet)
    if as_json:
        click.echo(json.dumps({
            "output": "merged model" if merge else "adapter", "arch": adapter.arch, "r": adapter.rank,
            "alpha": result.alpha, "target_modules": adapter.target_modules, "adapter_tensors": len(adapter.tensors),
            **({"merged_weights": result.merged_tensors} if merge else {}), "format": result.format,
            "layout": layout, "notes": result.notes, "seconds": round(time.perf_counter() - started, 3),
            "peak_rss_bytes": peak_rss()}))
        return
    if not quiet:
        what = (f"merged model ({result.merged_tensors} weights changed)" if merge else
                f"PEFT adapter ({len(adapter.tensors)} tensors, target_modules {', '.join(adapter.target_modules)})")
        click.echo(f"wrote {out_dir}: {what}; {adapter.arch}, r={adapter.rank}, alpha={result.alpha:g}, "
                   f"read from a {result.format} checkpoint at {layout}")


def entry(early: list[int] | None = None) -> None:
    """The mconv program (from `program.main`, or `python -m mconv.cli`): `main`, with SIGINT and
    SIGTERM taken by `_on_signal` from start to end (where they are at their defaults, or at
    `program`'s, which recorded in `early` the signals that came while this module was imported:
    the first of those stops the program as an interrupt of a command that has written nothing; a
    SIGINT a shell set to be ignored stays ignored). Called in-process (click's CliRunner), `main`
    leaves the caller's signal handlers as they were.

    The program ends with os._exit once `main` is done, its output streams flushed: the
    interpreter's finalization would put a Python signal handler back to the default (a SIGTERM
    then kills the process, status 143, after the output was complete) and can meet a thread that
    is still running (a thread woken then is ended in the middle of torch's C++ code: "terminate
    called without an active exception", status 134). Every worker thread has been joined by
    then (`parallel.run_ordered`, `torch_dist_write.write`)."""
    from mconv import program

    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for signum, default in defaults.items():
        if signal.getsignal(signum) in (default, program._record):
            signal.signal(signum, _on_signal)
    if early:
        os.write(2, f"mconv: {_stopped(early[0])} before it started; nothing was written\n".encode())
        os._exit(128 + early[0])
    try:
        main(prog_name="mconv")  # however started: `mconv` in usage lines, _MCONV_COMPLETE for shell completion
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: as Python's own exit reports it
            status = status or 120
    os._exit(status)

