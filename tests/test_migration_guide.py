"""docs/migrating-from-accelerate.md tells the truth about the code.

Every table row names Accelerate 1.15 names (first column) and a verdict (second column): rows marked
`same` or `different` must exist in unison where the table says (Accelerator members, constructor
arguments, state members, `unison` / `unison.utils` names, `unison launch` flags); rows marked
`not applicable` or `not yet` must not, so the page is corrected when someone adds one, except the
names of Accelerate's modules (`accelerate`, `accelerate.utils`, ...): those import anyway, as stand-ins
that raise the row's note when used (unison/accelerate_surface/names.py holds the same notes). Every public
name of unison's Accelerator, `unison` and `unison.utils` must appear on the page, and every name of
the Accelerate 1.15 inventory (generated: unison/accelerate_surface/inventory.py; frozen below for the
Accelerator, the state classes and the launch flags) must have a row, so neither side can drift
silently. The page's Python examples run as written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import runpy

import pytest
import torch
from launching import REPO_ROOT

import unison
import unison.utils
from unison import Accelerator, GradientState, PartialState, env_vars
from unison.accelerate_surface.inventory import ACCELERATE_VERSION, PUBLIC_NAMES
from unison.accelerate_surface.names import NOTE_OF, NotInUnisonError, accelerate_names, is_stand_in
from unison.commands.main import build_parser

PAGE = REPO_ROOT / "docs" / "migrating-from-accelerate.md"
VERDICTS = ("same", "different", "not applicable", "not yet")
PROVIDED = ("same", "different")

# -- Accelerate 1.15's surface, frozen from the wheel (accelerate-1.15.0-py3-none-any.whl) ----------------
# Accelerator: its public methods and properties, then the public attributes its __init__ sets.
ACCELERATE_ACCELERATOR_MEMBERS = """
    deepspeed_plugin use_distributed multi_device distributed_type num_processes process_index
    local_process_index device split_batches dispatch_batches even_batches use_seedable_sampler
    non_blocking use_stateful_dataloader project_dir logging_dir save_iteration is_main_process
    is_local_main_process is_last_process mixed_precision is_fsdp2 is_composable_parallelism_enabled
    parallelism_config torch_device_mesh should_save_model tensor_parallel_rank
    pipeline_parallel_rank context_parallel_rank data_parallel_rank data_parallel_shard_rank
    split_between_processes on_main_process on_local_main_process on_last_process on_process
    on_local_process main_process_first local_main_process_first no_sync trigger_sync_in_backward
    sync_gradients gradient_accumulation_steps accumulate join_uneven_inputs print prepare
    prepare_model deepspeed_ulysses_dl_adapter prepare_data_loader prepare_optimizer
    prepare_scheduler backward set_trigger check_trigger unscale_gradients clip_grad_norm_
    clip_grad_value_ gather gather_for_metrics reduce pad_across_processes unwrap_model
    wait_for_everyone init_trackers get_tracker log end_training save save_model
    register_save_state_pre_hook save_state register_load_state_pre_hook load_state free_memory
    clear get_state_dict register_for_checkpointing maybe_context_parallel autocast profile
    optimizer_step_was_skipped skip_first_batches verify_device_map lomo_backward fp8_backend
""".split()
ACCELERATE_ACCELERATOR_ATTRIBUTES = """
    ao_recipe_handler autocast_handler dataloader_config ddp_handler deepspeed_engine_wrapped
    delayed_fp8_autocast device_placement flag_tensor fp8_enabled fp8_recipe_handler gradient_state
    has_fp8_handler has_lomo_optimizer init_handler log_with msamp_recipe_handler native_amp
    profile_handler project_configuration rng_types scaler scaler_handler state step
    step_scheduler_with_optimizer te_recipe_handler trackers
