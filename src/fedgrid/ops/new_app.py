"""``fedgrid new NAME``: writes a runnable app template into ``./NAME/``.

The template is a Python package ``NAME`` with a model factory and a client factory (the
``--model`` and ``--app`` of ``fedgrid simulate``, ``fedgrid coordinator`` and ``fedgrid
client``), a data split of scikit-learn's digits (no downloads), and a ``config.toml`` that
runs unchanged in simulation and in a deployment. The package is imported by name
(``NAME.app:client``), which is why NAME must be a Python identifier, and why it must not
be the name of a module that Python already finds (``json``, ``torch``): that module would
be imported instead of the app.
"""

from __future__ import annotations

import importlib.util
import keyword
from pathlib import Path
from string import Template

from fedgrid.errors import FedgridError

__all__ = ["create_app", "check_app_name", "AppNameError", "TEMPLATES"]


class AppNameError(FedgridError, ValueError):
    """NAME cannot name a new app: not an identifier, a keyword, an importable module, or taken."""


_INIT = '''"""$name: a fedgrid app (made by `fedgrid new $name`). See README.md beside this file."""
'''

_DATA = '''"""The data: scikit-learn's digits (1,797 8x8 images, 10 classes; ships with the wheel).

A fixed 80/20 train/test split, then partition ``i`` of ``n`` of each: the examples whose
position in a seeded permutation is ``i`` modulo ``n`` (IID). Replace ``load_partition`` with
your own data: a client only needs two datasets of ``(input, target)`` pairs.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2


def load_partition(partition: int, num_partitions: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Partition ``partition`` of ``num_partitions``: (train, test) datasets of (64 floats, label).

    Raises:
        ValueError: ``partition`` outside ``0 .. num_partitions - 1``.
    """
    if not 0 <= partition < num_partitions:
        raise ValueError(f"partition {partition} is outside 0..{num_partitions - 1}")
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(TEST_FRACTION * len(y))
    test, train = order[:n_test], order[n_test:]
    mine_train = torch.from_numpy(train[partition::num_partitions])
    mine_test = torch.from_numpy(test[partition::num_partitions])
    return TensorDataset(x[mine_train], y[mine_train]), TensorDataset(x[mine_test], y[mine_test])
'''

_APP = '''"""$name's model and client factory.

- ``model()`` builds the ``nn.Module`` every participant trains (``model = "$name.app:model"``
  in config.toml: the coordinator builds the initial global model from it, seeded).
- ``client(partition, num_partitions, seed, **options)`` builds one federation member
  (``app = "$name.app:client"``; ``fedgrid client --app $name.app:client --partition I/N``).
  Flags given to ``fedgrid client`` (``--batch-size 16``) arrive as keyword arguments.

The client evaluates the global model on its own test split, so ``metrics.jsonl`` reports the
federated accuracy (``fraction_evaluate`` in config.toml).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from fedgrid.client import TorchClient

from $name.data import load_partition


def model() -> nn.Module:
    """A small MLP for 8x8 digits: 64 -> 32 -> 10."""
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def client(partition: int, num_partitions: int, seed: int, *, batch_size: int = 32, lr: float = 0.1,
           momentum: float = 0.0) -> TorchClient:
    """Client ``partition`` of ``num_partitions``: SGD on its share of the digits."""
    train, test = load_partition(partition, num_partitions, seed)
    return TorchClient(
        model(),
        DataLoader(train, batch_size=batch_size, shuffle=True),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),  # the task's lr overrides lr
        eval_loader=DataLoader(test, batch_size=256),
        seed=seed,
        name=f"$name-{partition}",
    )
'''

_CONFIG = """# $name: one configuration for a simulation and a deployment. Every key can be overridden by a
# flag (--rounds 20); `fedgrid simulate --help` lists them. Run from the folder holding $name/.
#
#   fedgrid simulate --config $name/config.toml
#
#   fedgrid coordinator --config $name/config.toml
#   fedgrid client --coordinator 127.0.0.1:50051 --app $name.app:client --partition 0/3   # and 1/3, 2/3
rounds = 5
clients = 3            # simulated clients (the simulation)
min_clients = 3        # clients the coordinator waits for (the deployment)
seed = 0
model = "$name.app:model"
app = "$name.app:client"
strategy = "fedavg"
local_epochs = 1
lr = 0.1
fraction_evaluate = 1.0    # every client evaluates each new global model: metrics.jsonl's accuracy
listen = "127.0.0.1:50051"  # loopback: plaintext for development; see the docs for mutual TLS
"""

_README = """# $name

A fedgrid app made by `fedgrid new $name`: a small MLP on scikit-learn's digits, split
among the clients.

| file | what |
|---|---|
| `app.py` | `model()` and `client(partition, num_partitions, seed)`: edit these |
| `data.py` | the data split each client holds |
| `config.toml` | the run: rounds, clients, strategy, learning rate |

Run from the folder that holds `$name/` (Python imports the app as `$name.app`):

```sh
fedgrid simulate --config $name/config.toml              # all clients in this process
fedgrid coordinator --config $name/config.toml           # or deployed: the coordinator ...
fedgrid client --coordinator 127.0.0.1:50051 --app $name.app:client --partition 0/3   # ... and 1/3, 2/3
```

Each run writes a run directory (`runs/...`) with `metrics.jsonl`, `model.safetensors`
and the resolved `config.toml`.
"""

#: File name -> template (``$name`` is substituted).
TEMPLATES: dict[str, str] = {
    "__init__.py": _INIT,
    "app.py": _APP,
    "data.py": _DATA,
    "config.toml": _CONFIG,
    "README.md": _README,
}


def check_app_name(name: str) -> str:
    """Returns ``name`` if it can name a new app package.

    Raises:
        AppNameError: not a Python identifier, a keyword, or the name of a
            module Python already imports (it would shadow the app, or the app it).
    """
    if not name.isidentifier() or not name.isascii():
        raise AppNameError(
            f"app name {name!r} is not a valid Python identifier (letters, digits and _, not starting with a digit): "
            "the app is imported as NAME.app"
        )
    if keyword.iskeyword(name):
        raise AppNameError(f"app name {name!r} is a Python keyword and cannot name a package")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        raise AppNameError(
            f"app name {name!r} is already an importable module ({spec.origin or 'a namespace package'}): "
            "the app would not be the one imported; pick another name"
        )
    return name


def create_app(name: str, parent: Path | str = ".") -> Path:
    """Writes the template into ``parent/name/``; returns that folder.

    Raises:
        AppNameError: an invalid ``name`` (see ``check_app_name``), or ``parent/name`` exists
            (nothing is overwritten).
    """
    folder = Path(parent) / name
    if folder.exists() or folder.is_symlink():
        raise AppNameError(f"{str(folder)!r} already exists; fedgrid new overwrites nothing")
    check_app_name(name)
    folder.mkdir(parents=True)
    for file_name, template in TEMPLATES.items():
        (folder / file_name).write_text(Template(template).substitute(name=name))
    return folder
