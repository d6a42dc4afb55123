"""docs/errors.md, tested: each misuse it lists fails with the message it quotes, on every rank.

The library's cases run in one launch of tests/workers/misuse_worker.py on 2 processes (each rank records
the message it got, and what a refused load or a failed save left behind). The launcher's cases run here,
through `unison launch`'s own entry point: they fail before any worker starts. The catalogue test then
holds docs/errors.md to what these runs printed, row by row; a row whose case ends the whole run (a
stall report) is held to the assertions of the launch test it names.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import subprocess
from pathlib import Path
from unittest import mock

import pytest
from launching import REPO_ROOT, WORKERS, launch_ok

from unison.commands.main import main
from unison.launching import launcher

WORKER = WORKERS / "misuse_worker.py"
CATALOGUE = REPO_ROOT / "docs" / "errors.md"
SHOWN_AS = "ckpt"
"""The worker's output directory, as the catalogue writes it: checkpoint paths read ckpt/<name>."""


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """Every rank's record of the worker's cases, with the worker's directory shown as `ckpt`.

    The full-disk case needs a small file system: a 1 MiB tmpfs (mounting needs root; without it that
    case is skipped, with the reason)."""
    out_dir = tmp_path_factory.mktemp("misuse")
    small_disk = out_dir / "small_disk"
    small_disk.mkdir()
    why_not = mount_small_disk(small_disk)
    try:
        launch_ok(WORKER, 2, str(out_dir), *([] if why_not else [str(small_disk)]), timeout=240)
    finally:
        if why_not is None:
            subprocess.run(["umount", str(small_disk)], check=True)
    records = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        record["errors"] = {
            name: None if message is None else message.replace(str(out_dir), SHOWN_AS)
            for name, message in record["errors"].items()
        }
    return {"records": records, "no_small_disk": why_not}


def mount_small_disk(directory: Path) -> str | None:
    """Mount a 1 MiB tmpfs on `directory`; None, or why it could not be (not root, no mount command)."""
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)], capture_output=True, text=True
        )
    except OSError as error:
        return f"cannot mount a tmpfs: {error}"
    return None if mounted.returncode == 0 else f"cannot mount a tmpfs: {mounted.stderr.strip()}"


def cli_error(*argv: str) -> str:
    """The last line `unison launch ARGV` writes to stderr, run in this process (it ends before any
    worker starts): argparse's error line, or the launcher's one-line report (through the unison
    logger, given a handler of its own here as the command line has)."""
    unison_logger = logging.getLogger("unison")
    saved = list(unison_logger.handlers), unison_logger.level
    stderr = io.StringIO()
    handler = logging.StreamHandler(stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    unison_logger.handlers[:] = [handler]
    unison_logger.setLevel(logging.INFO)
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(["launch", *argv])
        except SystemExit as stop:
            code = stop.code
        finally:
            unison_logger.handlers[:], unison_logger.level = saved
    assert code in (1, 2), stderr.getvalue()
    return stderr.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def launcher_errors(tmp_path_factory) -> dict[str, str]:
    script = tmp_path_factory.mktemp("launch") / "train.py"
    script.write_text("")
    errors = {
        "flag_misspelt": cli_error("--nproc-per-nod", "2", str(script)),
        "flag_mixed_precision": cli_error("--mixed-precision", "fp8", str(script)),
        "flag_accumulation_zero": cli_error("--gradient-accumulation-steps", "0", str(script)),
        "flag_nproc_zero": cli_error("--nproc-per-node", "0", str(script)),
        "flag_parallelism_world_size": cli_error(
            "--nproc-per-node", "2", "--parallelism", "tp_size=3", str(script)
        ),
        "node_rank_out_of_range": cli_error(
            "--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "2", str(script)
        ),
        "node_rank_one_node": cli_error("--node-rank", "1", str(script)),
        "script_missing": cli_error("--nproc-per-node", "2", "trian.py"),
    }
    srun_step = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
    }
    with mock.patch.dict(os.environ, srun_step):  # what srun -n2 sets (tests/test_real_launchers.py runs it)
        errors["several_launchers"] = cli_error("--nproc-per-node", "2", str(script))
    signals = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # torch's agent sets it in this process
    try:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = str(busy.getsockname()[1])
            line = cli_error("--cpu", "--master-port", port, str(script))
            errors["port_in_use"] = line.replace(port, "PORT")
        port = str(launcher.free_loopback_port())  # nobody listens there: node 0 never started
        node = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port]
        line = cli_error("--cpu", *node, "--timeout", "2", str(script))
        errors["node_0_never_starts"] = line.replace(port, "PORT")
    finally:
        if signals is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
    return errors


def messages_of(reports: dict, name: str) -> list[str]:
    return [record["errors"][name] for record in reports["records"]]


