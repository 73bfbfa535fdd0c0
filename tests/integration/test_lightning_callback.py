"""``fedgrid.integrations.lightning.FederatedCallback``: Lightning's ``Trainer`` as a client of a real
gRPC coordinator (``--model lightning_site:model``, a factory of the ``LightningModule``), two sites
in threads under FedAvg. Each round's model is the mean of the sites' uploads weighted by their
examples; both sites end with the coordinator's final model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from fedgrid.cli import serve
from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics

from harness import THREADS, wait_until
from lightning_site import model as build_module
from lightning_site import site_data

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_lightning_under_fedavg_averages_the_sites_and_ends_on_the_final_model(tmp_path: Path):
    import lightning as L

    from fedgrid.integrations.lightning import FederatedCallback

    torch.set_num_threads(THREADS)
    config = load_config(
        overrides={
            "model": "lightning_site:model",
            "clients": 2,
            "min_clients": 2,
            "rounds": 2,
            "local_epochs": 1,
            "fraction_evaluate": 1.0,
            "listen": "127.0.0.1:0",
            "threads": THREADS,
            "progress": False,
            "out": str(tmp_path / "run"),
        }
    )
    coordinator = threading.Thread(target=serve, args=(config,), daemon=True)
    coordinator.start()
    address = tmp_path / "run" / "address"
    wait_until(lambda: address.exists() and address.read_text().strip() != "", timeout=60, what="address")
    uploads: list = [[], []]
    modules = [build_module() for _ in range(2)]
    callbacks = []
    for k in range(2):
        callback = FederatedCallback(address.read_text().strip(), name=f"site-{k}", verbose=False)
        real_upload = callback.federation._upload

        def spy(real=real_upload, k=k, callback=callback):  # what each round sends, as trained
            uploads[k].append(callback.federation._state())
            real()

        callback.federation._upload = spy
        callbacks.append(callback)
    sizes = [16, 8]  # batches of 4: 4 and 2 steps per round

    def train(k: int) -> None:
        loader = torch.utils.data.DataLoader(site_data(k, sizes[k]), batch_size=4)
        trainer = L.Trainer(
            max_steps=100,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callbacks[k]],
        )
        trainer.fit(modules[k], loader)
        steps[k] = trainer.global_step

    steps = [0, 0]
    sites = [threading.Thread(target=train, args=(k,), daemon=True) for k in range(2)]
    for site in sites:
        site.start()
    for site in sites:
        site.join(120)
    assert not any(site.is_alive() for site in sites), "a site did not finish"
    coordinator.join(60)
    assert not coordinator.is_alive()
    final = load_model(tmp_path / "run" / "model.safetensors")
    assert [row["clients_ok"] for row in read_metrics(tmp_path / "run")] == [2, 2]
    assert steps == [2 * 4, 2 * 2]  # two rounds of one epoch each
    # FedAvg: the last round's model is the mean of the uploads weighted by 16 and 8 examples.
    for name, tensor in final.items():
        expected = (16 * uploads[0][-1][name] + 8 * uploads[1][-1][name]) / 24
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-7)
    for k in range(2):
        assert callbacks[k].federation.rounds == 2 and callbacks[k].federation.finished
        for name, tensor in modules[k].state_dict().items():
            assert torch.equal(tensor, final[name]), (k, name)
