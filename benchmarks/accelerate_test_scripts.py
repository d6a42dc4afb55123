"""Accelerate's own distributed test scripts, run on Accelerate and on unison with only the imports changed.

What it compares: for each script Accelerate ships in ``accelerate/test_utils/scripts/`` (the ones its
CI launches on several processes), how many of its cases pass under Accelerate's launcher and how many
of those pass under ``unison launch``, with and without ``UNISON_NUMERICS=accelerate``. The ratio
that matters: cases passing on unison / cases passing on Accelerate.

Why a harness and not the scripts as they are: each script's ``main()`` calls its checks one after
the other and stops at the first failure, so a bare exit code says "something failed" and hides
every later case. Here every call statement in ``main()`` (a check such as ``training_check(...)``,
or an API call such as ``state.destroy_process_group()``; not ``print``) is one case: the copy runs
it through a small recorder that writes, per process, which case started, passed or failed. A case
passes when it passed on every process. At a failure the process exits at once (a peer left inside a
collective would pair its next collective with the wrong one), and the harness launches the script
again from the next case; a launch that hangs is killed and the case it stopped in counts as failed.
The same instrumented copy runs on both libraries; the unison copy differs only in its imports:
``from accelerate.X import name`` becomes ``from unison.M import name`` with M the unison module that
has the name (the migration guide's mapping), and ``accelerate.test_utils`` (Accelerate's test
helpers, not the library under test) stays as it is. A name unison lacks (the migration guide says
why) becomes a function that raises NotImplementedError, so the cases that call it fail and the
others still run.

Accelerate is installed into a throwaway virtual environment that reuses this one's torch and
unison (``python3 -m venv --system-site-packages``); nothing of the project's environment changes.

    python3 benchmarks/accelerate_test_scripts.py                    # every script, 2 and 3 processes
    python3 benchmarks/accelerate_test_scripts.py --scripts test_ops.py --nprocs 2

It takes several minutes on 2 cores and is not part of the test suite.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

VENV = Path("/tmp/accvenv")
ROOT = Path(__file__).resolve().parent.parent
# Script -> process counts. test_distributed_data_loop asserts two processes; test_notebook is run
# with plain python (it calls notebook_launcher itself, ACCELERATE_NUM_PROCESSES processes), as
# Accelerate's test_multigpu.py runs it. Left out: test_ddp_comm_hook.py (its reference DDP takes
# device_ids, GPU only: every case fails on Accelerate on the CPU), test_merge_weights.py (FSDP on GPUs),
# test_cli.py (no case: it prints the GPU count).
SCRIPTS = {
    "test_script.py": (2, 3),
    "test_ops.py": (2, 3),
    "test_sync.py": (2, 3),
    "test_notebook.py": (2, 3),
    "test_distributed_data_loop.py": (2,),
}
PLAIN_PYTHON = {"test_notebook.py"}
# Where a name of an accelerate module is looked for in unison, first match wins.
UNISON_MODULES = ("unison", "unison.utils", "unison.ops", "unison.data", "unison.state", "unison.logging")
RECORDER = """
import json as _h_json, os as _h_os, sys as _h_sys
_H_DIR = _h_os.environ["HARNESS_DIR"]
_H_START = int(_h_os.environ.get("HARNESS_START", "0"))
_h_index = [0]


def _h_write(**row):
    with open(_h_os.path.join(_H_DIR, "rank%s.jsonl" % _h_os.environ.get("RANK", "0")), "a") as f:
        f.write(_h_json.dumps(row) + "\\n")


