"""The one shared "who am I" state of a process: rank, device, backend and the process group.

`PartialState` is usable on its own (inference, data preparation); `AcceleratorState` adds the
training settings an `Accelerator` was built with; `GradientState` says whether this micro-step
synchronises gradients. Each is a Borg: every instance of a class shares one dictionary, so any
module can ask "am I the main process?" cheaply without the state being passed around.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import functools
import gc
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import env_vars, network
from .accelerate_surface.names import mirror
from .env_vars import DEFAULT_FIRST_STEP_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS, validate_mixed_precision
from .environment import ProcessLayout, detect_layout
from .health.failure import end_fast_on_uncaught_error
from .health.watchdog import Watchdog
from .parallel.engines import release_dtensor_caches
from .splitting import split_for_process

logger = logging.getLogger("unison")

BACKSTOP_SECONDS = 60.0
"""The process group's own timeout is the watchdog's limit plus this: it ends the waits the watchdog
cannot see (collectives torch issues from C++, other than DDP's in backward: health/position.py)."""


class DistributedType(str, enum.Enum):
    """How the processes of a run cooperate (all of Accelerate's names, so that a script's comparisons
    with any of them are False rather than an AttributeError).

    unison reports NO, MULTI_CPU or MULTI_GPU: its layouts (ZeRO/FSDP2, tensor, pipeline) are described
    by `Accelerator.parallelism`, not by this type, and the other devices and engines are not run.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        timeout = env_vars.env_float(env_vars.TIMEOUT, DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout={timeout!r} is a {type(timeout).__name__}: pass the collectives' timeout as a number "
            "of seconds or a datetime.timedelta, e.g. timeout=600 or timeout=timedelta(minutes=10)."
        )
    if not 0 < timeout < math.inf:
        raise ValueError(
            f"timeout={timeout!r} seconds is not allowed: collectives need a finite, positive timeout "
            "so a stuck process cannot hang the others forever. Pass e.g. timeout=600."
        )
    return timedelta(seconds=float(timeout))


def _pick_device(layout: ProcessLayout, cpu: bool) -> tuple[torch.device, str]:
    """Device and process-group backend: this process's GPU + NCCL (cuda:LOCAL_RANK, or cuda:0 where the
    launcher gave each process one GPU: ProcessLayout.cuda_index), else MPS (one process), else CPU + gloo."""
    if not cpu and torch.cuda.is_available():
        index = layout.cuda_index(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        return torch.device("cuda", index), "nccl"
    if not cpu and layout.world_size == 1 and torch.backends.mps.is_available():
        return torch.device("mps"), "gloo"
    return torch.device("cpu"), "gloo"


def _rendezvous_store(layout: ProcessLayout, timeout: timedelta) -> dist.Store:
    """The key-value store the process group forms through.

    Under torchrun the elastic agent already hosts a TCPStore on MASTER_PORT, and after a restart it
    still holds the keys of the failed attempt (pytorch#135712): namespacing the group's keys by the
    restart count lets a restarted attempt form a fresh group. Under SLURM, rank 0 hosts the store.
    """
    store = dist.TCPStore(
        host_name=layout.master_addr,
        port=layout.master_port,
        world_size=None if _agent_serves_the_store() else layout.world_size,
        is_master=_hosts_the_store(layout),
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(_attempt_prefix(), store)


def _agent_serves_the_store() -> bool:
    """Whether torchrun's agent serves the rendezvous store (it outlives restart attempts)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _hosts_the_store(layout: ProcessLayout) -> bool:
    """Whether this process serves the rendezvous store: rank 0, unless torchrun's agent serves it."""
    return layout.rank == 0 and not _agent_serves_the_store()


def _socket_interface(layout: ProcessLayout) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for a group srun or mpirun started across nodes (under
    `unison launch` the launcher sets them): the interface this node reaches the rendezvous host
    through, as `unison launch` chooses (network.choose_interface); a variable already set wins. Left to
    themselves, gloo binds the address the host name resolves to, often 127.0.1.1, and the nodes never
    connect. Rank 0 says which interface its node chose."""
    if layout.source not in ("slurm", "mpi") or layout.world_size == layout.local_world_size:
        return {}
    choice = network.choose_interface(layout.master_addr)
    chosen = network.socket_interface_environment(choice, os.environ)
    if chosen and layout.rank == 0:
        logger.info(
            "unison: gloo/NCCL sockets use network interface %s, which holds %s (%s); export "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose another.",
            choice.name,
            choice.address,
            choice.reason,
        )
    return chosen


def _attempt_prefix() -> str:
    """The store keys of this restart attempt.

    Only a store that outlives the attempt needs them namespaced: the agent's under the static rendezvous,
    where every node restarts together and torch's agents count the same attempts. Anywhere else the store
    is new with each attempt (rank 0 serves it: c10d rendezvous, whose launcher sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, srun, mpirun), and the count must not be used: torch's agents
    count restarts per node (one after a worker failure, none when another node is waiting), so after a
    node was lost the survivors met under attempt0/ and attempt1/ and never formed a group
    (tests/test_three_nodes.py)."""
    if not _agent_serves_the_store():
        return "unison/"
    return f"unison/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def debug_mode() -> bool:
    """`unison launch --debug` / UNISON_DEBUG=1 (or Accelerate's ACCELERATE_DEBUG_MODE): every collective
    is checked across ranks before it runs (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, and unison's ops
    compare their inputs' shapes), so ranks that call different collectives fail at once, on every rank.

    The starting value of `PartialState.debug`, which the ops read afterwards (a script may switch it)."""
    return env_vars.env_bool(env_vars.DEBUG, False) or env_vars.env_bool("ACCELERATE_DEBUG_MODE", False)


def _end_with_the_launcher() -> None:
    """Under torchrun / `unison launch` on Linux, have the kernel SIGKILL this worker when its launcher dies.

    torch's elastic agent starts each worker in a session of its own, so when the agent itself is
    killed (SIGKILL, the OOM killer, a scheduler's kill) the workers would live on as orphans: still
    training, still writing checkpoints, racing the restarted job. PR_SET_PDEATHSIG ties each worker
    to the agent that started it. The launcher's pid comes from `unison launch` (env_vars.LAUNCHER_PID),
    fixed when it started the workers: read here instead, the parent pid may already be init's (or a
    subreaper's) if the launcher was killed while this worker was still importing, and the check would pass.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    exported = os.environ.get(env_vars.LAUNCHER_PID, "")
    launcher = int(exported) if exported.isdigit() else os.getppid()  # plain torchrun: the best we know
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the line above took effect
        print(f"unison: the launcher (pid {launcher}) is gone; this worker ends.", file=sys.stderr)
        os._exit(1)


def import_group_defaults_before_the_group() -> None:
    """Import torch.distributed.nn.functional while no process group exists (12 ms here).

    Its functions take `group=group.WORLD` as default arguments, evaluated at import. torch imports it
    lazily (with torch.distributed.checkpoint, and with torch._inductor, which the profiler and
    torch.compile import; the DDP step of tests/workers/group_release_worker.py does too); imported after
    the group formed, those
    defaults hold the group object until the interpreter ends, so destroy_process_group (the script's or
    ours at exit) no longer frees it and gloo's worker threads outlive the script. One of them can then
    release a finished collective's tensors after the interpreter began its teardown: it needs the GIL
    there, CPython ends the thread with pthread_exit, and the unwinding aborts the process ("terminate
    called without an active exception", SIGABRT, after all the work is done; docs/failures.md).
    Imported first, the defaults are None: the default group at call time, as torch means them.
    """
    import torch.distributed.nn.functional  # noqa: F401


def destroy_process_group_at_exit() -> None:
    """At exit, while the interpreter is whole: free what still holds communication state, then the groups.

    Models, FSDP2 states and pipeline schedules left in reference cycles would otherwise be freed by
    the interpreter's final collection, after the process groups and half-way through teardown, where
    gloo's C++ objects can abort the process ("terminate called without an active exception", SIGABRT)
    after all work is done: seen in about 1 of 10 pipeline launches under load. Collecting first
    frees them in the normal way (pytorch PR #179291 describes the teardown race).

    What survives that collection is reachable until the interpreter ends; gc.freeze() keeps the
    interpreter's teardown collections from walking it again (torch and its compiler stack: some 300,000
    objects): a process then ends 0.7 s sooner, measured on the 2-core build machine (0.9 s -> 0.15 s of
    teardown). Objects made later, by atexit handlers that run after this one, are collected as usual.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    release_dtensor_caches()  # also when the script destroyed the group itself
    gc.collect()
    gc.freeze()


class PartialState:
    """Process facts and the process group, shared by every instance in the process.

    The first construction detects the environment (torchrun / `unison launch`, mpirun, SLURM srun, or
    plain python; docs/launchers.md), picks the device and backend, forms the process group once and
    starts the hang watchdog (`timeout` is its stall timeout; docs/failures.md). Later constructions
    return the same state; asking for a different `cpu` or `timeout` then is an error rather than a
    silent no-op. A process group the script formed itself is adopted as it is, with its own timeout
    (`timeout` is then None, and asking for one is an error).
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool | None = None, timeout: float | timedelta | None = None):
        self.__dict__ = self._shared_state
        cpu_requested = env_vars.env_bool(env_vars.CPU, False) if cpu is None else bool(cpu)
        if self.initialized:
            self._check_compatible(cpu, timeout)
            return
        layout = detect_layout()
        _end_with_the_launcher()
        self.layout = layout
        # None once a process group the user formed is adopted: its own timeout is in force, not ours
        self.timeout: timedelta | None = _as_timedelta(timeout)
        self._timeout_requested = timeout is not None or env_vars.TIMEOUT in os.environ
        self.cpu = cpu_requested
        # unison's ops check their inputs across ranks while True; set at run time as in Accelerate
        # (`state.debug = True`); torch's own checks (DETAIL) follow the value the group was formed with
        self.debug = debug_mode()
        self.device, self.backend = _pick_device(layout, cpu_requested)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if layout.world_size > 1:
            self._init_process_group()
        self.distributed_type = (
            DistributedType.NO
            if layout.world_size == 1
            else DistributedType.MULTI_GPU
            if self.device.type == "cuda"
            else DistributedType.MULTI_CPU
        )
        self._shared_state["initialized"] = True

    def _init_process_group(self) -> None:
        layout = self.layout
        if dist.is_initialized():  # the user formed it already: adopt it rather than fight it
            if dist.get_world_size() != layout.world_size:
                raise RuntimeError(
                    f"a process group of {dist.get_world_size()} processes already exists but the "
                    f"environment says {layout.world_size}; create it with the launcher's WORLD_SIZE or let "
                    "unison do it."
                )
            if self._timeout_requested:
                raise ValueError(
                    f"timeout={self.timeout.total_seconds():g} s cannot apply: the process group already "
                    "exists (dist.init_process_group ran before unison), with the timeout it was given "
                    "there. Pass timeout= to init_process_group, or leave the group to unison."
                )
            self.backend = dist.get_backend()
            self.timeout = None
            end_fast_on_uncaught_error(str(layout.rank), None)  # a crash must not leave the peers waiting
            return
        kwargs: dict[str, Any] = {}
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        if self.debug:
            dist.set_debug_level(dist.DebugLevel.DETAIL)  # torch checks every collective across ranks
        import_group_defaults_before_the_group()
        os.environ.update(_socket_interface(layout))
        first_step = (
            self.timeout if self._timeout_requested else timedelta(seconds=DEFAULT_FIRST_STEP_TIMEOUT_SECONDS)
        )
        store = _rendezvous_store(layout, first_step)
        dist.init_process_group(
            backend=self.backend,
            store=store,
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=max(first_step, self.timeout) + timedelta(seconds=BACKSTOP_SECONDS),
            **kwargs,
        )
        watchdog = Watchdog.connect(
            layout.master_addr,
            layout.master_port,
            _attempt_prefix(),
            layout.rank,
            layout.world_size,
            timeout=self.timeout.total_seconds(),
            first_timeout=first_step.total_seconds(),
            served_store=store if _hosts_the_store(layout) else None,
        )
        watchdog.start()
        # runs before the watchdog's exit note (atexit: last in, first out)
        atexit.register(destroy_process_group_at_exit)
        end_fast_on_uncaught_error(str(layout.rank), watchdog)

    def _check_compatible(self, cpu: bool | None, timeout: float | timedelta | None) -> None:
        if cpu is not None and bool(cpu) != self.cpu:
            raise ValueError(
                f"cpu={cpu} conflicts with the existing process state (cpu={self.cpu}, device "
                f"{self.device}): the device is chosen once per process. Create the first "
                "PartialState/Accelerator with the setting you want."
            )
        if timeout is not None and self.timeout is None:
            raise ValueError(
                f"timeout={timeout} cannot apply: this process adopted a process group formed by "
                "dist.init_process_group, whose own timeout is in force. Pass it there."
            )
        if timeout is not None and _as_timedelta(timeout) != self.timeout:
            raise ValueError(
                f"timeout={timeout} conflicts with the existing process group's timeout "
                f"({self.timeout.total_seconds():g} s): the group is formed once per process. Pass the "
                "timeout to the first PartialState/Accelerator."
            )

    @property
    def initialized(self) -> bool:
        return self._shared_state.get("initialized", False)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (tests only). Does not destroy the process group."""
        cls._shared_state.clear()

    # -- who am I ------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.layout.world_size

    @property
    def process_index(self) -> int:
        return self.layout.rank

    @property
    def local_process_index(self) -> int:
        return self.layout.local_rank

    @property
    def num_local_processes(self) -> int:
        return self.layout.local_world_size

    @property
    def use_distributed(self) -> bool:
        return self.layout.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    # -- coordination --------------------------------------------------------------------------
    def wait_for_everyone(self, name: str | None = None) -> None:
        """Barrier: every process waits here until all have arrived (no-op with one process).

        `name` labels the barrier in a hang report: "ranks [0, 2] wait in wait_for_everyone('after-eval'),
        rank 1 never arrived: it is at eval.py:30". The watchdog reads it from this frame (position.py).
        """
        if self.use_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def _go_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def main_process_first(self):
        """Context manager: the main process runs the block first (e.g. a download), then the others."""
        return self._go_first(self.is_main_process)

    def local_main_process_first(self):
        """Context manager: each node's local main process runs the block first, then the others."""
        return self._go_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of `inputs` (list, tuple, tensor, or dict of those).

        The first `len % num_processes` processes get one extra item. With apply_padding, shorter
        shares are padded with the last item so every process holds the same length (for gather).
        """
        yield split_for_process(inputs, self.num_processes, self.process_index, apply_padding)

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process only (returns None elsewhere)."""
        return self._only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on each node's local main process only."""
        return self._only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the last process only."""
        return self._only_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int = 0) -> Callable:
        """Decorator: run `function` on the process with this index only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int = 0) -> Callable:
        """Decorator: run `function` on the process with this index within each node only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(function, lambda: self.local_process_index == local_process_index)

    def destroy_process_group(self, group: dist.ProcessGroup | None = None) -> None:
        """Destroy `group` (default: every group, ending this process's collectives), as at exit."""
        _end_process_group(group)

    @staticmethod
    def _only_if(function: Callable, condition: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs) if condition() else None

        return wrapper

    def print(self, *args, **kwargs) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        """Every PartialState of a process holds the same state, so two are equal when their facts are:
        an Accelerator pickled and loaded back (a DataLoader worker's copy) equals the one it came from."""
        if not isinstance(other, PartialState):
            return NotImplemented
        return self.__dict__ is other.__dict__ or self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(PartialState)  # equal objects hash alike; a process has one state anyway

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )


def _end_process_group(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)
    if group is None:
        release_dtensor_caches()


class GradientState:
    """Whether this micro-step synchronises gradients, and where the active data loader stands.

    Shared by the Accelerator (which decides when to sync) and the prepared data loaders (which know
    when they yield their last batch, so the last micro-step of an epoch always synchronises and
    gather_for_metrics can drop the duplicated samples of the final round). completed_passes: what each
    prepared loader's latest complete pass dealt the processes (data.top_ups), for gather_for_metrics
    called after the loop.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_steps: int | None = None):
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self.num_steps = 1
            self.sync_gradients = True
            self.active_dataloaders: list[Any] = []
            self.completed_passes: dict[int, Any] = {}
        if gradient_accumulation_steps is not None:
            self.num_steps = gradient_accumulation_steps

    @property
    def active_dataloader(self) -> Any | None:
        return self.active_dataloaders[-1] if self.active_dataloaders else None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Rows of the final gathered batch that are real data (-1: no padding to drop)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.remainder

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active_dataloaders)

    def _add_dataloader(self, loader: Any) -> None:
        self.active_dataloaders.append(loader)

    def _remove_dataloader(self, loader: Any) -> None:
        if loader in self.active_dataloaders:
            self.active_dataloaders.remove(loader)

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()


class AcceleratorState:
    """PartialState plus the training settings of the process's Accelerator (one set per process).

    `fsdp_plugin` / `deepspeed_plugin`: the plugin object the latest Accelerator was given (in code or by
    `unison launch --use_fsdp ...`) and runs on torch's engines, as Accelerate's state shows it (the
    Accelerator sets them); None without one. `megatron_lm_plugin` is always None (Megatron-LM is not run).
    """

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool | None = None,
        timeout: float | timedelta | None = None,
    ):
        self.__dict__ = self._shared_state
        self.partial = PartialState(cpu=cpu, timeout=timeout)
        if mixed_precision is not None:
            mixed_precision = validate_mixed_precision(mixed_precision)
        if self._shared_state.get("initialized"):
            if mixed_precision is not None and mixed_precision != self.mixed_precision:
                raise ValueError(
                    f"mixed_precision={mixed_precision!r} conflicts with the existing Accelerator's "
                    f"mixed_precision={self.mixed_precision!r}: one process trains with one precision. "
                    "Create a single Accelerator, or pass the same value to both."
                )
            return
        if mixed_precision is None:
            mixed_precision = validate_mixed_precision(env_vars.env_str(env_vars.MIXED_PRECISION, "no"))
        self.mixed_precision = mixed_precision
        self.fsdp_plugin: Any = None
        self.deepspeed_plugin: Any = None
        self.megatron_lm_plugin: Any = None
        self.initialized = True

    def __repr__(self) -> str:
        """PartialState's lines and the precision, as Accelerate's state reads in a script's log
        (transformers' *_no_trainer scripts log it first thing)."""
        if "partial" not in self.__dict__:
            return "AcceleratorState (empty: no Accelerator since the last reset)"
        return f"{self.partial!r}\nMixed precision type: {self.mixed_precision}\n"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if "partial" not in self.__dict__:
            raise AttributeError(
                f"`AcceleratorState` object has no attribute `{name}`: the shared state is empty. This "
                "happens if `AcceleratorState._reset_state()` was called after the Accelerator was built "
                "(or no Accelerator was built yet): build the Accelerator again before using it."
            )
        return getattr(self.partial, name)

    @property
    def debug(self) -> bool:
        """PartialState's switch (one per process): setting it here reaches the ops as well."""
        return self.partial.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.partial.debug = bool(value)

    def destroy_process_group(self, group: dist.ProcessGroup | None = None) -> None:
        """Destroy `group` (default: every group), as PartialState's does. Defined here, not read from the
        shared state, so that it also works after `_reset_state()` (Accelerate's test scripts reset the
        state, then end the group through the state object they kept)."""
        _end_process_group(group)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the training settings (tests only), and with reset_partial_state the process facts too
        (Accelerate's argument); the process group stays."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def wait_for_everyone(name: str | None = None) -> None:
    """Barrier over every process (accelerate.utils.wait_for_everyone); a no-op in one process. `name`
    labels it in a hang report."""
    PartialState().wait_for_everyone(name)


# Accelerate's other names of accelerate.state (its probes, GradientAccumulationPlugin, ...)
__getattr__, __dir__, _ = mirror(__name__, globals())
