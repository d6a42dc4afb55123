"""ParallelismConfig validation, the --parallelism / UNISON_PARALLELISM plumbing, and real DeviceMeshes."""

import copy
import json
import logging
import math

import pytest
import torch
from launching import WORKERS, launch_ok

from unison import Accelerator, DistributedType, env_vars
from unison.launching import launcher
from unison.launching import options as launch_options
from unison.launching.launcher import LaunchError, LaunchOptions
from unison.parallel.config import ParallelismConfig
from unison.parallel.mesh import mesh_layout

SIZES = ("pp_size", "dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "zero_stage")


@pytest.mark.parametrize(
    "config, world, expected",
    [
        # (pp, dp_replicate, dp_shard, tp, cp, zero_stage) after filling
        (ParallelismConfig(), 1, (1, 1, 1, 1, 1, None)),
        (ParallelismConfig(), 4, (1, 4, 1, 1, 1, None)),
        (ParallelismConfig(zero_stage=1), 4, (1, 1, 4, 1, 1, 1)),
        (ParallelismConfig(tp_size=2), 8, (1, 4, 1, 2, 1, None)),
        (ParallelismConfig(dp_shard_size=4), 4, (1, 1, 4, 1, 1, 3)),  # Accelerate: dp_shard means FSDP
        (ParallelismConfig(dp_shard_size=4, zero_stage=3), 8, (1, 2, 4, 1, 1, 3)),  # HSDP
        (
            ParallelismConfig(pp_size=2, tp_size=2, zero_stage=1),
            8,
            (2, 1, 2, 2, 1, 1),
        ),  # guide's ZeRO-1+PP+TP
        (ParallelismConfig(dp_replicate_size=2, tp_size=2, cp_size=1), 4, (1, 2, 1, 2, 1, None)),
    ],
)
def test_good_layouts_fill_the_world(config, world, expected):
    resolved = config.validate(world)
    assert tuple(getattr(resolved, name) for name in SIZES) == expected
    assert resolved.total_size == world
    assert resolved.validate(world) == resolved  # idempotent


@pytest.mark.parametrize(
    "config, world, messages",
    [
        (
            ParallelismConfig(dp_replicate_size=2, tp_size=3),
            4,
            [
                "pp_size=1 x dp_replicate_size=2 x dp_shard_size=1 x tp_size=3 x cp_size=1",
                "multiply to 6",
                "world size is 4",
                "launch 6 processes",
            ],
        ),
        (ParallelismConfig(tp_size=3), 4, ["tp_size=3", "multiply to 3", "world size is 4"]),
        (ParallelismConfig(tp_size=0), 4, ["tp_size=0 is not a degree", "whole number >= 1"]),
        (ParallelismConfig(pp_size=True), 4, ["pp_size=True is not a degree"]),
        (ParallelismConfig(dp_shard_size=2.0), 2, ["dp_shard_size=2.0 is not a degree"]),
        (ParallelismConfig(cp_size=2, pp_size=2), 4, ["cp_size=2 with pp_size=2", "not supported"]),
        (ParallelismConfig(cp_size=2, zero_stage=1), 4, ["cp_size=2 with zero_stage=1", "zero_stage=2 or 3"]),
        (ParallelismConfig(zero_stage=4), 2, ["zero_stage=4 is not a ZeRO stage"]),
        (ParallelismConfig(pp_size=2, pp_schedule="zb"), 2, ["pp_schedule='zb' is unknown", "'interleaved'"]),
        (ParallelismConfig(pp_size=2, pp_microbatches=0), 2, ["pp_microbatches=0 is not a count"]),
        (ParallelismConfig(pp_microbatches=4), 2, ["pp_microbatches=4 was given but pp_size=1"]),
        (ParallelismConfig(pp_schedule="gpipe"), 2, ["pp_schedule='gpipe' was given but pp_size=1"]),
        (
            ParallelismConfig(tp_plan={"fc": "colwise"}),
            2,
            ["tp_plan={'fc': 'colwise'} was given but tp_size=1"],
        ),
        (ParallelismConfig(tp_size=2, tp_plan=["fc"]), 2, ["tp_plan=['fc'] is not a plan"]),
        (ParallelismConfig(pp_size=2, pp_split_points="blocks.2"), 2, ["is not a list of module names"]),
        (
            ParallelismConfig(pp_size=2, pp_split_points=["a", "b"]),
            2,
            ["makes 3 stages", "give 1 split points"],
        ),
        (
            ParallelismConfig(pp_size=2, pp_schedule="interleaved", pp_split_points=["a"]),
            2,
            ["makes 2 stages", "at least 2 stages per rank", "give 3 split points"],
        ),
        (
            ParallelismConfig(tp_size=2, zero_stage=2, dp_shard_size=1),
            2,
            ["zero_stage=2 shards over the dp_shard", "dp_shard_size=1"],
        ),
        (ParallelismConfig(offload=True), 2, ["offload=true keeps ZeRO-2/3's shards", "dp_replicate=2"]),
        (ParallelismConfig(zero_stage=1, offload=True), 2, ["(ZeRO-1, offloaded)", "'zero3,offload=true'"]),
        (ParallelismConfig(zero_stage=3, tp_size=2, offload=True), 4, ["without tp_size or pp_size"]),
    ],
)
def test_bad_layouts_name_the_problem(config, world, messages):
    with pytest.raises(ValueError) as error:
        config.validate(world)
    for message in messages:
        assert message in str(error.value)


def test_interleaved_split_points_accept_two_stages_per_rank():
    config = ParallelismConfig(pp_size=2, pp_schedule="interleaved", pp_split_points=["a", "b", "c"])
    assert config.validate(2).pp_size == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ddp", ParallelismConfig()),
        (" DDP ", ParallelismConfig()),
        ("zero1", ParallelismConfig(zero_stage=1)),
        ("zero2", ParallelismConfig(zero_stage=2)),
        ("zero3", ParallelismConfig(zero_stage=3)),
        ("dp_shard_size=2,tp_size=2", ParallelismConfig(dp_shard_size=2, tp_size=2)),
        (
            "pp_size=2, pp_schedule=gpipe, pp_microbatches=4",
            ParallelismConfig(pp_size=2, pp_schedule="gpipe", pp_microbatches=4),
        ),
        ("zero3,offload=true", ParallelismConfig(zero_stage=3, offload=True)),
        ("zero2, dp_shard_size=2", ParallelismConfig(zero_stage=2, dp_shard_size=2)),
    ],
)
def test_from_string(text, expected):
    assert ParallelismConfig.from_string(text) == expected


