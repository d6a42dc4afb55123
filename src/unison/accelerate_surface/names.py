"""Every public name of Accelerate 1.15 imports from unison's module of the same path.

A migrated script changes `accelerate` to `unison` in its import lines and nothing else, so an import
line must never be where it stops: `from unison.utils import GPTTrainStep` works. What each name is:

- unison's own object under that name (most of `unison` and `unison.utils`, defined or re-exported
  by the module itself);
- a probe that answers truthfully (`is_npu_available()` is False on a machine without an NPU) or a
  constant with Accelerate's value (`SAFE_WEIGHTS_NAME == "model.safetensors"`), served from `HOMES`
  and `CONSTANTS`;
- a stand-in for a name with no meaning in unison (Megatron-LM's train steps, big-model inference
  hooks) or none yet: importable, and raising `NotInUnisonError` (a `NotImplementedError`) when
  called, instantiated, subclassed or asked for an attribute, with the migration guide's reason and
  what to do instead (`CATALOGUE`; docs/migrating-from-accelerate.md lists the same notes).

A stand-in for a class is a class: `isinstance(x, DummyOptim)` is False and `x: DummyOptim` is a valid
hint, since neither uses it. The names come from the generated inventory (inventory.py); each
mirror module (`unison`, `unison.utils`, `unison.state`, ...) serves the ones it does not define through
PEP 562's module `__getattr__` (`mirror()` below), so importing it stays as cheap as before, `dir()`
lists every name it serves, and `from unison.utils import *` takes the working names only (`__all__`),
not stand-ins that would shadow a script's own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NoReturn

from .inventory import PUBLIC_NAMES

GUIDE = "docs/migrating-from-accelerate.md"

# Accelerate's values (accelerate/utils/constants.py, 1.15.0): the file names its checkpoints use
# (unison's own are listed in docs/checkpointing.md; `save_model` writes model.safetensors as well).
CONSTANTS: dict[str, Any] = {
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.1.0",
    "MODEL_NAME": "pytorch_model",
    "OPTIMIZER_NAME": "optimizer",
    "PROFILE_PATTERN_NAME": "profile_{suffix}.json",
    "RNG_STATE_NAME": "random_states",
    "SAFE_MODEL_NAME": "model",
    "SAFE_WEIGHTS_INDEX_NAME": "model.safetensors.index.json",
    "SAFE_WEIGHTS_NAME": "model.safetensors",
    "SAFE_WEIGHTS_PATTERN_NAME": "model{suffix}.safetensors",
    "SAMPLER_NAME": "sampler",
    "SCALER_NAME": "scaler.pt",
    "SCHEDULER_NAME": "scheduler",
    "TORCH_DISTRIBUTED_OPERATION_TYPES": """DEEPSPEED MULTI_GPU FSDP MEGATRON_LM TP MULTI_NPU MULTI_MLU
        MULTI_SDAA MULTI_MUSA MULTI_XPU MULTI_CPU MULTI_HPU MULTI_NEURON""".split(),
    "TORCH_LAUNCH_PARAMS": """nnodes nproc_per_node rdzv_backend rdzv_endpoint rdzv_id rdzv_conf standalone
        max_restarts monitor_interval start_method role module m no_python run_path log_dir r redirects t
        tee node_rank master_addr master_port""".split(),
    "WEIGHTS_INDEX_NAME": "pytorch_model.bin.index.json",
    "WEIGHTS_NAME": "pytorch_model.bin",
    "WEIGHTS_PATTERN_NAME": "pytorch_model{suffix}.bin",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.4.0",
}

# unison module -> the names it defines for real that mirror modules serve without defining them
HOMES: dict[str, str] = {
    "availability": """compare_versions is_4bit_bnb_available is_8bit_bnb_available is_aim_available
        is_amdsmi_available is_bf16_available is_bitsandbytes_multi_backend_available is_bnb_available
        is_boto3_available is_clearml_available is_comet_ml_available is_cuda_available is_datasets_available
        is_deepspeed_available is_dvclive_available is_fp16_available is_fp8_available is_habana_gaudi1
        is_hpu_available is_import_timer_available is_lomo_available is_matplotlib_available
        is_megatron_lm_available is_mlflow_available is_mlu_available is_mps_available is_msamp_available
        is_musa_available is_neuron_available is_npu_available is_pandas_available is_peft_available
        is_pippy_available is_pynvml_available is_pytest_available is_rich_available is_rocm_available
        is_sagemaker_available is_schedulefree_available is_sdaa_available is_swanlab_available
        is_tensorboard_available is_timm_available is_torch_version is_torch_xla_available
        is_torchao_available is_torchdata_available is_torchdata_stateful_dataloader_available
        is_torchvision_available is_trackio_available is_transformer_engine_available
        is_transformer_engine_mxfp8_available is_transformers_available is_triton_available
        is_wandb_available is_weights_only_available is_xccl_available is_xpu_available torchao_required""",
    "configs": "GradientAccumulationPlugin",
    "data": "synchronize_rng_states",
}
HOME_OF = {name: module for module, names in HOMES.items() for name in names.split()}

MEGATRON = (
    "Megatron-LM's own engine, which unison does not use: tensor and pipeline parallelism run on torch's "
    "through `parallelism=` (`ParallelismConfig(tp_size=2, pp_size=2)`)"
)
DEEPSPEED = (
    "DeepSpeed's own engine, which unison does not use: prepare a torch optimizer and scheduler; ZeRO runs "
    'on torch\'s FSDP2 through `parallelism="zero3"` (a `DeepSpeedPlugin` is read into the same layout)'
)
BIG_MODEL_INFERENCE = (
    "Accelerate's big-model inference (device maps, offload, hooks, quantized loading), which unison "
    "does not have: unison trains; a model larger than one device is built under `init_empty_weights()` "
    'and sharded by `prepare()` under `parallelism="zero3"`'
)
INTERNAL = (
    "an internal helper of Accelerate, not part of unison: copy the few lines it does from Accelerate's "
    "source into the script"
)
ENVIRONMENT = (
    "an internal helper of Accelerate (environment and devices), not part of unison: read `os.environ` "
    "directly, and torch's own `torch.cuda` for the device"
)
NO_FP8 = 'no FP8 training: `mixed_precision="bf16"`'

# (verdict, note, names): the stand-ins, and why. "not applicable": the note reads after "NAME is";
# "not yet": the note is what to use meanwhile. Each note is the migration guide's, word for word.
CATALOGUE: tuple[tuple[str, str, str], ...] = (
    (
        "not applicable",
        MEGATRON,
        """MegatronLMPlugin add_model_config_to_megatron_parser MegatronLMDummyDataLoader
        MegatronLMDummyScheduler AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep
        avg_losses_across_data_parallel_group
        MegatronEngine MegatronLMOptimizerWrapper MegatronLMSchedulerWrapper
        gather_across_data_parallel_groups
        megatron_lm_initialize megatron_lm_prepare_data_loader megatron_lm_prepare_model_optimizer_scheduler
        megatron_lm_prepare_optimizer megatron_lm_prepare_scheduler""",
    ),
    (
        "not applicable",
        DEEPSPEED,
        """DummyOptim DummyScheduler DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper
        DeepSpeedSchedulerWrapper
        HfDeepSpeedConfig get_active_deepspeed_plugin map_pytorch_optim_to_deepspeed deepspeed_required
        GatheredParameters""",
    ),
    (
        "not applicable",
        "DeepSpeed's Ulysses sequence parallelism, which unison does not have: keep whole sequences on each "
        "process",
        "DeepSpeedSequenceParallelConfig",
    ),
    (
        "not applicable",
        BIG_MODEL_INFERENCE,
        """cpu_offload cpu_offload_with_hook disk_offload dispatch_model load_checkpoint_and_dispatch
        infer_auto_device_map load_checkpoint_in_model init_on_device get_max_memory get_balanced_memory
        compute_module_sizes calculate_maximum_sizes dtype_byte_size find_tied_parameters retie_parameters
        set_module_tensor_to_device named_module_tensors load_state_dict check_device_map get_max_layer_size
        has_offloaded_params align_module_device load_offloaded_weights offload_state_dict offload_weight
        load_offloaded_weight save_offload_index extract_submodules_state_dict OffloadedWeightsLoader
        PrefixedDataset load_and_quantize_model has_4bit_bnb_layers BnbQuantizationConfig AlignDevicesHook
        CpuOffload LayerwiseCastingHook UserCpuOffloadHook add_hook_to_module attach_align_device_hook
        attach_align_device_hook_on_blocks attach_layerwise_casting_hooks""",
    ),
    (
        "not applicable",
        "PiPPy's pipeline inference, which unison does not have: pipeline training is "
        "`ParallelismConfig(pp_size=2)`",
        "prepare_pippy",
    ),
    (
        "not applicable",
        "Accelerate's writer of a `default_config.yaml` in the home directory, which unison does not have: "
        "`unison config` writes a visible `./unison.toml`",
        "write_basic_config",
    ),
    (
        "not applicable",
        "one of Accelerate's FSDP internals, not part of unison: `prepare()` shards the model on FSDP2 "
        "under `parallelism=`",
        """fsdp2_prepare_model fsdp2_load_full_state_dict fsdp2_switch_optimizer_parameters
        fsdp2_canonicalize_names fsdp2_apply_ac get_fsdp2_grad_scaler enable_fsdp_ram_efficient_loading
        disable_fsdp_ram_efficient_loading ensure_weights_retied""",
    ),
    (
        "not applicable",
        INTERNAL,
        """recursively_apply find_batch_size ignorant_find_batch_size listify slice_tensors honor_type
        is_namedtuple is_torch_tensor is_tensor_information get_data_structure initialize_tensors find_device
        copy_tensor_to_devices pad_input_tensors convert_to_fp32 convert_outputs_to_fp32
        CannotPadNestedTensorWarning get_mixed_precision_context_manager get_grad_scaler id_tensor_storage
        is_peft_model check_tied_parameters_in_config check_tied_parameters_on_same_device
        convert_file_size_to_int clean_state_dict_for_safetensors get_pretty_name merge_dicts
        recursive_getattr
        get_module_children_bottom_up model_has_dtensor get_model_tp_size convert_bytes check_os_kernel
        is_port_in_use compile_regions_deepspeed compile_regions_fsdp2 install_xla DataLoaderAdapter
        DataLoaderStateMixin get_sampler ThreadLocalSharedDict do_nothing""",
    ),
    (
        "not applicable",
        "an internal helper of `accelerate launch`, not part of unison: `unison launch` (or torchrun) starts "
        "the processes",
        """PrepareForLaunch prepare_deepspeed_cmd_env prepare_multi_gpu_env prepare_sagemager_args_inputs
        prepare_simple_launcher_cmd_env prepare_tpu""",
    ),
    (
        "not applicable",
        ENVIRONMENT,
        """are_libraries_initialized check_cuda_fp8_capability check_cuda_p2p_ib_support clear_environment
        convert_dict_to_env_variables get_cpu_distributed_information get_current_device_type get_gpu_info
        get_int_from_env parse_choice_from_env parse_flag_from_env purge_accelerate_environment
        set_numa_affinity str_to_bool""",
    ),
    (
        "not applicable",
        "one of Accelerate's internal types, not part of unison: pass plain strings "
        '(`mixed_precision="bf16"`, `rng_types=["generator"]`)',
        "KwargsHandler PrecisionType RNGType ComputeEnvironment SageMakerDistributedType CustomDtype "
        "TensorInformation",
    ),
    ("not yet", "`ParallelismConfig(tp_size=2)`", "TorchTensorParallelPlugin TorchTensorParallelConfig"),
    ("not yet", "no context parallelism: keep whole sequences per process", "TorchContextParallelConfig"),
    (
        "not yet",
        'pass the backend\'s name as a string: `TorchDynamoPlugin(backend="inductor")`',
        "DynamoBackend",
    ),
    ("not yet", NO_FP8, "FP8RecipeKwargs AORecipeKwargs TERecipeKwargs MSAMPRecipeKwargs"),
    (
        "not yet",
        NO_FP8,
        """convert_model apply_fp8_autowrap contextual_fp8_autocast has_transformer_engine_layers
        convert_model_to_fp8_ao filter_first_and_last_linear_layers has_ao_layers""",
    ),
    (
        "not yet",
        "`tqdm(iterable, disable=not accelerator.is_local_main_process)` from the `tqdm` package",
        "tqdm",
    ),
    ("not yet", "`accelerator.save(obj, f)`", "save"),
    ("not yet", "`torch.load(f)`", "load"),
    ("not yet", "`accelerator.unwrap_model(model)`", "extract_model_from_parallel"),
    (
        "not yet",
        "`torch.compile(model)` before `prepare()`; "
        "`accelerator.unwrap_model(model, keep_torch_compile=False)` gives the module inside",
        "is_compiled_module compile_regions has_compiled_regions",
    ),
    ("not yet", '`unittest.mock.patch.dict(os.environ, {"NAME": "value"})`', "patch_environment"),
    (
        "not yet",
        '`accelerator.save_model(model, "out/")` writes consolidated weights from any layout; '
        "`save_state`/`load_state` handle sharded ones",
        "merge_fsdp_weights save_fsdp_model load_fsdp_model save_fsdp_optimizer load_fsdp_optimizer",
    ),
    (
        "not yet",
        "`synchronize_rng_states([rng_type], generator)` from `unison.utils`",
        "synchronize_rng_state",
    ),
    ("not yet", "`notebook_launcher(function, args, num_processes=2, cpu=True)`", "debug_launcher"),
    ("not yet", "`skip_first_batches(dataloader, num_batches)`", "SkipDataLoader"),
    ("not yet", "`accelerator.state.initialized`", "is_initialized"),
)
NOTE_OF: dict[str, tuple[str, str]] = {
    name: (verdict, note) for verdict, note, names in CATALOGUE for name in names.split()
}


class NotInUnisonError(NotImplementedError):
    """An Accelerate name unison has no meaning for (or none yet) was used: the message says why and
    what to do instead."""


def message(qualname: str) -> str:
    """What a stand-in says when used: its name, the guide's reason and the fix."""
    verdict, note = NOTE_OF[qualname.rpartition(".")[2]]
    said = f"{qualname} is " + (note if verdict == "not applicable" else f"not in unison yet: {note}")
    return f"{said} ({GUIDE})."


