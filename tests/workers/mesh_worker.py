"""Launched by tests/test_parallel_config.py with 4 processes and --parallelism dp_replicate_size=2,tp_size=2.

Usage: mesh_worker.py OUT_DIR. Each rank records in OUT_DIR/rank{R}.json what the meshes and
Accelerators it built looked like; the test compares that with the layout it expects.
"""

import json
import sys
from pathlib import Path

import torch
from tiny_gpt import make_tiny_gpt

from unison import Accelerator
from unison.parallel.config import ParallelismConfig
from unison.parallel.mesh import data_parallel_mesh


def describe_mesh(mesh) -> dict:
    dp = data_parallel_mesh(mesh)
    return {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "coordinate": mesh.get_coordinate(),
        "groups": {
            name: torch.distributed.get_process_group_ranks(mesh.get_group(name))
            for name in mesh.mesh_dim_names
        },
        "dp_size": dp.size(),
        "dp_rank": dp.get_local_rank(),
    }


def main() -> None:
    """Inside a function, so every prepared model is freed before the interpreter's teardown: one left
    in a global can abort the process after its work is done (docs/failures.md)."""
    out_dir = Path(sys.argv[1])
    from_env = Accelerator()  # layout from UNISON_PARALLELISM (the --parallelism flag)
    record: dict = {
        "env_layout": from_env.parallelism.describe(),
        "env_mesh": describe_mesh(from_env.device_mesh),
        "ranks": [  # Accelerate's property names
            from_env.data_parallel_rank,
            from_env.data_parallel_shard_rank,
            from_env.tensor_parallel_rank,
            from_env.pipeline_parallel_rank,
            from_env.context_parallel_rank,
        ],
        "is_fsdp2": from_env.is_fsdp2,
        "same_mesh": from_env.torch_device_mesh is from_env.device_mesh,
    }

    zero3 = Accelerator(parallelism="zero3")
    record["zero3_mesh"] = describe_mesh(zero3.device_mesh)
    record["zero3_config"] = [zero3.parallelism.dp_shard_size, zero3.parallelism.zero_stage]
    record["zero3_wrapper"] = type(zero3.prepare(torch.nn.Linear(2, 2))).__name__

    hsdp = Accelerator(parallelism=ParallelismConfig(dp_shard_size=2, zero_stage=2))
    record["hsdp_mesh"] = describe_mesh(hsdp.device_mesh)

    ddp = Accelerator(parallelism="ddp")
    model = ddp.prepare(torch.nn.Linear(2, 2))
    record["ddp_wrapper"] = type(model).__name__
    record["ddp_mesh"] = describe_mesh(ddp.device_mesh)

    try:
        Accelerator(parallelism=ParallelismConfig(dp_shard_size=2, tp_size=3))
    except ValueError as error:
        record["mismatch_error"] = str(error)

    # parallelism="auto" with a model no layout fits (a trillion parameters, built on meta): process 0
    # plans and every process raises its refusal, before any memory is touched.
    with torch.device("meta"):
        huge = torch.nn.Sequential(*(torch.nn.Linear(2**15, 2**15) for _ in range(1000)))
    try:
        Accelerator(parallelism="auto").prepare(huge)
    except ValueError as error:
        record["auto_refusal"] = f"{type(error).__name__}: {error}"

    # parallelism="auto:..." with the run's batch: the layouts that fit, ranked by predicted step time
    timed = Accelerator(parallelism="auto:global_batch_size=8,seq_len=16")
    timed.prepare(make_tiny_gpt(0, 16))
    record["auto_timed"] = {
        "layout": timed.plan.config.describe(),
        "step_seconds": timed.plan.cost.step,
        "by_speed": any("the fastest of the" in reason for reason in timed.plan.reasons),
        "global_batch": timed.plan.cost.micro_batch_size
        * timed.plan.cost.micro_steps
        * timed.plan.config.dp_size,
    }

    (out_dir / f"rank{zero3.process_index}.json").write_text(json.dumps(record))
    ddp.end_training()


if __name__ == "__main__":
    main()