def test_from_string_shorthands_fill_the_world():
    assert ParallelismConfig.from_string("ddp").validate(4).dp_replicate_size == 4
    zero2 = ParallelismConfig.from_string("zero2").validate(4)
    assert (zero2.dp_replicate_size, zero2.dp_shard_size, zero2.zero_stage) == (1, 4, 2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("auto", "parallelism='auto' is not a fixed layout: the Accelerator asks the planner"),
        ("fsdp", "parallelism='fsdp' is not understood: pass one of 'ddp', 'zero1'"),
        ("tp=2", "'tp=2' is not FIELD=VALUE with a known FIELD"),
        ("tp_size=two", "tp_size='two' is not a whole number"),
        ("tp_size=2,tp_size=2", "sets tp_size twice"),
    ],
)
def test_from_string_rejects(text, message):
    with pytest.raises(ValueError) as error:
        ParallelismConfig.from_string(text)
    assert message in str(error.value)


def test_legacy_data_parallel_is_opt_in_by_name_and_refused_without_two_gpus(fresh_state):
    config = ParallelismConfig.from_string("dataparallel")
    assert config == ParallelismConfig(legacy_data_parallel=True)
    assert config.validate(1).describe().startswith("torch.nn.DataParallel")
    with pytest.raises(ValueError, match=r"runs in ONE process .* on 2 processes"):
        config.validate(2)
    with pytest.raises(ValueError, match="needs at least 2 visible GPUs, but this process sees 0"):
        Accelerator(cpu=True, parallelism="dataparallel")


