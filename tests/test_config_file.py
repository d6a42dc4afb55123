"""The launch config file: `unison config` writes unison.toml, `unison launch` reads it (or --config FILE,
or an Accelerate default_config.yaml) below flags and UNISON_* variables, and `unison env` shows where
each setting came from. Two real launches; the rest runs the CLI in-process."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO_ROOT, WORKERS, describe
from slowness import budget

from unison.commands.launch import options_from_args
from unison.commands.launch_config_flags import apply_config_file
from unison.commands.main import build_parser, main
from unison.launching.accelerate_config import AccelerateConfigError, map_accelerate
from unison.launching.config_file import ConfigError, read_config

DATA = Path(__file__).parent / "data"
WORKER = WORKERS / "config_worker.py"
FILE = """\
nproc_per_node = 2
cpu = true
mixed_precision = "bf16"
gradient_accumulation_steps = 4
timeout = 90
"""


def unison(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unison", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=budget(240),
    )


def parsed(tmp_path: Path, *argv: str, env: dict | None = None, monkeypatch=None):
    """`unison launch ARGV script` parsed and completed from the config file, as the launcher sees it."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["launch", *argv, str(WORKER)])
    sources = json.loads(apply_config_file(args))
    return options_from_args(args), sources


def test_config_writes_the_flags_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags = ["--mixed-precision", "bf16", "--nproc-per-node", "2", "--cpu", "--timeout", "90"]
    assert main(["config", *flags, "--gradient_accumulation_steps", "4"]) == 0
    values, warnings = read_config(Path("unison.toml"))
    assert values == {
        "nproc_per_node": 2,
        "cpu": True,
        "mixed_precision": "bf16",
        "gradient_accumulation_steps": 4,
        "timeout": 90.0,
    }
    assert warnings == []
    with pytest.raises(SystemExit) as exit_:
        main(["config", "--mixed-precision", "fp16"])
    assert exit_.value.code == 2 and "unison.toml already exists: pass --force" in capsys.readouterr().err
    assert main(["config", "--force", "--mixed-precision", "fp16", "--use-fsdp"]) == 0
    assert read_config(Path("unison.toml"))[0] == {"mixed_precision": "fp16", "use_fsdp": True}