def _refuse(qualname: str) -> NoReturn:
    raise NotInUnisonError(message(qualname))


class _AbsentClass(type):
    """The metaclass of a class stand-in: instantiating, subclassing or reading an attribute of it
    raises (dunder lookups stay AttributeError, so introspection, pickling and `help()` still work)."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any):
        for base in bases:
            if isinstance(base, _AbsentClass):
                _refuse(base.__qualified__)
        return super().__new__(mcs, name, bases, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(cls.__qualified__)

    def __getattr__(cls, attribute: str) -> NoReturn:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        _refuse(cls.__qualified__)


class _AbsentFunction:
    """A function stand-in: calling it, or reading an attribute of it, raises."""

    def __init__(self, qualname: str):
        module, _, name = qualname.rpartition(".")
        self.__module__, self.__name__, self.__qualname__ = module, name, name
        self.__qualified__ = qualname
        self.__doc__ = message(qualname)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.__qualified__)

    def __getattr__(self, attribute: str) -> NoReturn:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        _refuse(self.__qualified__)

    def __repr__(self) -> str:
        return f"<{self.__qualified__}: not in unison>"


_KIND = {name: kind for kinds in PUBLIC_NAMES.values() for kind, names in kinds.items() for name in names}
_STAND_INS: dict[str, object] = {}  # one per name, whichever module serves it (as Accelerate's are one)
_FIRST_FROM = ("accelerate.utils", "accelerate", *PUBLIC_NAMES)  # the module a stand-in's message names


def stand_in(name: str) -> object:
    """The stand-in for an Accelerate name unison has no meaning for: a class if Accelerate's is one."""
    if name not in _STAND_INS:
        home = next(m for m in _FIRST_FROM if any(name in names for names in PUBLIC_NAMES[m].values()))
        module = "unison" + home.removeprefix("accelerate")
        qualname = f"{module}.{name}"
        if _KIND[name] == "class":
            namespace = {"__module__": module, "__doc__": message(qualname), "__qualified__": qualname}
            _STAND_INS[name] = _AbsentClass(name, (), namespace)
        else:
            _STAND_INS[name] = _AbsentFunction(qualname)
    return _STAND_INS[name]