def test_every_case_fails_on_every_rank(reports):
    """Each case raised on both ranks, the same exception (what each says: the catalogue test below)."""
    for name in reports["records"][0]["errors"]:
        if name == "save_disk_full" and reports["no_small_disk"]:
            continue
        first, second = messages_of(reports, name)
        assert first is not None and second is not None, (name, first, second)
        assert first.split(":")[0] == second.split(":")[0], (name, first, second)


def test_refused_loads_leave_the_model_as_it_was(reports):
    for record in reports["records"]:
        checks = record["checks"]
        assert checks["other_model_untouched"] and checks["other_keys_untouched"], checks
        assert checks["other_optimizer_untouched"], checks


def test_a_full_disk_fails_the_save_on_every_rank_and_the_previous_checkpoint_loads(reports):
    if reports["no_small_disk"]:
        pytest.skip(reports["no_small_disk"])
    for message in messages_of(reports, "save_disk_full"):
        assert "ckpt/small_disk/checkpoint_2 could not be written: the disk holding it is full" in message
        assert "the previous checkpoints are intact" in message
    for record in reports["records"]:
        # nothing half-written is left (no .checkpoint_2.tmp), and checkpoint_1 loaded back whole
        assert record["checks"]["full_disk_left"] == ["checkpoint_1", "other_job.bin"], record["checks"]
        assert record["checks"]["full_disk_previous_loads"]


def test_a_full_disk_fails_an_asynchronous_save_at_the_next_wait_on_every_rank(reports):
    if reports["no_small_disk"]:
        pytest.skip(reports["no_small_disk"])
    for message in messages_of(reports, "save_async_disk_full"):
        assert "ckpt/small_disk/checkpoint_3 could not be written: the disk holding it is full" in message
    for record in reports["records"]:
        checks = record["checks"]
        assert checks["async_save_returned"].endswith("checkpoint_3"), checks  # the write failed later
        assert checks["async_full_disk_left"] == ["checkpoint_1", "other_job.bin"], checks
        assert checks["async_full_disk_previous_loads"], checks


def test_what_the_messages_advise_works(reports):
    """find_unused_parameters or a frozen head trains the model with an unused head; the optimizer built
    after prepare() trains under ZeRO-3; switching optimizers as the message says loads and steps."""
    for record in reports["records"]:
        checks = record["checks"]
        assert checks["unused_parameter_fixes_work"] and checks["switching_optimizers_as_the_message_says"]
        assert checks["optimizer_after_prepare_trains"], checks


def test_the_launcher_refuses_before_any_worker(launcher_errors):
    for name, line in launcher_errors.items():
        assert line.startswith("unison launch: "), (name, line)


# -- the catalogue ------------------------------------------------------------------------------------
ROW = re.compile(r"^\| `(?P<id>[a-z0-9_]+)` \|(?P<misuse>[^|]+)\|(?P<message>[^|]+)\| (?P<test>[^|]+) \|$")
"""A row of the catalogue's tables: | `case id` | misuse | `message` | tests/file.py::test_name |"""


def catalogue_rows() -> list[dict[str, str]]:
    rows = [match.groupdict() for line in CATALOGUE.read_text().splitlines() if (match := ROW.match(line))]
    for row in rows:
        row["message"] = row["message"].strip().strip("`").strip()
        row["test"] = row["test"].strip().strip("`")
    return rows


def test_the_catalogue_names_at_least_30_cases_each_with_a_test_that_exists():
    rows = catalogue_rows()
    assert len(rows) >= 30, len(rows)
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
    for row in rows:
        path, test = row["test"].split("::")
        assert (REPO_ROOT / path).is_file(), row
        assert re.search(rf"^def {re.escape(test)}\(", (REPO_ROOT / path).read_text(), re.M), row


def test_the_catalogue_quotes_the_messages_users_get(reports, launcher_errors):
    """Each quoted message, cut at its '...', is what the runs above printed for that row's case (its
    parts in that order), on every rank; a row whose case these runs do not cover is held to the
    assertions of the test it names. Every case the runs cover has its row."""
    recorded = {name: messages_of(reports, name) for name in reports["records"][0]["errors"]}
    recorded.update((name, [line]) for name, line in launcher_errors.items())
    if reports["no_small_disk"]:
        del recorded["save_disk_full"]
    rows = catalogue_rows()
    assert set(recorded) - {row["id"] for row in rows} == set(), "cases without a row"
    for row in rows:
        if row["id"] == "save_disk_full" and reports["no_small_disk"]:
            continue  # its own test says why it was skipped
        fragments = [part.strip() for part in row["message"].split("...") if part.strip()]
        assert fragments, row
        path = row["test"].split("::")[0]
        texts = recorded.get(row["id"]) or [(REPO_ROOT / path).read_text()]
        for text in texts:
            position = 0
            for fragment in fragments:  # in the order quoted
                found = text.find(fragment, position)
                assert found >= 0, f"{row['id']}: {fragment!r} is not in (after the previous part):\n{text}"
                position = found + len(fragment)