def test_coerce_rejects_other_types():
    with pytest.raises(TypeError, match="parallelism=3 is a int"):
        ParallelismConfig.coerce(3)


@pytest.mark.parametrize(
    "config, world, names, shape",
    [
        (ParallelismConfig(), 1, (), ()),
        (ParallelismConfig(), 4, ("dp_replicate",), (4,)),
        (ParallelismConfig(tp_size=2, pp_size=2, zero_stage=1), 8, ("pp", "dp_shard", "tp"), (2, 2, 2)),
        (ParallelismConfig(dp_shard_size=2), 4, ("dp_replicate", "dp_shard"), (2, 2)),
        (ParallelismConfig(cp_size=2, tp_size=2, dp_shard_size=2), 8, ("dp_shard", "cp", "tp"), (2, 2, 2)),
    ],
)
def test_mesh_layout_keeps_dims_above_one_in_torchtitan_order(config, world, names, shape):
    assert mesh_layout(config.validate(world)) == (names, shape)


def test_describe_and_plain_data_parallel():
    assert ParallelismConfig().validate(4).is_plain_data_parallel
    zero3 = ParallelismConfig.from_string("zero3").validate(4)
    assert not zero3.is_plain_data_parallel and zero3.describe() == "dp_shard=4 (ZeRO-3)"
    assert ParallelismConfig(tp_size=2).validate(4).describe() == "dp_replicate=2 x tp=2"


@pytest.mark.usefixtures("fresh_state")
def test_single_process_accelerator(monkeypatch):
    accelerator = Accelerator(cpu=True)
    assert accelerator.parallelism == ParallelismConfig().validate(1) and accelerator.device_mesh is None
    monkeypatch.setenv(env_vars.PARALLELISM, "tp_size=2")
    with pytest.raises(ValueError, match="multiply to 2, but the world size is 1"):
        Accelerator(cpu=True)
    assert Accelerator(cpu=True, parallelism="ddp").parallelism.dp_replicate_size == 1  # code wins over env


def test_launcher_exports_and_checks_parallelism(tmp_path):
    env = launcher.worker_environment(4, cpu=True, parallelism=" zero3 ")
    assert env[env_vars.PARALLELISM] == "zero3"
    assert env_vars.PARALLELISM not in launcher.worker_environment(4, cpu=True)
    script = tmp_path / "train.py"
    script.write_text("")
    assert (
        launcher.validate(LaunchOptions(str(script), nproc_per_node=4, cpu=True, parallelism="tp_size=2"))
        == 4
    )
    for parallelism, message in [
        ("tp_size=3", "--parallelism: the parallel degrees"),
        ("fsdp", "--parallelism: parallelism='fsdp' is not understood"),
    ]:
        with pytest.raises(LaunchError, match=message):
            launcher.validate(LaunchOptions(str(script), nproc_per_node=4, cpu=True, parallelism=parallelism))


def test_cli_flag_reaches_launch_options():
    from unison.commands.main import build_parser

    args = build_parser().parse_args(["launch", "--parallelism", "zero2", "x.py"])
    assert args.parallelism == "zero2"


