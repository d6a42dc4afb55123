"""Accelerate's FullyShardedDataParallelPlugin / DeepSpeedPlugin, in code and as `unison launch` flags.

Each plugin is read into the ParallelismConfig it names (plus precision and accumulation); what unison
cannot carry out is refused by name. Launched at 2 and 3 processes, each plugin's run equals a
one-process reference (tests/workers/plugin_worker.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from launching import WORKERS, launch_ok
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy

from unison import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin, ParallelismConfig, env_vars
from unison.commands.launch import options_from_args
from unison.commands.main import build_parser
from unison.launching.launcher import LaunchError, validate
from unison.plugins import plugin_layout, read_plugin, resolve_plugins

WORKER = WORKERS / "plugin_worker.py"


def fsdp(**fields) -> tuple[ParallelismConfig, str | None]:
    asked = plugin_layout(FullyShardedDataParallelPlugin(**fields), None, None, 4, 2)
    return asked.parallelism, asked.mixed_precision


def deepspeed(**fields):
    return plugin_layout(None, DeepSpeedPlugin(**fields), None, 4, 2)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, ParallelismConfig(zero_stage=3)),  # FULL_SHARD, Accelerate's default
        ({"sharding_strategy": "FULL_SHARD"}, ParallelismConfig(zero_stage=3)),
        ({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, ParallelismConfig(zero_stage=2)),
        ({"sharding_strategy": 3}, ParallelismConfig()),  # NO_SHARD: DDP
        ({"sharding_strategy": "HYBRID_SHARD"}, ParallelismConfig(zero_stage=3, dp_shard_size=2)),
        ({"sharding_strategy": 5}, ParallelismConfig(zero_stage=2, dp_shard_size=2)),
        ({"fsdp_version": 2, "reshard_after_forward": False}, ParallelismConfig(zero_stage=2)),
        ({"reshard_after_forward": "true"}, ParallelismConfig(zero_stage=3)),
        ({"reshard_after_forward": "NO_RESHARD"}, ParallelismConfig(zero_stage=2)),
        (
            {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_cls_names_to_wrap": "Block, MLP"},
            ParallelismConfig(zero_stage=3, zero_blocks="Block,MLP"),
        ),
        (  # tuning options of FSDP1 and both state dict types: accepted, nothing to do
            {
                "limit_all_gathers": False,
                "forward_prefetch": True,
                "backward_prefetch": "BACKWARD_PRE",
                "use_orig_params": True,
                "sync_module_states": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
            ParallelismConfig(zero_stage=3),
        ),
    ],
)
def test_fsdp_plugin_maps_onto_a_layout(fields, expected):
    layout, _ = fsdp(**fields)
    assert layout == expected
    layout.validate(4)  # a layout of 4 processes, 2 per node


@pytest.mark.parametrize(
    ("policy", "precision"),
    [
        (None, None),
        ("bf16", "bf16"),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "bf16"),
        ({"param_dtype": "float16"}, "fp16"),
        (MixedPrecisionPolicy(), "no"),
    ],
)
def test_fsdp_mixed_precision_policy_sets_the_accelerators_precision(policy, precision):
    assert fsdp(mixed_precision_policy=policy)[1] == precision


def test_fsdp_activation_checkpointing_is_full_checkpointing_of_the_blocks():
    assert fsdp(activation_checkpointing=True)[0].activation_checkpointing == "full"
    assert fsdp(activation_checkpointing=False)[0].activation_checkpointing is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cpu_offload": True}, "FullyShardedDataParallelPlugin(cpu_offload=True): unison does not support"),
        ({"cpu_ram_efficient_loading": True}, "(cpu_ram_efficient_loading=True)"),
        ({"param_init_fn": print}, "(param_init_fn=<built-in function print>)"),
        ({"ignored_modules": ["head"]}, "(ignored_modules=['head'])"),
        ({"use_orig_params": False}, "(use_orig_params=False)"),
        ({"min_num_params": 1000}, "(min_num_params=1000): unison does not support"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "(auto_wrap_policy='SIZE_BASED_WRAP')"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "(state_dict_type='LOCAL_STATE_DICT')"),
        ({"mixed_precision_policy": "fp8"}, "(mixed_precision_policy='fp8')"),
        ({"sharding_strategy": 7}, "Accelerate numbers the strategies 1-5"),
        ({"sharding_strategy": "SHARD_EVERYTHING"}, "is not a sharding strategy: choose one of FULL_SHARD"),
        ({"fsdp_version": 3}, "(fsdp_version=3): give 1 or 2"),
        (
            {"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False},
            "ask for different sharding (stage 3 vs 2)",
        ),
        (
            {
                "sharding_strategy": "NO_SHARD",
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_cls_names_to_wrap": ["Block"],
            },
            "NO_SHARD shards nothing",
        ),
    ],
)
def test_fsdp_options_unison_cannot_honour_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fsdp(**fields)


def test_deepspeed_plugin_and_config_map_stage_precision_and_accumulation(tmp_path):
    assert deepspeed().parallelism == ParallelismConfig(zero_stage=2)  # Accelerate's default stage
    assert deepspeed(zero_stage=0).parallelism == ParallelismConfig()
    assert deepspeed(zero_stage=1, gradient_accumulation_steps=4).gradient_accumulation_steps == 4
    config = {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
        "bf16": {"enabled": True},
        "fp16": {"enabled": "auto"},
        "gradient_accumulation_steps": 8,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": "auto",
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for source in (config, str(path)):
        asked = deepspeed(hf_ds_config=source)
        assert asked.parallelism == ParallelismConfig(zero_stage=3)
        assert (asked.mixed_precision, asked.gradient_accumulation_steps) == ("bf16", 8)
    assert deepspeed(hf_ds_config={"zero_optimization": {"stage": "auto"}}, zero_stage=1).parallelism == (
        ParallelismConfig(zero_stage=1)
    )


def test_deepspeed_plugin_exposes_its_config_as_accelerates_does(tmp_path):
    """transformers' no_trainer scripts pick their optimizer by `"optimizer" in plugin.deepspeed_config`:
    the config given (file or dict), else the one Accelerate builds from the fields."""
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for source in (config, str(path)):
        exposed = DeepSpeedPlugin(hf_ds_config=source).deepspeed_config
        assert exposed == config and "optimizer" not in exposed
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0)
    built = plugin.deepspeed_config
    assert built["zero_optimization"]["stage"] == 3 and built["gradient_accumulation_steps"] == 2
    assert built["gradient_clipping"] == 1.0 and built["train_micro_batch_size_per_gpu"] == "auto"
    assert DeepSpeedPlugin().deepspeed_config["zero_optimization"]["stage"] == 2  # Accelerate's default
    assert "optimizer" not in DeepSpeedPlugin().deepspeed_config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"offload_optimizer_device": "cpu"}, "DeepSpeedPlugin(offload_optimizer_device='cpu'): unison does"),
        ({"offload_param_device": "nvme"}, "(offload_param_device='nvme')"),
        ({"zero3_init_flag": True}, "(zero3_init_flag=True)"),
        ({"gradient_clipping": 1.0}, "(gradient_clipping=1.0)"),
        ({"zero_stage": 4}, "ZeRO stage 4 does not exist"),
        ({"zero_stage": 2, "hf_ds_config": {"zero_optimization": {"stage": 3}}}, "stage=3 disagree"),
        (
            {"gradient_accumulation_steps": 2, "hf_ds_config": {"gradient_accumulation_steps": 4}},
            "gradient_accumulation_steps=4 disagree",
        ),
        ({"hf_ds_config": {"optimizer": {"type": "AdamW"}}}, "the config's sections ['optimizer']"),
        (
            {"hf_ds_config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}},
            "(zero_optimization.offload_optimizer.device='cpu')",
        ),
        ({"hf_ds_config": {"zero_optimization": {"stage": 2, "mics_shard_size": 4}}}, "['mics_shard_size']"),
        ({"hf_ds_config": {"train_batch_size": 64}}, "(hf_ds_config['train_batch_size']=64)"),
        ({"hf_ds_config": {"bf16": {"enabled": True}, "fp16": {"enabled": True}}}, "both fp16 and bf16"),
        ({"hf_ds_config": "no/such/ds_config.json"}, "hf_ds_config='no/such/ds_config.json'): no such file"),
    ],
)
def test_deepspeed_options_unison_cannot_honour_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        deepspeed(**fields)


def test_one_process_has_nothing_to_shard_but_keeps_checks_and_precision():
    asked = plugin_layout(FullyShardedDataParallelPlugin(mixed_precision_policy="bf16"), None, None, 1, 1)
    assert (asked.parallelism, asked.mixed_precision) == (ParallelismConfig(), "bf16")
    with pytest.raises(ValueError, match="cpu_offload"):
        plugin_layout(FullyShardedDataParallelPlugin(cpu_offload=True), None, None, 1, 1)


@pytest.mark.usefixtures("fresh_state")
def test_accelerator_arguments_and_plugins_must_agree(monkeypatch):
    both = (FullyShardedDataParallelPlugin(), DeepSpeedPlugin(), None)
    with pytest.raises(ValueError, match="both fsdp_plugin and deepspeed_plugin"):
        resolve_plugins(both, None, None, None)
    with pytest.raises(ValueError, match="deepspeed_plugins=...\\): several DeepSpeed configurations"):
        resolve_plugins((None, None, {"a": DeepSpeedPlugin()}), None, None, None)
    with pytest.raises(ValueError, match="parallelism='zero2' and a FSDP plugin"):
        resolve_plugins((FullyShardedDataParallelPlugin(), None, None), "zero2", None, None)
    disagree = re.escape("mixed_precision='fp16') and its plugin's mixed_precision ('bf16') disagree")
    with pytest.raises(ValueError, match=disagree):
        Accelerator(
            cpu=True,
            mixed_precision="fp16",
            fsdp_plugin=FullyShardedDataParallelPlugin(mixed_precision_policy="bf16"),
        )
    with pytest.raises(TypeError, match="use unison's FullyShardedDataParallelPlugin"):
        Accelerator(cpu=True, fsdp_plugin=object())
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    for name, value in torchrun.items():  # what the launcher tells a worker: the plugin's layout
        monkeypatch.setenv(name, value)
    plugin = DeepSpeedPlugin(hf_ds_config={"gradient_accumulation_steps": 4})
    assert resolve_plugins((None, plugin, None), None, "bf16", 4) == (
        ParallelismConfig(zero_stage=2),
        "bf16",
        4,
        plugin,
    )
    monkeypatch.setenv(env_vars.PLUGIN, '{"fsdp": {"sharding_strategy": "HYBRID_SHARD"}}')
    assert resolve_plugins((None, None, None), None, None, None)[0] == ParallelismConfig(
        zero_stage=3, dp_shard_size=2
    )
    assert resolve_plugins((None, None, None), "ddp", None, None)[0] == "ddp"  # code beats the launcher
    for name in torchrun:  # srun's variables instead of torchrun's
        monkeypatch.delenv(name)
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2"}
    slurm["SLURM_STEP_ID"] = "0"  # a task of an srun step (the batch script has none: one process)
    for name, value in {**slurm, "SLURM_NODELIST": "n1", "SLURM_JOB_ID": "1"}.items():
        monkeypatch.setenv(name, value)
    assert resolve_plugins((None, None, None), None, None, None)[0] == ParallelismConfig(
        zero_stage=3, dp_shard_size=2
    )
    monkeypatch.setenv(env_vars.PLUGIN, '{"megatron": {}}')
    with pytest.raises(ValueError, match="UNISON_PLUGIN=.* is not a plugin as `unison launch` writes it"):
        resolve_plugins((None, None, None), None, None, None)


def launch_options(*flags: str):
    return options_from_args(build_parser().parse_args(["launch", *flags, str(WORKER)]))


def test_accelerate_launch_flags_build_the_plugin_the_workers_read():
    options = launch_options(
        "--nproc-per-node", "2", "--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
        "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block",
        "--fsdp_sync_module_states", "true",
    )  # fmt: skip
    plugin = read_plugin(options.plugin)
    assert plugin == FullyShardedDataParallelPlugin(
        sharding_strategy="SHARD_GRAD_OP",
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap="Block",
        sync_module_states=True,
    )
    assert validate(options) == 2
    deepspeed_options = launch_options(
        "--use_deepspeed", "--zero_stage", "1", "--gradient_accumulation_steps", "3"
    )
    assert read_plugin(deepspeed_options.plugin) == DeepSpeedPlugin(
        zero_stage=1, gradient_accumulation_steps=3
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--use_fsdp", "--use_deepspeed"], "--use_fsdp and --use_deepspeed name two layouts"),
        (["--zero_stage", "3"], "--zero_stage without --use_deepspeed"),
        (["--use_deepspeed", "--fsdp_version", "2"], "--fsdp_version without --use_fsdp"),
        (["--use_fsdp", "--parallelism", "zero3"], "--parallelism zero3 and --use_fsdp both name the layout"),
        (
            ["--use_fsdp", "--fsdp_offload_params", "maybe"],
            "--fsdp_offload_params 'maybe' is not true or false",
        ),
    ],
)
def test_launch_flags_that_contradict_are_refused_before_any_worker(flags, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        launch_options(*flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--use_fsdp", "--fsdp_offload_params", "true"], "FullyShardedDataParallelPlugin(cpu_offload=True)"),
        (["--use_deepspeed", "--offload_optimizer_device", "cpu"], "(offload_optimizer_device='cpu')"),
        (["--nproc-per-node", "3", "--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD"], 3),
        (["--nproc-per-node", "1", "--use_fsdp"], 1),  # one process: nothing to shard, as in code
    ],
)
def test_launch_checks_the_plugin_against_the_processes_before_any_worker(flags, message):
    options = launch_options(*flags)
    if isinstance(message, int):
        assert validate(options) == message  # one node of 3: HYBRID_SHARD shards over the node's 3
        return
    with pytest.raises(LaunchError, match=re.escape(message)):
        validate(options)


@pytest.mark.parametrize(
    ("mode", "nproc", "launch_args", "layout", "blocks"),
    [
        ("fsdp", 2, (), "dp_shard=2 (ZeRO-3)", "Block"),
        ("deepspeed", 3, (), "dp_shard=3 (ZeRO-2)", None),
        (
            "launcher",
            2,
            (
                "--use_fsdp",
                "--fsdp_reshard_after_forward",
                "false",
                "--fsdp_auto_wrap_policy",
                "TRANSFORMER_BASED_WRAP",
                "--fsdp_transformer_layer_cls_to_wrap",
                "Block",
                "--gradient_accumulation_steps",
                "2",
            ),
            "dp_shard=2 (ZeRO-2)",
            "Block",
        ),  # fmt: skip
    ],
)
def test_a_plugins_run_equals_the_one_process_reference(tmp_path, mode, nproc, launch_args, layout, blocks):
    out = tmp_path / "record.json"
    launch_ok(WORKER, nproc, out, mode, launch_args=launch_args)
    record = json.loads(out.read_text())
    assert (record["layout"], record["zero_blocks"], record["accumulation"]) == (layout, blocks, 2)
    assert record["dtensor_params"] and record["sharded_blocks"] == 2  # FSDP2 shards, one unit per Block
    assert record["optimizer_steps"] == 3 and record["max_difference"] < 1e-6, record


@pytest.mark.usefixtures("fresh_state")
def test_the_state_shows_the_plugin_in_use_as_accelerates_does(monkeypatch):
    """transformers' *_no_trainer scripts read accelerator.state.deepspeed_plugin: None without one."""
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    assert [state.fsdp_plugin, state.deepspeed_plugin, state.megatron_lm_plugin] == [None] * 3
    assert accelerator.deepspeed_plugin is None
    plugin = DeepSpeedPlugin(zero_stage=2)
    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin)
    assert accelerator.deepspeed_plugin is plugin and accelerator.state.deepspeed_plugin is plugin
    assert accelerator.state.fsdp_plugin is None
    monkeypatch.setenv(env_vars.PLUGIN, '{"fsdp": {"sharding_strategy": "FULL_SHARD"}}')  # --use_fsdp
    accelerator = Accelerator(cpu=True)
    assert isinstance(accelerator.state.fsdp_plugin, FullyShardedDataParallelPlugin)
    assert accelerator.state.deepspeed_plugin is None
