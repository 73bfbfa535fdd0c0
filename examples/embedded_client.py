"""Embed fedgrid clients in a host program.

Starts a coordinator in a background thread (as an operator would start
`fedgrid coordinator`), then joins it with two clients built from plain PyTorch objects,
each running in a background thread of this program. Run: python examples/embedded_client.py
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.cli import serve
from fedgrid.client import TorchClient, start_client
from fedgrid.config import load_config
from fedgrid.simulation.datasets import load_digits, partition_iid

ROUNDS = 3

# --- the coordinator (normally its own process: `fedgrid coordinator ...`) -------------------
run_dir = Path(tempfile.mkdtemp(prefix="fedgrid-embed-"))
config = load_config(overrides={"listen": "127.0.0.1:0", "rounds": ROUNDS, "min_clients": 2, "out": str(run_dir)})
ready = threading.Event()
server = threading.Thread(target=serve, kwargs={"config": config, "ready": ready}, daemon=True)
server.start()
ready.wait(timeout=60)
address = (run_dir / "address").read_text().strip()

# --- the host program's side: a model, data, a loss and an optimizer factory ----------------
data = load_digits()
handles = []
for i, part in enumerate(partition_iid(len(data.y_train), 2, seed=0)):
    idx = torch.from_numpy(part)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))  # the coordinator's model
    loader = DataLoader(TensorDataset(data.x_train[idx], data.y_train[idx]), batch_size=32, shuffle=True)
    client = TorchClient(model, loader, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), name=f"site-{i}")
    handles.append(start_client(client, coordinator=address))  # trains in a background thread

for handle in handles:
    print(f"client finished after {handle.join(timeout=300).rounds} rounds")
server.join(timeout=60)
print((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