def test_four_process_meshes(tmp_path):
    launch_ok(
        WORKERS / "mesh_worker.py",
        4,
        tmp_path,
        launch_args=["--parallelism", "dp_replicate_size=2,tp_size=2"],
    )
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    for rank, record in enumerate(records):
        # Row-major: rank = dp_replicate_index * 2 + tp_index.
        env_mesh = record["env_mesh"]
        assert record["env_layout"] == "dp_replicate=2 x tp=2"
        assert env_mesh["names"] == ["dp_replicate", "tp"] and env_mesh["shape"] == [2, 2]
        assert env_mesh["coordinate"] == [rank // 2, rank % 2]
        assert env_mesh["groups"] == {
            "dp_replicate": [rank % 2, rank % 2 + 2],
            "tp": [rank - rank % 2, rank - rank % 2 + 1],
        }
        assert (env_mesh["dp_size"], env_mesh["dp_rank"]) == (2, rank // 2)
        # dp_replicate, dp_shard, tp, pp, cp coordinates; replicas beside TP run on FSDP2
        assert record["ranks"] == [rank // 2, 0, rank % 2, 0, 0] and record["is_fsdp2"]
        assert record["same_mesh"]

        zero3 = record["zero3_mesh"]
        assert zero3["names"] == ["dp_shard"] and zero3["shape"] == [4] and zero3["coordinate"] == [rank]
        assert zero3["groups"] == {"dp_shard": [0, 1, 2, 3]} and (zero3["dp_size"], zero3["dp_rank"]) == (
            4,
            rank,
        )
        assert record["zero3_config"] == [4, 3]
        assert record["zero3_wrapper"] == "FSDPLinear"

        hsdp = record["hsdp_mesh"]
        assert hsdp["names"] == ["dp_replicate", "dp_shard"] and hsdp["coordinate"] == [rank // 2, rank % 2]
        assert (hsdp["dp_size"], hsdp["dp_rank"]) == (4, rank)  # the flattened "dp" view

        assert record["ddp_wrapper"] == "DistributedDataParallel"
        assert record["ddp_mesh"]["names"] == ["dp_replicate"] and record["ddp_mesh"]["shape"] == [4]
    timed = [record["auto_timed"] for record in records]
    assert all(entry == timed[0] for entry in timed), timed  # process 0's plan, on every rank
    assert timed[0]["by_speed"] and timed[0]["step_seconds"] > 0 and timed[0]["global_batch"] == 8
    refusals = {record["auto_refusal"] for record in records}
    assert len(refusals) == 1 and next(iter(refusals)).startswith("PlanError: "), refusals
    errors = {record["mismatch_error"] for record in records}
    assert len(errors) == 1  # the same message on every rank
    (error,) = errors
    assert "dp_shard_size=2 x tp_size=3" in error and "multiply to 6" in error and "world size is 4" in error


def test_auto_asks_the_planner_at_prepare_and_needs_the_model_first(fresh_state):
    accelerator = Accelerator(cpu=True, parallelism="auto")
    assert accelerator.parallelism is None and accelerator.plan is None  # nothing chosen before a model
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(ValueError, match="prepare the model first, or in the same call"):
        accelerator.prepare(loader)
    model = torch.nn.Linear(4, 4)
    prepared, prepared_loader = accelerator.prepare(model, loader)  # the model goes first within a call
    assert accelerator.parallelism.describe() == "single process" and prepared is model
    assert any("one device" in reason for reason in accelerator.plan.reasons), accelerator.plan.reasons
    assert len(list(prepared_loader)) == 2


def test_launch_accepts_auto_and_passes_it_to_the_workers():
    env = launcher.worker_environment(4, cpu=True, parallelism="Auto")
    assert env[env_vars.PARALLELISM] == "Auto"
    launch_options._validate_parallelism("auto", 4, 1, 1)  # no degrees to check before the planner runs
    launch_options._validate_parallelism("auto:global_batch_size=64,seq_len=1024", 4, 1, 1)
    with pytest.raises(launcher.LaunchError, match="'batch' is not a fact the planner takes"):
        launch_options._validate_parallelism("auto:batch=64", 4, 1, 1)


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("auto:global_batch_size=64", "give both"),
        ("auto:seq_len=64,micro_batch_size=2", "give both"),
        ("auto:global_batch_size=0,seq_len=4", "global_batch_size='0' is not a whole number >= 1"),
        ("auto:global_batch_size=x,seq_len=4", "global_batch_size='x' is not a whole number >= 1"),
        ("auto:steps=3", "'steps' is not a fact the planner takes"),
    ],
)
def test_auto_with_bad_run_facts_fails_at_construction(fresh_state, spec, reason):
    with pytest.raises(ValueError, match=reason):
        Accelerator(cpu=True, parallelism=spec)


def test_sequence_parallel_with_a_user_plan_is_refused():
    config = ParallelismConfig(tp_size=2, tp_plan={"mlp.fc": object()}, sequence_parallel=True)
    with pytest.raises(ValueError, match="put SequenceParallel\\(\\) entries into tp_plan"):
        config.validate(2)
    with pytest.raises(ValueError, match="sequence_parallel=True was given but tp_size=1"):
        ParallelismConfig(sequence_parallel=True).validate(2)


def test_zero_blocks_needs_a_sharding_stage():
    assert (
        ParallelismConfig(zero_stage=3, zero_blocks="transformer.h").validate(2).zero_blocks
        == "transformer.h"
    )
    with pytest.raises(ValueError, match="zero_blocks='transformer.h' names the block list"):
        ParallelismConfig(zero_blocks="transformer.h").validate(2)  # plain DDP shards nothing


@pytest.mark.parametrize("spec", ["zero1", "zero2", "zero3"])
def test_a_zero_stage_on_one_process_runs_unsharded_and_says_so(spec):
    """The same script runs as `python train.py`: ZeRO over one process is plain training (with
    offload=true it is not: tests/test_offload_one_process.py)."""
    asked = ParallelismConfig.from_string(spec)
    resolved = asked.validate(1)
    assert (resolved.zero_stage, resolved.offload, resolved.zero_blocks, resolved.total_size) == (
        None,
        False,
        None,
        1,
    )
    assert resolved.describe() == "single process"
    note = asked.unsharded_note(1)
    assert note.startswith(f"zero_stage={asked.zero_stage}") and "on 1 process as single process" in note
    assert asked.unsharded_note(2) is None  # two processes shard
    assert ParallelismConfig().unsharded_note(1) is None
    assert ParallelismConfig(zero_stage=2, zero_blocks="h").validate(1).zero_blocks is None


def test_zero_with_tensor_parallel_on_the_tp_processes_alone_runs_tensor_parallel():
    asked = ParallelismConfig(zero_stage=3, tp_size=2)
    resolved = asked.validate(2)
    assert (resolved.tp_size, resolved.dp_shard_size, resolved.zero_stage) == (2, 1, None)
    assert "as tp=2" in asked.unsharded_note(2)
    assert asked.validate(4).zero_stage == 3  # a second dp rank: sharded again
    with pytest.raises(ValueError, match="multiply to 2, but the world size is 1"):
        asked.validate(1)  # tp_size=2 names more processes than exist: still refused


def test_single_process_accelerator_with_zero3_trains_as_plain_torch(fresh_state, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    batch = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="unison"):
        accelerator = Accelerator(cpu=True, parallelism="zero3")
    assert [r.getMessage() for r in caplog.records if "zero_stage=3" in r.getMessage()] == [
        ParallelismConfig(zero_stage=3).unsharded_note(1)
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert accelerator.distributed_type == DistributedType.NO and type(model) is torch.nn.Sequential
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for net, opt, backward in (
            (model, optimizer, accelerator.backward),
            (reference, reference_optimizer, None),
        ):
            loss = net(batch).square().mean()
            backward(loss) if backward else loss.backward()
            opt.step()
            opt.zero_grad()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ddp", "ddp"),
        ("zero3", "zero3"),
        ("dataparallel", "dataparallel"),
        ("zero3,offload=true", "zero_stage=3,offload=true"),
        ("tp_size=2,dp_shard_size=2", "dp_shard_size=2,tp_size=2"),
        ("pp_size=2,pp_schedule=gpipe,pp_microbatches=4", "pp_size=2,pp_schedule=gpipe,pp_microbatches=4"),
        ("tp_size=2,sequence_parallel=true", "tp_size=2,sequence_parallel=true"),
        ("ep_size=2,activation_checkpointing=full", "ep_size=2,activation_checkpointing=full"),
    ],
)
def test_a_config_gives_the_string_that_reads_back_as_its_layout(text, expected):
    """What `unison plan` prints to paste after --parallelism; a validated config's degrees of 1 left out."""
    config = ParallelismConfig.from_string(text)
    assert config.to_string() == expected
    assert ParallelismConfig.from_string(expected) == config
    if config.legacy_data_parallel:  # one process over every GPU: no world size to validate against
        return
    degrees = (config.dp_shard_size, config.tp_size, config.pp_size, config.ep_size)
    world = math.prod(degree or 1 for degree in degrees)
    validated = config.validate(world)
    assert ParallelismConfig.from_string(validated.to_string()).validate(world) == validated