def _h_repr(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join("%s: %s" % (_h_repr(k), _h_repr(v)) for k, v in value.items()) + "}"
    if hasattr(type(value), "__members__") and hasattr(value, "name"):  # an Enum member
        return "%s.%s" % (type(value).__name__, value.name)
    return getattr(value, "__name__", type(value).__name__)


def _h_world():
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _h_case(_h_src, _h_fn, *args, **kwargs):
    index = _h_index[0]
    _h_index[0] += 1
    if index < _H_START:
        return None
    parts = [_h_repr(a) for a in args] + ["%s=%s" % (k, _h_repr(v)) for k, v in kwargs.items()]
    name = "%s(%s)" % (_h_src, ", ".join(parts))
    _h_write(event="start", index=index, name=name, world=_h_world())
    try:
        result = _h_fn(*args, **kwargs)
    except BaseException as error:
        error = "%s: %s" % (type(error).__name__, str(error)[:300])
        _h_write(event="fail", index=index, name=name, error=error)
        _h_sys.stdout.flush()
        _h_sys.stderr.flush()
        _h_os._exit(1)
    _h_write(event="pass", index=index, name=name, world=_h_world())
    return result
"""


# In the unison copy, Accelerate's test helpers (accelerate.test_utils) use unison too: a helper such
# as are_the_same_tensors calls AcceleratorState() and gather, which would otherwise ask Accelerate's
# never-initialised state. Each name a test_utils module took from accelerate is rebound to unison's.
REBIND = f"""
def _h_rebind():
    import importlib, sys
    modules = [importlib.import_module(m) for m in {UNISON_MODULES!r}]
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("accelerate.test_utils"):
            continue
        for attr, value in list(vars(module).items()):
            origin = getattr(value, "__module__", None) or ""
            if origin.startswith("accelerate") and not origin.startswith("accelerate.test_utils"):
                for unison_module in modules:
                    if hasattr(unison_module, attr):
                        setattr(module, attr, getattr(unison_module, attr))
                        break


_h_rebind()
"""


class _CaseCalls(ast.NodeTransformer):
    """Turn each call statement of ``main()`` (outside nested functions) into ``_h_case(src, f, ...)``."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node  # nested functions keep their calls

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if not isinstance(call, ast.Call):
            return node
        func = call.func
        if (isinstance(func, ast.Name) and func.id == "print") or (
            isinstance(func, ast.Attribute) and func.attr == "print"
        ):
            return node
        src = ast.Constant(ast.unparse(func))
        wrapped = ast.Call(ast.Name("_h_case", ast.Load()), [src, func, *call.args], call.keywords)
        return ast.copy_location(ast.Expr(wrapped), node)


def _unison_module_for(name: str) -> str | None:
    for candidate in UNISON_MODULES:
        try:
            if hasattr(importlib.import_module(candidate), name):
                return candidate
        except ImportError:
            continue
    return None


def _rewrite_imports(tree: ast.Module) -> list[str]:
    """Point every accelerate import (bar accelerate.test_utils) at unison; return the names unison lacks."""
    missing = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        new_body = []
        for stmt in body:
            is_accelerate = (
                isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == "accelerate"
            )
            if not is_accelerate or stmt.module.startswith("accelerate.test_utils"):
                new_body.append(stmt)
                continue
            for alias in stmt.names:
                target = _unison_module_for(alias.name)
                if target is None:
                    missing.append(f"{stmt.module}.{alias.name}")
                    stub = f"def {alias.asname or alias.name}(*args, **kwargs):\n"
                    stub += f"    raise NotImplementedError('unison has no {stmt.module}.{alias.name}')"
                    new_body.append(ast.copy_location(ast.parse(stub).body[0], stmt))
                    continue
                new_body.append(ast.copy_location(ast.ImportFrom(target, [alias], 0), stmt))
        node.body = new_body
    return missing


def instrument(source: str, for_unison: bool) -> tuple[str, list[str]]:
    """The script with main()'s call statements recorded and, for unison, its imports rewritten."""
    tree = ast.parse(source)
    missing = _rewrite_imports(tree) if for_unison else []
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "main":
            stmt.body = [_CaseCalls().visit(s) for s in stmt.body]
            tree.body[i] = stmt
    ast.fix_missing_locations(tree)
    prelude_end = next(
        i for i, s in enumerate(tree.body) if not (isinstance(s, ast.ImportFrom) and s.module == "__future__")
    )
    if for_unison:  # after the last top-level import
        last_import = max(i for i, s in enumerate(tree.body) if isinstance(s, (ast.Import, ast.ImportFrom)))
        tree.body[last_import + 1 : last_import + 1] = ast.parse(REBIND).body
    tree.body[prelude_end:prelude_end] = ast.parse(RECORDER).body
    return ast.unparse(tree) + "\n", missing


def _command(lib: str, script: Path, nproc: int) -> list[str]:
    python = str(VENV / "bin" / "python")
    if script.name in PLAIN_PYTHON:
        return [python, str(script)]
    if lib == "accelerate":
        # `accelerate launch --num_processes N --cpu` starts one process (it wants --multi_gpu for
        # more); torchrun starts N, which Accelerate joins as MULTI_CPU given ACCELERATE_USE_CPU.
        return [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(script),
        ]
    return [python, "-m", "unison", "launch", "--nproc-per-node", str(nproc), "--cpu", str(script)]


def _kill_copies(script: Path) -> None:
    """Kill every process running this copy (the launcher's workers may sit in sessions of their own)."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if str(script) in (proc_dir / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _read_rows(run_dir: Path) -> dict[str, list[dict]]:
    rows = {}
    for path in sorted(run_dir.glob("rank*.jsonl")):
        rows[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def run_cases(lib: str, script: Path, nproc: int, numerics: str | None, timeout: float, log) -> dict:
    """Launch the script until every case ran; return each case's result in order."""
    ranks = 1 if script.name in PLAIN_PYTHON else nproc
    cases: list[dict] = []
    start, launches, seconds, note = 0, 0, 0.0, ""
    while True:
        run_dir = Path(tempfile.mkdtemp(prefix="acc_h_"))
        env = dict(os.environ, HARNESS_DIR=str(run_dir), HARNESS_START=str(start), OMP_NUM_THREADS="1")
        env["ACCELERATE_NUM_PROCESSES"] = str(nproc)  # test_notebook's process count
        env["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` exports: else one process each
        env.pop("UNISON_NUMERICS", None)
        if numerics:
            env["UNISON_NUMERICS"] = numerics
        began = time.perf_counter()
        with open(run_dir / "output", "wb") as out:
            proc = subprocess.Popen(
                _command(lib, script, nproc),
                cwd=script.parent,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
                hung = False
            except subprocess.TimeoutExpired:
                _kill_copies(script)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                hung = True
        output = (run_dir / "output").read_bytes()
        seconds += time.perf_counter() - began
        launches += 1
        log.write(
            f"\n===== {lib} {script.name} nproc={nproc} numerics={numerics} start={start}"
            f" rc={proc.returncode}\n"
        )
        log.write(output.decode(errors="replace")[-20000:])
        rows = _read_rows(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        by_index: dict[int, dict] = {}
        for rank_rows in rows.values():
            for row in rank_rows:
                entry = by_index.setdefault(row["index"], {"name": row["name"], "events": []})
                entry["events"].append(row)
        failed_at = None
        for index in sorted(by_index):
            entry = by_index[index]
            passes = sum(1 for e in entry["events"] if e["event"] == "pass")
            if passes == ranks and len(rows) == ranks:
                cases.append({"index": index, "name": entry["name"], "passed": True})
                continue
            errors = [e["error"] for e in entry["events"] if e["event"] == "fail"]
            reason = (
                errors[0]
                if errors
                else ("hung (killed)" if hung else f"a process died (exit {proc.returncode})")
            )
            cases.append({"index": index, "name": entry["name"], "passed": False, "error": reason})
            failed_at = index
            break
        # The largest process group a case saw (1 before the script's first Accelerator and after
        # destroy_process_group), checked once some case passed.
        events = [e for entry in by_index.values() for e in entry["events"]]
        worlds = {e["world"] for e in events if "world" in e}
        passed_any = any(e["event"] == "pass" for e in events)
        if script.name not in PLAIN_PYTHON and passed_any and max(worlds) != nproc:
            raise RuntimeError(f"{lib} ran {script.name} in process groups of {sorted(worlds)}, not {nproc}")
        if failed_at is None:
            if proc.returncode != 0 or hung:
                note = f"exit {proc.returncode} outside any case after {len(cases)} cases" + (
                    " (hung)" if hung else ""
                )
                tail = output.decode(errors="replace").strip().splitlines()[-3:]
                note += ": " + " | ".join(tail)[-400:]
            break
        start = failed_at + 1
    return {"cases": cases, "launches": launches, "seconds": round(seconds, 1), "note": note}


def _write(out: str, version: str, results: list[dict]) -> None:
    """The JSON report, rewritten after each row so that an interrupted run keeps what it measured."""
    total = {key: sum(r["counts"][key] for r in results) for key in results[0]["counts"]} if results else {}
    report = {
        "what": "Accelerate's test scripts: cases passing on Accelerate and, of those, on unison",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "accelerate": version,
        "torch": subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip(),
        "total": total,
        "results": results,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), help="script file names")
    parser.add_argument(
        "--nprocs", nargs="*", type=int, default=None, help="process counts (default: per script)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a launch counts as hung")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/accelerate_test_scripts.json"))
    parser.add_argument("--log", default="/tmp/accelerate_test_scripts.log", help="every launch's output")
    args = parser.parse_args()

    if not (VENV / "bin" / "accelerate").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "accelerate"], check=True)
    found = subprocess.run(
        [
            str(VENV / "bin" / "python"),
            "-c",
            "import accelerate, os; print(accelerate.__version__);"
            "print(os.path.dirname(accelerate.__file__))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    version, package_dir = found[0], Path(found[1])
    source_dir = package_dir / "test_utils" / "scripts"

    work = Path(tempfile.mkdtemp(prefix="accelerate_test_scripts_"))
    results = []
    with open(args.log, "w") as log:
        for name in args.scripts:
            source = (source_dir / name).read_text()
            copies = {}
            missing = []
            for lib in ("accelerate", "unison"):
                text, lacks = instrument(source, for_unison=lib == "unison")
                missing += lacks
                (work / lib).mkdir(exist_ok=True)
                copies[lib] = work / lib / name
                copies[lib].write_text(text)
            for nproc in args.nprocs or SCRIPTS.get(name, (2,)):
                row = {"script": name, "nproc": nproc, "unison_lacks": missing}
                for column, lib, numerics in (
                    ("accelerate", "accelerate", None),
                    ("unison", "unison", None),
                    ("unison_numerics_accelerate", "unison", "accelerate"),
                ):
                    row[column] = run_cases(lib, copies[lib], nproc, numerics, args.timeout, log)
                    log.flush()
                # by index: a script may call one check several times (the same name, another case)
                passed_acc = {c["index"] for c in row["accelerate"]["cases"] if c["passed"]}
                row["counts"] = {
                    "cases": len(row["accelerate"]["cases"]),
                    "accelerate": len(passed_acc),
                    **{
                        column: sum(
                            1 for c in row[column]["cases"] if c["passed"] and c["index"] in passed_acc
                        )
                        for column in ("unison", "unison_numerics_accelerate")
                    },
                }
                results.append(row)
                _write(args.out, version, results)
                counts = row["counts"]
                print(
                    f"{name:32s} {nproc}  cases {counts['cases']:3d}  accelerate {counts['accelerate']:3d}  "
                    f"unison {counts['unison']:3d}  "
                    f"unison+numerics {counts['unison_numerics_accelerate']:3d}",
                    flush=True,
                )

    total = {key: sum(r["counts"][key] for r in results) for key in results[0]["counts"]} if results else {}
    print(
        "\n| script | processes | cases | pass on Accelerate | of those on unison"
        " | of those, UNISON_NUMERICS=accelerate |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        c = r["counts"]
        print(
            f"| {r['script']} | {r['nproc']} | {c['cases']} | {c['accelerate']} | {c['unison']} | "
            f"{c['unison_numerics_accelerate']} |"
        )
    if total:
        print(
            f"| total | | {total['cases']} | {total['accelerate']} | {total['unison']} | "
            f"{total['unison_numerics_accelerate']} |"
        )
    print("\nCases passing on Accelerate that fail on unison (default numerics):")
    for r in results:
        passed_acc = {c["name"] for c in r["accelerate"]["cases"] if c["passed"]}
        for c in r["unison"]["cases"]:
            if not c["passed"] and c["name"] in passed_acc:
                print(f"  {r['script']} x{r['nproc']}: {c['name']}: {c['error'][:160]}")
    _write(args.out, version, results)
    print(f"\nwrote {args.out}; every launch's output in {args.log}")


if __name__ == "__main__":
    main()
