"""The combination matrix, precision x layout x {the loop's conditions}, in one launch per world size.

For each layout it is given and each precision (fp32, bf16, fp16), the ordinary loop
(prepare, accumulate 2, forward_backward, clip_grad_norm_, a rate that changes every step, a loader whose
last batch is short: 18 samples in global micro-batches of 4, so the 3rd window holds one batch of 2) runs
three times: on a model built normally, saving a checkpoint after optimizer step RESUME_AT; on the same
model built on the meta device (`init_empty_weights`); and fine-tuning it with PEFT's LoRA (the base
frozen, r=4 on every projection of its blocks), saving a checkpoint too. Each run's parameters are
compared with one process of plain torch in the same precision (autocast, and torch's GradScaler for
fp16), computed here, and with plain torch in fp32: what the half precision alone changes, the measure
the tolerance is taken from.

A construction or prepare() that refuses the combination is recorded (the message every rank got); an
error later, mid-training, is no refusal and ends the launch. `train_mode` runs in the launch of
tests/workers/layouts_worker.py; `resume` mode (`python matrix_worker.py resume REPORT CHECKPOINT_DIR...`,
one process, no launcher) loads each checkpoint the launches saved and trains to the end: a resume on
another world size. Process 0 writes REPORT.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import peft
import torch
import torch.nn.functional as F
from context_parallel_worker import TinySdpaModel
from tiny_gpt import make_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, AcceleratorState, DataLoaderConfiguration, PartialState, init_empty_weights
from unison.parallel.config import ParallelismConfig

SEED, BLOCK, VOCAB, SAMPLES, MICRO_BATCH, ACCUMULATION, MAX_NORM, RESUME_AT = 3, 16, 32, 18, 4, 2, 0.7, 1
PRECISIONS = ("no", "bf16", "fp16")
# 3 optimizer steps: 4 full batches of 4 in 2 windows, then one batch of 2; the resume after step 1 trains
# a whole window and the short one. Enough steps for the half precisions to move one process measurably
# (bf16 2e-4 .. 5e-4, fp16 3e-5 .. 6e-5 from fp32): test_combination_matrix.py's bound is that change.
# MAX_NORM: both models' gradient norms exceed it in some steps and not in others (GPT 1.05, 0.60, 0.85).


def family(layout: str) -> str:
    """Context parallelism needs the positions as an input it can shard: the SDPA model takes them."""
    return "sdpa" if "cp_size" in layout else "gpt"


LORA_TARGETS = {  # every projection of a block: split by columns (fused q|k|v too) and by rows under TP
    "gpt": ["c_attn", "c_proj", "c_fc"],
    "sdpa": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def make_model(model_family: str, lora: bool = False) -> torch.nn.Module:
    if model_family == "sdpa":
        torch.manual_seed(SEED)
        model = TinySdpaModel()
    else:
        model = make_tiny_gpt(SEED, BLOCK)
    if lora:
        targets = LORA_TARGETS[model_family]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    return model


def dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (SAMPLES, BLOCK + 1), generator=torch.Generator().manual_seed(11))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def optimizer_and_scheduler(params):
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.5, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)


def next_token_loss(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def model_inputs(model_family: str, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if model_family == "sdpa":
        return inputs, torch.arange(inputs.shape[1]).expand_as(inputs).clone()
    return (inputs,)


def batches(topped_up: bool) -> list[torch.Tensor]:
    """The loader's batches of sample indices. Under data parallelism the short last batch is topped up
    with the epoch's first samples (even_batches, Accelerate's default), so every rank gets its slice."""
    indices = torch.arange(SAMPLES)
    out = list(indices.split(MICRO_BATCH))
    if topped_up and len(out[-1]) < MICRO_BATCH:
        out[-1] = torch.cat([out[-1], indices[: MICRO_BATCH - len(out[-1])]])
    return out


@functools.cache
def reference(precision: str, model_family: str, topped_up: bool, lora: bool) -> dict[str, torch.Tensor]:
    """One process of plain torch: each window's batches in turn, their mean losses averaged over the
    batches the window really has (unison's convention for a window cut short by the loader)."""
    model = make_model(model_family, lora)
    optimizer, scheduler = optimizer_and_scheduler(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    inputs, targets = dataset().tensors
    every_batch = batches(topped_up)
    for window in range(0, len(every_batch), ACCUMULATION):
        in_window = every_batch[window : window + ACCUMULATION]
        for rows in in_window:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                output = model(*model_inputs(model_family, inputs[rows]))
            loss = next_token_loss(output, targets[rows]) / len(in_window)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if scaler:
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            stepped = scaler.get_scale() >= scale
        else:
            optimizer.step()
            stepped = True
        if stepped:  # a skipped fp16 step does not advance the schedule (unison's optimizer wrapper)
            scheduler.step()
        optimizer.zero_grad()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def new_accelerator(layout: str | None, precision: str) -> Accelerator:
    AcceleratorState._reset_state()  # one precision per Accelerator: a new one for each run
    return Accelerator(
        cpu=True,
        parallelism=layout,
        mixed_precision=precision,
        gradient_accumulation_steps=ACCUMULATION,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )


def prepared(accelerator: Accelerator, model_family: str, meta: bool, lora: bool = False):
    with init_empty_weights() if meta else contextlib.nullcontext():
        model = make_model(model_family, lora)
    optimizer, scheduler = optimizer_and_scheduler(model.parameters())
    loader = DataLoader(dataset(), batch_size=MICRO_BATCH)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train_loop(accelerator, model, optimizer, loader, scheduler, model_family, save_to=None) -> int:
    """The user's loop; returns the number of optimizer steps it took. `save_to`: save_state there after
    optimizer step RESUME_AT."""
    steps = 0
    for inputs, targets in loader:
        inputs = model_inputs(model_family, inputs)
        with accelerator.accumulate(model):
            with accelerator.maybe_context_parallel(
                buffers=[*inputs, targets], buffer_seq_dims=[1] * (len(inputs) + 1)
            ):
                accelerator.forward_backward(model, inputs, targets, next_token_loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            if save_to is not None and steps == RESUME_AT:
                accelerator.save_state(save_to)
    return steps


def max_difference(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((state[key].float() - expected[key]).abs().max().item() for key in expected)


def compared(accelerator, model, steps, expected) -> dict:
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return {}
    return {
        "steps": steps,
        "vs_same_precision": max_difference(state, expected["same"]),
        "vs_fp32": max_difference(state, expected["fp32"]),
        "noise": expected["noise"],  # what the precision alone changes this cell's reference
        "dtypes": sorted({str(t.dtype) for t in state.values()}),
    }


def refusal(accelerator_or_error: BaseException, state: PartialState) -> dict:
    """A refused combination: the message, and whether every rank refused it with the same one."""
    message = f"{type(accelerator_or_error).__name__}: {accelerator_or_error}"
    everyone = [None] * state.num_processes
    torch.distributed.all_gather_object(everyone, message) if state.num_processes > 1 else None
    return {"refused": message, "same_on_every_rank": all(m == message for m in everyone[1:])}


def run_cell(layout, precision, condition, expected, checkpoint, state) -> dict:
    print(f"cell {layout} {precision} {condition}", flush=True)  # where a crash happened
    model_family = family(layout)
    try:
        accelerator = new_accelerator(layout, precision)
        objects = prepared(accelerator, model_family, condition == "meta", condition == "lora")
    except (ValueError, TypeError, NotImplementedError) as error:
        return refusal(error, state)
    steps = train_loop(accelerator, *objects, model_family, save_to=checkpoint)
    return compared(accelerator, objects[0], steps, expected)


def references(kinds: set[tuple[str, bool, bool]]) -> dict:
    """For each (model family, topped-up last batch, LoRA) and precision: the one-process reference in
    that precision, the fp32 one, and their distance (what the half precision alone changes)."""
    out = {}
    for kind in kinds:
        fp32 = reference("no", *kind)
        for precision in PRECISIONS:
            same = fp32 if precision == "no" else reference(precision, *kind)
            out[(*kind, precision)] = {"same": same, "fp32": fp32, "noise": max_difference(same, fp32)}
    return out


def kind(layout: str | None, data_parallel: bool, lora: bool) -> tuple[str, bool, bool]:
    return family(layout or ""), data_parallel, lora


def data_parallel(layout: str, world_size: int) -> bool:
    return ParallelismConfig.from_string(layout).validate(world_size).dp_size > 1


def train_mode(report_path: Path, checkpoints: Path, layouts: list[str]) -> None:
    state = PartialState(cpu=True)
    kinds = {
        (layout, lora): kind(layout, data_parallel(layout, state.num_processes), lora)
        for layout in layouts
        for lora in (False, True)
    }
    # process 0 compares and writes the report: the others need no reference
    expected = references(set(kinds.values())) if state.is_main_process else {}
    report: dict = {}
    for layout in layouts:
        for precision in PRECISIONS:
            for condition in ("loop", "meta", "lora"):
                cell_expected = expected.get((*kinds[layout, condition == "lora"], precision))
                checkpoint = (
                    None
                    if condition == "meta"
                    else checkpoints / "@".join((layout, precision, str(state.num_processes), condition))
                )
                cell = run_cell(layout, precision, condition, cell_expected, checkpoint, state)
                report[f"{layout}/{precision}/{condition}"] = cell
    if state.is_main_process:
        report_path.write_text(json.dumps(report, indent=1))


def resume_mode(report_path: Path, checkpoints: list[Path]) -> None:
    """One process, `python matrix_worker.py resume ...`: each checkpoint loaded and trained to the end."""
    report = {}
    for checkpoint in checkpoints:
        layout, precision, _, condition = checkpoint.name.split("@")
        lora = condition == "lora"
        name = f"{layout}/{precision}/{'lora resume' if lora else 'resume'}"
        model_family = family(layout)
        accelerator = new_accelerator(None, precision)
        model, optimizer, loader, scheduler = prepared(accelerator, model_family, meta=False, lora=lora)
        try:
            accelerator.load_state(checkpoint)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
            report[name] = {"refused": f"{type(error).__name__}: {error}"}
            continue
        steps = train_loop(accelerator, model, optimizer, loader, scheduler, model_family)
        # one process reads the rest of the epoch itself: its short last batch is not topped up
        expected = references({kind(layout, False, lora)})[(*kind(layout, False, lora), precision)]
        report[name] = compared(accelerator, model, steps, expected)
    report_path.write_text(json.dumps(report, indent=1))


def main() -> None:
    mode, report_path = sys.argv[1], Path(sys.argv[2])
    assert mode == "resume", "train mode runs in tests/workers/layouts_worker.py's launch"
    resume_mode(report_path, [Path(p) for p in sys.argv[3:]])


if __name__ == "__main__":
    main()
