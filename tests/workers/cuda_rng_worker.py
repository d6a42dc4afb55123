"""Launched by tests/test_cuda.py on 2+ GPUs: rng_types=["cuda"] gives every process the CUDA generator
state process 0 computes with. Each process seeds differently and process 0 draws on its device first
(so its device's state differs from the state of its other devices); after the synchronised loader
starts, every process draws the same numbers. Process r writes OUT_DIR/rank{r}.json."""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from unison import PartialState
from unison.data import prepare_data_loader
from unison.random import set_seed

state = PartialState()
set_seed(100 + state.process_index)
torch.rand(5, device=state.device)  # moves this device's state away from the other devices' states
loader = prepare_data_loader(DataLoader(list(range(8)), batch_size=2), rng_types=["cuda"])
next(iter(loader))
drawn = torch.rand(3, device=state.device).tolist()
Path(sys.argv[1], f"rank{state.process_index}.json").write_text(json.dumps({"drawn": drawn}))