def test_config_asks_the_questions_on_a_terminal(tmp_path):
    """No flags and a terminal on stdin: the questions, an empty answer keeping the default."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "unison", "config"],
        cwd=tmp_path,
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(secondary)
    # nproc_per_node, cpu, mixed_precision (a wrong answer, asked again), accumulation, then defaults
    os.write(primary, b"2\nyes\nbf17\nbf16\nmaybe\n0\n3\n\n\n\n")
    out, err = process.communicate(timeout=budget(120))
    os.close(primary)
    assert process.returncode == 0, err
    assert "mixed precision (no, bf16, fp16) [no]: " in out
    assert "mixed_precision='bf17' is unknown: choose one of no, bf16, fp16" in out
    assert "gradient_accumulation_steps = 'maybe' is not a int" in out
    assert "gradient_accumulation_steps = 0 must be above 0" in out
    assert read_config(tmp_path / "unison.toml")[0] == {
        "nproc_per_node": 2,
        "cpu": True,
        "mixed_precision": "bf16",
        "gradient_accumulation_steps": 3,
    }


def test_launch_reads_unison_toml_below_flags_variables_and_code(tmp_path):
    """Two real launches from a directory holding unison.toml: the file gives what nothing else gave."""
    (tmp_path / "unison.toml").write_text(FILE)
    out = tmp_path / "out"
    out.mkdir()
    # 1. nothing but the file and one variable: 2 processes, bf16, 4 steps; UNISON_TIMEOUT beats timeout=90
    result = unison("launch", str(WORKER), str(out), cwd=tmp_path, env={"UNISON_TIMEOUT": "45"})
    assert result.returncode == 0, describe(result)
    assert "unison: launch settings from ./unison.toml" in result.stderr.splitlines(), describe(result)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for seen in ranks:
        assert seen["num_processes"] == 2 and seen["mixed_precision"] == "bf16"
        assert seen["gradient_accumulation_steps"] == 4 and seen["UNISON_TIMEOUT"] == "45"
    settings = ranks[0]["settings"]  # `unison env` inside the launch
    for line in (
        "nproc_per_node = 2 (from unison.toml)",
        "mixed_precision = bf16 (from unison.toml)",
        "gradient_accumulation_steps = 4 (from unison.toml)",
        "timeout = 45 (from UNISON_TIMEOUT)",
        "parallelism = ddp (default)",
    ):
        assert line in settings, settings
    # 2. flags beat the file, and an argument in code beats the flag
    flags = ["--mixed-precision", "no", "--gradient-accumulation-steps", "2"]
    result = unison("launch", *flags, str(WORKER), str(out), "6", cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["mixed_precision"] == "no" and seen["gradient_accumulation_steps"] == 6
        assert seen["UNISON_TIMEOUT"] == "90"  # the file fills what no flag or variable gave
    settings = json.loads((out / "rank0.json").read_text())["settings"]
    assert "mixed_precision = no (from --mixed-precision)" in settings
    assert "gradient_accumulation_steps = 2 (from --gradient-accumulation-steps)" in settings
    assert "timeout = 90 (from unison.toml)" in settings


def test_env_shows_each_settings_origin(tmp_path, monkeypatch, capsys):
    config = tmp_path / "run.toml"
    config.write_text(FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UNISON_MIXED_PRECISION", "fp16")
    monkeypatch.delenv("UNISON_CONFIG_SOURCES", raising=False)
    for name in ("UNISON_GRADIENT_ACCUMULATION_STEPS", "UNISON_TIMEOUT", "UNISON_PARALLELISM", "UNISON_CPU"):
        monkeypatch.delenv(name, raising=False)
    assert main(["env", "--config", "run.toml"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  mixed_precision = fp16 (from UNISON_MIXED_PRECISION)" in lines  # the variable beats the file
    assert "  gradient_accumulation_steps = 4 (from run.toml)" in lines
    assert "  parallelism = ddp (default)" in lines


def test_nothing_is_read_from_the_home_directory(tmp_path, monkeypatch, capsys):
    """Accelerate's hidden default config, or a unison.toml in $HOME, changes nothing."""
    home, project = tmp_path / "home", tmp_path / "project"
    accelerate_dir = home / ".cache" / "huggingface" / "accelerate"
    accelerate_dir.mkdir(parents=True)
    (accelerate_dir / "default_config.yaml").write_text((DATA / "accelerate_multi_gpu.yaml").read_text())
    (home / "unison.toml").write_text(FILE)
    project.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(project)
    for name in ("UNISON_MIXED_PRECISION", "UNISON_CONFIG_SOURCES", "UNISON_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(name, raising=False)
    options, sources = parsed(project)
    assert options.mixed_precision is None and options.nproc_per_node is None and sources == {}
    main(["env"])
    assert "  mixed_precision = no (default)" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    "text, message",
    [
        ("mixed_precison = 'bf16'\n", "unknown key 'mixed_precison' (did you mean 'mixed_precision'?)"),
        ("gradient_accumulation_steps = '4'\n", "gradient_accumulation_steps = '4' is a str, but"),
        ("cpu = 1\n", "cpu = 1 is a int, but cpu takes true/false"),
        ("mixed_precision = 'bf16\n", "is not valid TOML"),
    ],
)
def test_bad_keys_and_types_are_refused_naming_the_file(tmp_path, text, message, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match="bad.toml"):
        read_config(config)
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--config", str(config), str(WORKER)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_flag_sets_the_files_whole_group_aside(tmp_path, monkeypatch):
    """--parallelism beats the file's use_fsdp; --num-processes its nproc_per_node (no mixed result)."""
    config = tmp_path / "u.toml"
    config.write_text("use_fsdp = true\nfsdp_sharding_strategy = 'SHARD_GRAD_OP'\nnproc_per_node = 4\n")
    for name in ("UNISON_PLUGIN", "UNISON_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)
    options, sources = parsed(
        tmp_path, "--config", str(config), "--parallelism", "zero2", "--num-processes", "2"
    )
    assert options.plugin is None and options.parallelism == "zero2" and options.nproc_per_node is None
    assert sources == {"num_processes": [2, "--num-processes"], "parallelism": ["zero2", "--parallelism"]}
    options, _ = parsed(tmp_path, "--config", str(config))
    assert json.loads(options.plugin) == {"fsdp": {"sharding_strategy": "SHARD_GRAD_OP"}}
    options, _ = parsed(
        tmp_path, "--config", str(config), env={"UNISON_PLUGIN": "{}"}, monkeypatch=monkeypatch
    )
    assert options.plugin is None  # the variable's plugin stands


def _flags_options(tmp_path: Path, *flags: str):
    return options_from_args(build_parser().parse_args(["launch", *flags, str(WORKER)]))


def test_accelerate_yaml_maps_onto_the_launch_flags(tmp_path, monkeypatch):
    for name in (
        "UNISON_MIXED_PRECISION",
        "UNISON_PLUGIN",
        "UNISON_CPU",
        "UNISON_DEBUG",
        "UNISON_DYNAMO_BACKEND",
    ):
        monkeypatch.delenv(name, raising=False)
    multi_gpu, _ = parsed(tmp_path, "--config", str(DATA / "accelerate_multi_gpu.yaml"))
    assert multi_gpu == _flags_options(tmp_path, "--num_processes", "2", "--mixed_precision", "bf16")
    fsdp, _ = parsed(tmp_path, "--config", str(DATA / "accelerate_fsdp.yaml"))
    fsdp_flags = ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_auto_wrap_policy"]
    fsdp_flags += ["TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"]
    fsdp_flags += ["--fsdp_backward_prefetch", "BACKWARD_PRE", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"]
    fsdp_flags += ["--fsdp_offload_params", "false", "--fsdp_forward_prefetch", "false"]
    fsdp_flags += ["--fsdp_sync_module_states", "true", "--fsdp_activation_checkpointing", "false"]
    expected = _flags_options(tmp_path, "--num_processes", "4", "--mixed_precision", "bf16", *fsdp_flags)
    assert json.loads(fsdp.plugin) == json.loads(expected.plugin)
    assert fsdp.num_processes == 4 and fsdp.mixed_precision == "bf16"
    values, warnings = read_config(DATA / "accelerate_deepspeed_two_nodes.yaml")
    assert values == {
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "num_processes": 16,
        "cpu": False,
        "debug": False,
        "mixed_precision": "fp16",
        "dynamo_backend": "inductor",
        "dynamo_mode": "default",
        "use_deepspeed": True,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero_stage": 2,
    }
    assert warnings == []  # every other key holds the value that asks for nothing


def test_accelerate_keys_unison_does_not_use_are_named(tmp_path, monkeypatch, caplog):
    data = {
        "compute_environment": "AMAZON_SAGEMAKER",
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_cpu_ram_efficient_loading": True, "fsdp_version": 2},
        "gpu_ids": "0,1",
        "tpu_name": "my-tpu",
        "num_processes": 2,
    }
    values, warnings = map_accelerate(data, "x.yaml")
    assert values == {"num_processes": 2, "use_fsdp": True, "fsdp_version": 2}
    assert warnings == [
        "fsdp_config.fsdp_cpu_ram_efficient_loading: True (every process builds the model: more host memory, "
        "same numbers)",
        "compute_environment: AMAZON_SAGEMAKER (where Accelerate runs the job; unison launches on this "
        "machine)",
        "gpu_ids: 0,1 (export CUDA_VISIBLE_DEVICES to choose GPUs)",
        "tpu_name: my-tpu (TPUs are not supported)",
    ]
    hand_written = tmp_path / "hand.yaml"  # unquoted `no`, which YAML reads as False
    hand_written.write_text("mixed_precision: no\ndowncast_bf16: no\ndynamo_backend: no\nnum_processes: 2\n")
    assert read_config(hand_written) == ({"num_processes": 2, "mixed_precision": "no"}, [])
    config = tmp_path / "fsdp.yml"
    config.write_text((DATA / "accelerate_fsdp.yaml").read_text())
    monkeypatch.delenv("UNISON_PLUGIN", raising=False)
    with caplog.at_level("WARNING", logger="unison"):
        parsed(tmp_path, "--config", str(config))
    assert "fsdp.yml: not used by unison: fsdp_config.fsdp_cpu_ram_efficient_loading: True" in caplog.text


@pytest.mark.parametrize(
    "data, message",
    [
        ({"mixed_precision": "fp8"}, "mixed_precision: fp8 changes the numerics"),
        ({"fp8_config": {"backend": "TE"}}, "fp8_config: FP8 training changes the numerics"),
        ({"distributed_type": "MEGATRON_LM"}, "distributed_type: MEGATRON_LM is not something unison runs"),
        ({"distributed_type": "XLA"}, "distributed_type: XLA is not something unison runs"),
    ],
)
def test_accelerate_settings_unison_cannot_honour_are_errors(data, message):
    with pytest.raises(AccelerateConfigError, match="x.yaml: " + message):
        map_accelerate(data, "x.yaml")


def test_an_accelerate_option_the_plugin_refuses_names_the_file(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--config", str(DATA / "accelerate_deepspeed_two_nodes.yaml"), str(WORKER)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "DeepSpeedPlugin(gradient_clipping=1.0)" in err
    assert "came from " + str(DATA / "accelerate_deepspeed_two_nodes.yaml") in err


def test_missing_writers_and_readers_name_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tomli_w", None)  # as if not installed: import raises
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(SystemExit):
        main(["config", "--cpu"])
    assert "needs tomli-w, which is not installed: pip install 'unison[config]'" in capsys.readouterr().err
    with pytest.raises(
        ConfigError, match=r"needs PyYAML, which is not installed: pip install 'unison\[config\]'"
    ):
        read_config(DATA / "accelerate_fsdp.yaml")


def test_repo_root_has_no_config_file():
    """The suite launches from the repository root: a unison.toml there would change every test."""
    assert not (REPO_ROOT / "unison.toml").exists()
