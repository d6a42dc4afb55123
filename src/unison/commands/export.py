"""`unison export` (alias `merge-weights`, Accelerate's name): a checkpoint's model as a Hugging Face folder.

Reads a save_state checkpoint of any layout on one process, without the training script or a GPU, and
writes safetensors weights (sharded with an index past --max-shard-size) and, for a Hugging Face model,
its config.json: `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the result. A PEFT
model takes --merge-adapters (the base model, adapters merged) or --adapter-only (PEFT's adapter folder).
"""

from __future__ import annotations

import argparse
import sys


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "export",
        aliases=["merge-weights"],
        help="write a checkpoint's model as safetensors (+ config.json) for Hugging Face, from any layout",
        description="Write the model of a save_state checkpoint (plain, DDP, ZeRO, tensor or pipeline "
        "parallel: any number of processes) as one process would save it for Hugging Face: "
        "model.safetensors, or shards with model.safetensors.index.json past --max-shard-size, under the "
        "model's own parameter names, tied weights once, and config.json when the model had a Hugging "
        "Face config. Runs on one process, without the training script and without a GPU. Needs "
        "safetensors (pip install 'unison[safetensors]') unless --unsafe-serialization. A PEFT model "
        "(peft.PeftModel: LoRA and the other adapters) is refused without one of --merge-adapters and "
        "--adapter-only, since its tensors keep PEFT's names, which from_pretrained does not load; both "
        "rebuild it with peft and transformers (pip install peft transformers).",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint folder save_state wrote")
    parser.add_argument("output", metavar="OUT_DIR", help="the folder to write the model into")
    parser.add_argument(
        "--model",
        type=int,
        default=0,
        metavar="N",
        help="which prepared model, in prepare() order, when the run had several (default: 0)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="10GB",
        metavar="SIZE",
        help="weights in files of at most SIZE, e.g. 500MB or 5GiB (default: 10GB, as save_model)",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="cast the floating-point weights (default: keep the saved dtypes, fp32 for unison's weights)",
    )
    parser.add_argument(
        "--unsafe-serialization",
        "--unsafe_serialization",
        action="store_true",
        help="write pytorch_model.bin with torch.save instead of safetensors (Accelerate's flag)",
    )
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument(
        "--merge-adapters",
        action="store_true",
        help="a PEFT model: write its base model with the active adapters merged in, as PEFT's "
        "merge_and_unload() computes it, and the base model's config.json (from_pretrained loads it)",
    )
    adapters.add_argument(
        "--adapter-only",
        action="store_true",
        help="a PEFT model: write only its adapters, as PEFT's save_pretrained does (adapter_config.json + "
        "adapter_model.safetensors; an adapter not named 'default' in OUT_DIR/NAME), for "
        "PeftModel.from_pretrained(base_model, OUT_DIR)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError
    from ..checkpoint.export import export_checkpoint  # torch: only once the command runs

    try:
        result = export_checkpoint(
            args.checkpoint,
            args.output,
            model_index=args.model,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            safe_serialization=not args.unsafe_serialization,
            merge_adapters=args.merge_adapters,
            adapter_only=args.adapter_only,
        )
    except (CheckpointError, OSError, ValueError, ImportError) as error:
        sys.stderr.write(f"unison export: error: {error}\n")
        return 1
    if args.adapter_only:
        for name, folder in zip(result.adapters, result.adapter_folders):
            print(f"wrote adapter {name!r} in {folder}")
        print(f"{result.tensors} adapter tensors ({result.bytes / 1e6:.1f} MB)")
        return 0
    if result.adapters:
        print(f"merged adapter(s) {', '.join(map(repr, result.adapters))} into the base model")
    shared = result.names - result.tensors
    print(
        f"wrote {result.weights}: {result.tensors} tensors ({result.bytes / 1e6:.1f} MB)"
        + (f", {shared} tied name(s) stored once" if shared else "")
    )
    if result.config is not None:
        print(f"wrote {result.config}")
    return 0