""".split()
ACCELERATE_ACCELERATOR_ARGUMENTS = """
    device_placement split_batches mixed_precision gradient_accumulation_steps cpu dataloader_config
    deepspeed_plugin fsdp_plugin torch_tp_plugin megatron_lm_plugin rng_types log_with project_dir
    project_config gradient_accumulation_plugin step_scheduler_with_optimizer kwargs_handlers
    dynamo_backend dynamo_plugin deepspeed_plugins parallelism_config
""".split()
ACCELERATE_STATE_MEMBERS = {
    "PartialState": """
        initialized use_distributed is_last_process is_main_process is_local_main_process
        wait_for_everyone split_between_processes main_process_first local_main_process_first
        on_main_process on_local_main_process on_last_process on_process on_local_process print
        default_device set_device destroy_process_group backend debug device distributed_type
        fork_launched local_process_index num_processes process_index
    """.split(),
    # its own members (the PartialState ones it forwards are covered by the row that says so)
    "AcceleratorState": """
        initialized mixed_precision distributed_type is_fsdp2 deepspeed_plugin get_deepspeed_plugin
        select_deepspeed_plugin deepspeed_plugins device_mesh downcast_bfloat dynamo_plugin fsdp_plugin
        megatron_lm_plugin parallelism_config torch_tp_plugin
    """.split(),
    "GradientState": """
        num_steps adjust_scheduler sync_with_dataloader initialized end_of_dataloader remainder
        is_xla_gradients_synced active_dataloader dataloader_references in_dataloader plugin_kwargs
        sync_gradients
    """.split(),
}
# Accelerate's module-level names: generated from the package (scripts/accelerate_public_names.py); the
# top level also has `__version__` and the module `rich`, which the inventory's rule leaves out.
ACCELERATE_UTILS = accelerate_names("unison.utils")
ACCELERATE_TOP_LEVEL = [*accelerate_names("unison"), "__version__", "rich"]
ACCELERATE_OTHER_MODULES = {
    module: accelerate_names("unison" + module.removeprefix("accelerate"))
    for module in PUBLIC_NAMES
    if module not in ("accelerate", "accelerate.utils")
}
ACCELERATE_LAUNCH_FLAGS = """
    --config_file --quiet -q --cpu --multi_gpu --tpu --mixed_precision --num_processes
    --num_machines --num_cpu_threads_per_process --enable_cpu_affinity --dynamo_backend
    --dynamo_mode --dynamo_use_fullgraph --dynamo_use_dynamic --dynamo_use_regional_compilation
    --use_deepspeed --use_fsdp --use_parallelism_config --use_megatron_lm --gpu_ids --same_network
    --machine_rank --main_process_ip --main_process_port -t --tee --log_dir --role --rdzv_backend
    --rdzv_conf --max_restarts --monitor_interval -m --module --no_python --tpu_cluster
    --no_tpu_cluster --tpu_use_sudo --vm --env --main_training_function --downcast_bf16
    --deepspeed_config_file --zero_stage --offload_optimizer_device --offload_param_device
    --offload_optimizer_nvme_path --offload_param_nvme_path --gradient_accumulation_steps
    --gradient_clipping --zero3_init_flag --zero3_save_16bit_model --deepspeed_hostfile
    --deepspeed_exclusion_filter --deepspeed_inclusion_filter --deepspeed_multinode_launcher
    --deepspeed_moe_layer_cls_names --fsdp_version --fsdp_offload_params --fsdp_min_num_params
    --fsdp_sharding_strategy --fsdp_reshard_after_forward --fsdp_auto_wrap_policy
    --fsdp_transformer_layer_cls_to_wrap --fsdp_backward_prefetch --fsdp_state_dict_type
    --fsdp_forward_prefetch --fsdp_use_orig_params --fsdp_cpu_ram_efficient_loading
    --fsdp_sync_module_states --fsdp_activation_checkpointing
    --fsdp_activation_checkpointing_offload --megatron_lm_tp_degree --megatron_lm_use_custom_fsdp
    --megatron_lm_no_load_optim --megatron_lm_eod_mask_loss
    --megatron_lm_overlap_cpu_optimizer_d2h_h2d --megatron_lm_no_save_optim
    --megatron_lm_optimizer_cpu_offload --megatron_lm_use_precision_aware_optimizer
    --megatron_lm_decoder_last_pipeline_num_layers --megatron_lm_pp_degree
    --megatron_lm_num_micro_batches --megatron_lm_sequence_parallelism
    --megatron_lm_recompute_activations --megatron_lm_use_distributed_optimizer
    --megatron_lm_gradient_clipping --megatron_lm_recompute_granularity
    --megatron_lm_recompute_method --megatron_lm_recompute_num_layers
    --megatron_lm_attention_backend --megatron_lm_expert_model_parallel_size
    --megatron_lm_context_parallel_size --megatron_lm_attention_dropout --megatron_lm_hidden_dropout
    --megatron_lm_attention_softmax_in_fp32 --megatron_lm_expert_tensor_parallel_size
    --megatron_lm_calculate_per_token_loss --megatron_lm_use_rotary_position_embeddings
    --fp8_backend --fp8_use_autocast_during_eval --fp8_margin --fp8_interval --fp8_format
    --fp8_amax_history_len --fp8_amax_compute_algo --fp8_override_linear_precision --fp8_opt_level
    --fp8_enable_fsdp_float8_all_gather --fp8_pad_inner_dim --aws_access_key_id
    --aws_secret_access_key --debug --mpirun_hostfile --parallelism_config_dp_replicate_size
    --parallelism_config_dp_shard_size --parallelism_config_tp_size --parallelism_config_cp_size
    --parallelism_config_cp_backend --parallelism_config_cp_comm_strategy
    --parallelism_config_sp_size --parallelism_config_sp_backend --parallelism_config_sp_seq_length
    --parallelism_config_sp_seq_length_is_variable --parallelism_config_sp_attn_implementation
