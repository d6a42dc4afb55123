"""Launched by tests/test_multi_node.py. Usage: multi_node_worker.py OUT_DIR

Trains a small MLP with dropout through `Accelerator.prepare` (shuffled data, AdamW, 6 steps), fully
seeded, so the same world size gives the same parameters however the processes are spread over nodes.
Rank 0 writes the final parameters to OUT_DIR/params.pt. Every rank writes OUT_DIR/rank{R}.json: the
variables that place it (RANK, MASTER_ADDR, the socket interfaces) and where sockets listen, read from
/proc/net/tcp{,6} of its network namespace: its own listening sockets but the store's (gloo's), and
those on MASTER_PORT (the rendezvous store, hosted by the launcher's agent, or under c10d by rank 0).
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unison import Accelerator, set_seed

STEPS = 6
FEATURES, HIDDEN, OUTPUTS = 8, 16, 4


def listening(inodes: set[str] | None = None, port: int | None = None) -> list[str]:
    """'ADDRESS:PORT' of the listening TCP sockets here: those with one of `inodes`, or on `port`."""
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != "0A" or (inodes is not None and fields[9] not in inodes):
                continue  # 0A: LISTEN
            if port is not None and int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address)
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))  # per-word little endian
            if size == 4:
                host = ".".join(str(byte) for byte in words)
            else:
                host = f"[{':'.join(words[i : i + 2].hex() for i in range(0, 16, 2))}]"
            found.append(f"{host}:{int(port_hex, 16)}")
    return sorted(found)


def own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def main(out: Path) -> None:
    """Train, report, save. In a function, so the prepared model is freed before exit (module-level state
    was seen to abort the store's host at interpreter teardown: see mpi_env_worker.py)."""
    set_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(0.2), nn.Linear(HIDDEN, OUTPUTS))
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(48, FEATURES, generator=generator), torch.randn(48, OUTPUTS, generator=generator)
    )
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), DataLoader(data, batch_size=4, shuffle=True)
    )
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    seen = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    seen |= {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    store_port = int(os.environ["MASTER_PORT"])
    seen["gloo_listens"] = [
        s for s in listening(inodes=own_socket_inodes()) if not s.endswith(f":{store_port}")
    ]
    seen["store_listens"] = listening(port=store_port)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    accelerator.wait_for_everyone()  # rank 0, the store's host under c10d, ends after the others
    if accelerator.is_main_process:
        torch.save(
            {name: p.detach() for name, p in accelerator.unwrap_model(model).named_parameters()},
            out / "params.pt",
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