def is_stand_in(value: object) -> bool:
    return isinstance(value, (_AbsentClass, _AbsentFunction))


def accelerate_names(module: str) -> tuple[str, ...]:
    """Accelerate's public names of the module of the same path as unison's `module`."""
    kinds = PUBLIC_NAMES["accelerate" + module.removeprefix("unison")]
    return tuple(sorted(name for names in kinds.values() for name in names))


def serve(name: str, module: str) -> object:
    """The object `module` (a unison mirror module) serves for Accelerate's `name`."""
    if name in CONSTANTS:
        return CONSTANTS[name]
    if name in HOME_OF:
        return getattr(importlib.import_module(f"unison.{HOME_OF[name]}"), name)
    if name in NOTE_OF:
        return stand_in(name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def is_real(name: str) -> bool:
    """Whether what unison serves for `name` works (not a stand-in), known without importing it."""
    return name not in NOTE_OF


def mirror(
    module: str, namespace: dict[str, Any], defined: frozenset[str] = frozenset()
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """PEP 562's `__getattr__` and `__dir__` for `module`, and the names `__all__` adds to what the module
    defines: Accelerate's names it does not define itself that work in unison. `defined`: names the
    module serves by its own `__getattr__` (the `unison` package's lazy exports)."""
    served = frozenset(accelerate_names(module)) - set(namespace) - defined

    def __getattr__(name: str) -> Any:
        if name not in served:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = namespace[name] = serve(name, module)  # once served, a plain module attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | served)

    return __getattr__, __dir__, sorted(name for name in served if is_real(name))