""".split()
# The fields of the configuration objects a `same` row promises (Accelerate 1.15's dataclass fields).
ACCELERATE_FIELDS = {
    "DataLoaderConfiguration": "split_batches dispatch_batches even_batches use_seedable_sampler data_seed "
    "non_blocking use_stateful_dataloader",
    "GradientAccumulationPlugin": "num_steps adjust_scheduler sync_with_dataloader sync_each_batch",
    "ProjectConfiguration": "project_dir logging_dir automatic_checkpoint_naming total_limit iteration "
    "save_on_each_node",
    "DistributedDataParallelKwargs": "dim broadcast_buffers bucket_cap_mb find_unused_parameters "
    "check_reduction gradient_as_bucket_view static_graph comm_hook comm_wrapper comm_state_option",
    "AutocastKwargs": "enabled cache_enabled",
    "GradScalerKwargs": "init_scale growth_factor backoff_factor growth_interval enabled",
    "InitProcessGroupKwargs": "backend init_method timeout",
    "ProfileKwargs": "activities schedule_option on_trace_ready record_shapes profile_memory with_stack "
    "with_flops with_modules output_trace_dir",
    "FullyShardedDataParallelPlugin": "fsdp_version sharding_strategy reshard_after_forward "
    "backward_prefetch mixed_precision_policy auto_wrap_policy cpu_offload ignored_modules state_dict_type "
    "state_dict_config "
    "optim_state_dict_config limit_all_gathers use_orig_params param_init_fn sync_module_states "
    "forward_prefetch activation_checkpointing activation_checkpointing_offload cpu_ram_efficient_loading "
    "transformer_cls_names_to_wrap min_num_params",
    "DeepSpeedPlugin": "hf_ds_config gradient_accumulation_steps gradient_clipping zero_stage "
    "is_train_batch_min offload_optimizer_device offload_param_device offload_optimizer_nvme_path "
    "offload_param_nvme_path zero3_init_flag zero3_save_16bit_model transformer_moe_cls_names enable_msamp "
    "msamp_opt_level",
}
ACCELERATE_ENUM_MEMBERS = {
    "DistributedType": "NO MULTI_CPU MULTI_GPU MULTI_NPU MULTI_MLU MULTI_SDAA MULTI_MUSA MULTI_XPU DEEPSPEED "
    "FSDP XLA MEGATRON_LM MULTI_HPU MULTI_NEURON",
    "DDPCommunicationHookType": "NO FP16 BF16 POWER_SGD BATCHED_POWER_SGD",
    "LoggerType": "ALL AIM TENSORBOARD WANDB TRACKIO COMETML MLFLOW CLEARML DVCLIVE SWANLAB",
}

# -- the page -------------------------------------------------------------------------------------------
SECTIONS = {  # heading prefix -> what its first column names
    "Accelerator constructor arguments": "argument",
    "Accelerator methods and properties": "accelerator",
    "PartialState, AcceleratorState, GradientState": "state",
    "Configuration objects and kwargs handlers": "utils",
    "Operations from `accelerate.utils`": "utils",
    "Top-level names of `accelerate`": "top",
    "Other modules": "module",
    "`accelerate launch` flags": "flag",
}


@dataclasses.dataclass
class Row:
    kind: str
    names: list[str]
    verdict: str
    note: str
    line: int

    @property
    def provided(self) -> bool:
        return self.verdict in PROVIDED


def _rows(text: str) -> list[Row]:
    rows, kind = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            heading = line[3:].strip()
            kind = next((k for prefix, k in SECTIONS.items() if heading.startswith(prefix)), None)
            continue
        if kind is None or not line.startswith("|") or line.startswith(("| Accelerate name", "| ---")):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"line {number}: a row has 3 cells (name | unison | note): {line}"
        names = re.findall(r"`([^`]+)`", cells[0])
        listed = re.fullmatch(r"(`[^`]+`(, )?)+", cells[0])
        assert names and listed, f"line {number}: the first column lists backticked names: {line}"
        verdict = next((v for v in VERDICTS if cells[1] == v or cells[1].startswith(v + " (")), None)
        assert verdict, f"line {number}: the unison column starts with one of {VERDICTS}: {cells[1]!r}"
        rows.append(Row(kind, names, verdict, cells[2], number))
    return rows


TEXT = PAGE.read_text()
ROWS = _rows(TEXT)


def _code_identifiers(text: str) -> set[str]:
    """Every identifier (and flag) inside inline code or fenced code on the page."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = fenced + re.findall(r"`([^`]+)`", prose)
    return {token for span in spans for token in re.findall(r"-{0,2}[A-Za-z_][\w-]*", span)}


def _rows_naming(kind: str) -> dict[str, Row]:
    return {name: row for row in ROWS if row.kind == kind for name in row.names}


def _launch_flags() -> set[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in subparsers.choices["launch"]._actions for flag in action.option_strings}


@pytest.fixture
def accelerator(fresh_state) -> Accelerator:
    return Accelerator(cpu=True)


def _has_member(owner: object, cls: type, name: str) -> bool:
    return hasattr(cls, name) or hasattr(owner, name)


# -- the page's structure -----------------------------------------------------------------------------------
def test_every_section_has_rows_and_each_name_one_verdict():
    assert {row.kind for row in ROWS} == set(SECTIONS.values())
    for kind in set(SECTIONS.values()):
        if kind == "utils":
            continue  # two sections share the unison.utils namespace, each name once across both
        names = [name for row in ROWS if row.kind == kind for name in row.names]
        assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    utils = [name for row in ROWS if row.kind == "utils" for name in row.names]
    assert len(utils) == len(set(utils)), sorted({n for n in utils if utils.count(n) > 1})


def test_each_accelerate_accelerator_member_has_a_row():
    rows = _rows_naming("accelerator")
    members = ACCELERATE_ACCELERATOR_MEMBERS + ACCELERATE_ACCELERATOR_ATTRIBUTES
    missing = [name for name in members if f"Accelerator.{name}" not in rows]
    assert not missing, missing
    extra = sorted(set(rows) - {f"Accelerator.{name}" for name in members})
    assert not extra, f"rows for names Accelerate 1.15's Accelerator does not have: {extra}"


def test_each_accelerate_constructor_argument_state_member_utils_name_top_level_name_and_flag_has_a_row():
    arguments = _rows_naming("argument")
    assert [a for a in ACCELERATE_ACCELERATOR_ARGUMENTS if f"Accelerator({a}=)" not in arguments] == []
    state = _rows_naming("state")
    for cls, members in ACCELERATE_STATE_MEMBERS.items():
        assert [m for m in members if f"{cls}.{m}" not in state] == [], cls
    assert [n for n in ACCELERATE_UTILS if n not in _rows_naming("utils")] == []
    assert [n for n in ACCELERATE_TOP_LEVEL if n not in _rows_naming("top")] == []
    assert [f for f in ACCELERATE_LAUNCH_FLAGS if f not in _rows_naming("flag")] == []
    # a name of another module: its own row, or the row of the same object (Accelerate re-exports) in
    # `accelerate`, `accelerate.utils` or another module (`accelerate.data_loader.get_logger` is logging's)
    modules = _rows_naming("module")
    shared = set(_rows_naming("utils")) | set(_rows_naming("top")) | {n.rsplit(".", 1)[1] for n in modules}
    missing = [
        f"{module}.{name}"
        for module, names in ACCELERATE_OTHER_MODULES.items()
        for name in names
        if f"{module}.{name}" not in modules and name not in shared
    ]
    assert missing == []


# -- each row against the code ----------------------------------------------------------------------------
def test_constructor_argument_rows():
    parameters = inspect.signature(Accelerator.__init__).parameters
    for name, row in _rows_naming("argument").items():
        argument = re.fullmatch(r"Accelerator\((\w+)=\)", name)
        assert argument, f"line {row.line}: write constructor arguments as `Accelerator(name=)`: {name}"
        assert (argument.group(1) in parameters) is row.provided, (name, row.verdict)


def test_accelerator_rows(accelerator):
    for name, row in _rows_naming("accelerator").items():
        member = name.removeprefix("Accelerator.")
        assert name.startswith("Accelerator.") and member.isidentifier(), f"line {row.line}: {name}"
        assert _has_member(accelerator, Accelerator, member) is row.provided, (name, row.verdict)


def test_state_rows(accelerator):
    owners = {
        "PartialState": (PartialState(), PartialState),
        "AcceleratorState": (accelerator.state, type(accelerator.state)),
        "GradientState": (GradientState(), GradientState),
    }
    for name, row in _rows_naming("state").items():
        cls_name, _, member = name.partition(".")
        owner, cls = owners[cls_name]
        assert _has_member(owner, cls, member) is row.provided, (name, row.verdict)


def _check_stand_in(module: object, name: str, row: Row) -> None:
    """`module.name` imports, is a stand-in whose use raises the row's note, and is Accelerate's kind."""
    assert NOTE_OF.get(name) == (row.verdict, row.note), f"line {row.line}: names.CATALOGUE's note"
    stand_in = getattr(module, name)
    assert is_stand_in(stand_in), f"{module.__name__}.{name} is marked {row.verdict} but is real"
    with pytest.raises(NotInUnisonError) as raised:
        stand_in()
    assert isinstance(raised.value, NotImplementedError) and row.note in str(raised.value), name
    with pytest.raises(NotInUnisonError, match=re.escape(row.note)):
        stand_in.some_attribute  # noqa: B018 (reading it is the use)
    if isinstance(stand_in, type):  # a class: also no subclass, while isinstance and hints still work
        assert not isinstance(object(), stand_in)
        with pytest.raises(NotInUnisonError):
            type("Mine", (stand_in,), {})


def _check_rows(module: object, kind: str) -> None:
    for name, row in _rows_naming(kind).items():
        if row.provided:
            assert name in module.__all__, f"{name} ({row.verdict}) is not in {module.__name__}.__all__"
            assert not is_stand_in(getattr(module, name)), name
        elif name in accelerate_names(module.__name__):
            _check_stand_in(module, name, row)
        else:  # not a name of the module's Accelerate twin: only where Accelerate has it
            assert not hasattr(module, name), f"{name} is marked {row.verdict} but {module.__name__} has it"


def test_utils_rows():
    _check_rows(unison.utils, "utils")


def test_top_level_rows():
    _check_rows(unison, "top")


def _resolve(path: str) -> object | None:
    """The object at a dotted path such as `unison.data.SeedableRandomSampler`, or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def test_other_module_rows():
    for name, row in _rows_naming("module").items():
        assert name.startswith("accelerate."), f"line {row.line}: {name}"
        accelerate_module, leaf = name.rsplit(".", 1)
        mirrored = accelerate_module in PUBLIC_NAMES  # else a module unison has no twin of (tracking)
        module = (
            importlib.import_module("unison" + accelerate_module.removeprefix("accelerate"))
            if mirrored
            else None
        )
        if row.provided:
            where = re.search(r"`(unison\.[\w.]+)`", row.note)
            assert where and where.group(1).endswith("." + leaf), f"line {row.line}: the note names unison's"
            assert _resolve(where.group(1)) is not None, (name, where.group(1))
            if mirrored:
                assert _resolve(where.group(1)) is getattr(module, leaf), (name, where.group(1))
                assert not is_stand_in(getattr(module, leaf)), name
        else:
            assert mirrored, f"line {row.line}: {name} is a name of a module unison has a twin of"
            _check_stand_in(module, leaf, row)


def test_every_accelerate_name_imports_from_unisons_module_of_the_same_path():
    """The inventory, generated from Accelerate 1.15 (no Accelerate needed here): each name imports,
    with Accelerate's kind (a class is a class), and what a stand-in says is a row of the page."""
    for accelerate_module, kinds in PUBLIC_NAMES.items():
        module = importlib.import_module("unison" + accelerate_module.removeprefix("accelerate"))
        listed = set(dir(module))
        for kind, names in kinds.items():
            for name in names:
                value = getattr(module, name)  # AttributeError: a name unison does not serve
                assert name in listed, f"dir({module.__name__}) omits {name}"
                if kind == "class":
                    assert isinstance(value, type), f"{module.__name__}.{name} is a class in Accelerate"
                elif kind == "function":
                    assert callable(value) and not isinstance(value, type), f"{module.__name__}.{name}"
                assert is_stand_in(value) is (name in NOTE_OF), f"{module.__name__}.{name}"
        assert not [name for name in getattr(module, "__all__", []) if is_stand_in(getattr(module, name))]
    assert sum(len(names) for kinds in PUBLIC_NAMES.values() for names in kinds.values()) == 397


def test_the_inventory_is_what_the_script_reads_from_the_installed_accelerate():
    """Where Accelerate of the inventory's version is installed, the committed list is what
    scripts/accelerate_public_names.py reads from it now (elsewhere the committed list is the fact)."""
    accelerate = pytest.importorskip("accelerate")
    if accelerate.__version__ != ACCELERATE_VERSION:
        pytest.skip(
            f"Accelerate {accelerate.__version__} is installed; the inventory is {ACCELERATE_VERSION}"
        )
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "accelerate_public_names.py"))
    read = {module: script["public_names"](module) for module in script["MODULES"]}
    committed = {
        module: {kind: list(names) for kind, names in kinds.items()} for module, kinds in PUBLIC_NAMES.items()
    }
    assert read == committed


def test_a_stand_in_is_the_same_object_under_every_path_as_in_accelerate():
    import unison.big_modeling
    import unison.state

    assert unison.big_modeling.cpu_offload is unison.cpu_offload
    assert unison.state.is_npu_available is unison.utils.is_npu_available
    assert unison.utils.is_npu_available() is False or unison.utils.is_npu_available()  # a bool, no error
    assert unison.utils.SAFE_WEIGHTS_NAME == "model.safetensors"
    message = str(pytest.raises(NotInUnisonError, unison.utils.GPTTrainStep).value)
    assert message.startswith("unison.utils.GPTTrainStep is Megatron-LM's own engine, which unison does not")


def test_launch_flag_rows():
    flags = _launch_flags()
    for name, row in _rows_naming("flag").items():
        assert (name in flags) is row.provided, (name, row.verdict)


def test_same_configuration_objects_keep_accelerates_fields_and_members():
    rows = _rows_naming("utils") | _rows_naming("top")
    for name, fields in ACCELERATE_FIELDS.items():
        if rows[name].provided:
            ours = {f.name for f in dataclasses.fields(getattr(unison.utils, name))}
            assert set(fields.split()) <= ours, (name, sorted(set(fields.split()) - ours))
    for name, members in ACCELERATE_ENUM_MEMBERS.items():
        assert rows[name].provided
        assert set(members.split()) <= set(getattr(unison.utils, name).__members__), name


# -- unison's side: nothing public goes unmentioned ---------------------------------------------------------
def test_every_public_unison_name_appears_on_the_page(accelerator):
    mentioned = _code_identifiers(TEXT)
    public = {name for name in dir(accelerator) if not name.startswith("_")}
    assert sorted(public - mentioned) == [], "public Accelerator members the page does not mention"
    assert sorted(set(unison.__all__) - mentioned) == [], "names of unison.__all__ the page does not mention"
    assert sorted(set(unison.utils.__all__) - mentioned) == [], "names of unison.utils.__all__ not mentioned"


def test_every_unison_path_on_the_page_exists():
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", TEXT, flags=re.S | re.M)
    paths = {
        m.group(1)
        for span in re.findall(r"`([^`]+)`", prose)
        for m in [re.match(r"(unison(\.\w+)+)", span)]
        if m
    }
    assert paths
    assert sorted(path for path in paths if _resolve(path) is None) == []


# The one-liners the notes give, exactly as the page writes them, run against a prepared Accelerator.
ONE_LINERS = [
    "Accelerator(timeout=1800)",  # first: the process group takes its timeout once
    "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))",
    "for _ in range(accelerator.num_processes): scheduler.step()",
    "accelerator.dataloader_config.even_batches = False",
    "accelerator.gradient_state.sync_gradients = True",
    'accelerator.save_state(f"{accelerator.project_dir}/checkpoints/checkpoint_{saves}")',
    "accelerator.save(obj, f)",
    'accelerator.save_model(model, "out/")',
    "accelerator.unwrap_model(model)",
    "accelerator.unwrap_model(model, keep_torch_compile=False)",
    "model.to(accelerator.device)",
    "accelerator.is_fsdp2",
    "accelerator.parallelism_config.zero_stage",
    "accelerator.parallelism_config.tp_size",
    "PartialState().device",
    'unittest.mock.patch.dict(os.environ, {"NAME": "value"})',
    "PartialState(cpu=True, timeout=1800)",
    "ParallelismConfig(tp_size=2)",
    "ParallelismConfig(pp_size=2)",
    'TorchDynamoPlugin(backend="inductor", fullgraph=True, dynamic=False)',
    "accelerator.state.destroy_process_group()",  # last: ends the process group (none on one process)
]


@pytest.mark.usefixtures("fresh_state")
def test_the_one_liners_run_as_written(tmp_path, monkeypatch):
    import os
    import unittest.mock

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(env_vars.CPU, "1")  # the CPU on any machine, as PartialState(cpu=True) asks
    assert [line for line in ONE_LINERS if f"`{line}`" not in TEXT] == []
    accelerator = eval(ONE_LINERS[0])
    accelerator.project_configuration.set_directories(tmp_path / "project")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()  # before the scheduler's, as torch wants
    namespace = dict(globals()) | {
        "accelerator": accelerator,
        "model": model,
        "scheduler": scheduler,
        "saves": 1,
        "obj": {"step": 1},
        "f": str(tmp_path / "obj.pt"),
        "os": os,
        "unittest": unittest,
        "DataLoaderConfiguration": unison.DataLoaderConfiguration,
        "ParallelismConfig": unison.ParallelismConfig,
        "TorchDynamoPlugin": unison.utils.TorchDynamoPlugin,
    }
    for line in ONE_LINERS[1:]:
        exec(compile(line, "one-liner", "exec"), namespace)
    assert scheduler.get_last_lr() == [0.5]  # stepped num_processes (1) times on a sync step
    assert (tmp_path / "project" / "checkpoints" / "checkpoint_1").is_dir()
    assert (tmp_path / "obj.pt").is_file() and any((tmp_path / "out").iterdir())
    assert accelerator.even_batches is False


# -- the behaviour the "different" notes describe (a fix making unison match Accelerate updates the page)
def _parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def test_the_signature_differences_the_notes_describe():
    assert "optimizer" not in _parameters(Accelerator.unscale_gradients)
    assert "evaluation_mode" not in _parameters(Accelerator.prepare_model)
    assert "slice_fn_for_dispatch" not in _parameters(Accelerator.prepare_data_loader)
    assert "safe_serialization" not in _parameters(Accelerator.save_state)
    assert {"strict", "missing_ok"} <= _parameters(Accelerator.load_state)
    assert "load_kwargs" not in _parameters(Accelerator.load_state)
    assert "log_line_prefix_template" not in _parameters(unison.notebook_launcher)
    assert not {"slice_fn_for_dispatch", "use_stateful_dataloader", "torch_device_mesh"} & _parameters(
        unison.prepare_data_loader
    )
    for name in ("even_batches", "sync_gradients"):  # read-only properties
        assert inspect.getattr_static(Accelerator, name).fset is None, name
    assert not isinstance(inspect.getattr_static(Accelerator, "trigger_sync_in_backward"), staticmethod)
    assert issubclass(unison.CheckpointError, ValueError)
    assert {"JSONL", "CSV"} <= set(unison.LoggerType.__members__)


@pytest.mark.usefixtures("fresh_state")
def test_the_refusals_and_values_the_notes_describe(tmp_path):
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == unison.DistributedType.NO and accelerator.rng_types is None
    assert (accelerator.context_parallel_rank, accelerator.pipeline_parallel_rank) == (0, 0)
    with pytest.raises(TypeError):
        accelerator.prepare(torch.nn.Linear(1, 1), "not preparable")
    refused = [
        lambda: Accelerator(cpu=True, mixed_precision="fp8"),
        lambda: Accelerator(cpu=True, log_with="aim"),
        lambda: Accelerator(cpu=True, kwargs_handlers=[object()]),
        lambda: Accelerator(cpu=True, deepspeed_plugins={"a": unison.DeepSpeedPlugin()}),
        lambda: Accelerator(cpu=True, rng_types=["xla"]).prepare(torch.utils.data.DataLoader(range(4))),
        lambda: Accelerator(cpu=True, kwargs_handlers=[unison.InitProcessGroupKwargs(backend="nccl")]),
        lambda: unison.ProjectConfiguration(project_dir=str(tmp_path), iteration=3),
        lambda: unison.ProjectConfiguration(project_dir=str(tmp_path), save_on_each_node=True),
    ]
    for number, make in enumerate(refused):
        with pytest.raises((ValueError, TypeError)):
            make()
            pytest.fail(f"refusal {number} was accepted")


# -- the example --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_state")
def test_the_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", TEXT, flags=re.S | re.M)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        assert "accelerate" not in re.sub(r"#.*", "", block)  # only comments name the old import
        exec(compile(block, str(PAGE), "exec"), {"__name__": "__main__"})
    assert re.search(r"^loss \d+\.\d{4}$", capsys.readouterr().out, flags=re.M)
