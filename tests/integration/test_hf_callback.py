"""``fedgrid.integrations.transformers.FederatedCallback``: Hugging Face's ``Trainer`` and TRL's
``SFTTrainer`` as clients of a real gRPC coordinator (``fedgrid coordinator --model hf:PATH``, no
dataset: the sites bring theirs), two sites each in threads of this process. FedAvg ends with
both sites holding the coordinator's final model bit for bit; LoRA under DiLoCo puts only the
adapters on the wire (names and bytes); a coordinator of another base model is refused at train
begin, both hashes named.

Nothing is downloaded: the tiny Llama and its character tokenizer are written by the test.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch

from fedgrid.cli import serve
from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics

from harness import THREADS, wait_until
from tiny_hf import PAIRS, char_tokenizer, instruction_jsonl, tiny_llama_folder, token_rows

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LORA_TARGETS = ("q_proj", "v_proj")
PEFT = "lora:r=4,alpha=8,targets=q_proj,v_proj"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("models") / "tiny-llama")


class _Coordinator:
    """``fedgrid coordinator`` (``serve``) in a thread on port 0."""

    def __init__(self, out: Path, **overrides) -> None:
        self.config = load_config(
            overrides={
                "clients": 2,
                "min_clients": 2,
                "listen": "127.0.0.1:0",
                "threads": THREADS,
                "progress": False,
                "seed": 1,
                "out": str(out),
                **overrides,
            }
        )
        self.out = out
        self.error: list[BaseException] = []

        def run() -> None:
            try:
                serve(self.config)
            except BaseException as exc:  # the test's assertion names it
                self.error.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        address = out / "address"
        wait_until(
            lambda: self.error or (address.exists() and address.read_text().strip() != ""),
            timeout=120,
            what="address",
        )
        assert not self.error, self.error
        self.address = address.read_text().strip()

    def finish(self) -> dict[str, torch.Tensor]:
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), "the coordinator did not finish"
        assert not self.error, self.error
        return load_model(self.out / "model.safetensors")


def _sites(train, n: int = 2, timeout: float = 60) -> list:
    """Runs ``train(k)`` for each site k in a thread; returns their results (re-raises a failure)."""
    results: list = [None] * n
    errors: list = []

    def run(k: int) -> None:
        try:
            results[k] = train(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a site did not finish"
    if errors:
        raise errors[0]
    return results


def _args(out: Path, **overrides):
    from transformers import TrainingArguments

    options = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "max_steps": 100,  # the coordinator's end stops the trainer first
        "learning_rate": 0.01,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        **overrides,
    }
    return TrainingArguments(**options)


FEDAVG = {"rounds": 2, "local_epochs": 1, "fraction_evaluate": 1.0}


def _trainer(llama: Path, out: Path, rows: list, callback):
    """A plain ``Trainer`` of the tiny Llama on ``rows`` (6 rows: 3 steps of 2 per epoch)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(llama, local_files_only=True)
    return Trainer(model=model, args=_args(out), train_dataset=Dataset.from_list(rows), callbacks=[callback])


@pytest.fixture(scope="module")
def fedavg(llama, tmp_path_factory):
    """Two ``Trainer`` sites under FedAvg against a real gRPC coordinator: its final model, each
    site's (federation, steps, model state, task reports) and the run's metrics."""
    from fedgrid.integrations.transformers import FederatedCallback

    torch.set_num_threads(THREADS)
    tmp = tmp_path_factory.mktemp("fedavg")
    run = _Coordinator(tmp / "run", model=f"hf:{llama}", **FEDAVG)
    rows = token_rows(char_tokenizer())
    reports: list = [[], []]
    callbacks = [
        FederatedCallback(run.address, name=f"site-{k}", verbose=False, on_task=reports[k].append)
        for k in range(2)
    ]
    trainers = [_trainer(llama, tmp / f"site-{k}", rows[k::2], callbacks[k]) for k in range(2)]

    def train(k: int):
        trainers[k].train()
        return (
            callbacks[k].federation,
            trainers[k].state.global_step,
            trainers[k].model.state_dict(),
            reports[k],
        )

    results = _sites(train)
    return run.finish(), results, read_metrics(tmp / "run")


def test_trainer_under_fedavg_ends_with_the_coordinators_final_model(fedavg):
    final, results, metrics = fedavg
    assert [row["clients_ok"] for row in metrics] == [2, 2]
    for federation, steps, state, _ in results:
        assert federation.finished and federation.rounds == 2
        assert steps == 2 * 3  # two rounds of one epoch (3 steps); the federation stopped the trainer
        assert list(final) == ["net." + name for name in state]
        for name, tensor in state.items():  # the final aggregate merged at train end
            assert torch.equal(tensor, final["net." + name]), name
    fits = [r for _, _, _, site in results for r in site if r.kind == "fit"]
    # FedAvg weighs the sites' 6 examples each: the round's result is their mean, on the wire whole.
    assert len(fits) == 4 and all(r.num_examples == 6 for r in fits)
    whole = sum(t.numel() * t.element_size() for t in final.values())
    assert all(r.bytes_up >= whole for r in fits)


def test_a_simulated_run_of_the_same_trainers_ends_on_the_deployed_runs_bits(fedavg, llama, tmp_path):
    """The same two ``Trainer`` sites as clients of fedgrid's simulation (one process, the
    sequential engine, ``threads`` as deployed): the same final model, bit for bit, and each
    site's trainer holds it at its end."""
    from fedgrid.integrations.simulated import TrainerClient, simulate
    from fedgrid.integrations.transformers import FederatedCallback

    deployed, _, _ = fedavg
    rows = token_rows(char_tokenizer())
    trainers: dict = {}

    def site(k: int) -> TrainerClient:
        def train(connection) -> None:
            trainers[k] = _trainer(llama, tmp_path / f"site-{k}", rows[k::2], FederatedCallback(connection))
            trainers[k].train()

        return TrainerClient(train, name=f"site-{k}", num_examples=len(rows[k::2]))

    config = load_config(
        overrides={"model": f"hf:{llama}", "clients": 2, "threads": THREADS, "seed": 1, "out": "", **FEDAVG}
    )
    final, history = simulate(config, [site(0), site(1)])
    assert [m.clients_ok for m in history] == [2, 2]
    assert list(final) == list(deployed)
    for name, tensor in final.items():
        assert torch.equal(tensor, deployed[name]), name
    for k in range(2):  # each trainer trained its two rounds of 3 steps and merged the final model
        assert trainers[k].state.global_step == 2 * 3
        for name, tensor in trainers[k].model.state_dict().items():
            assert torch.equal(tensor, final["net." + name]), (k, name)


def _sft(llama: Path, out: Path, data_file: Path, callback, steps: int = 100):
    """An ``SFTTrainer`` with LoRA on the prompt/completion JSONL ``data_file`` (made here, in the
    caller's thread: ``datasets`` prepares files under a lock that two threads at once contend for)."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(llama, local_files_only=True)
    config = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=32,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    data = load_dataset("json", data_files=str(data_file), split="train")
    return SFTTrainer(
        model=model,
        args=config,
        train_dataset=data,
        processing_class=char_tokenizer(),
        peft_config=lora,
        callbacks=[callback],
    )


def _adapter_names() -> list[str]:
    prefix = "net.base_model.model.model.layers"
    return [
        f"{prefix}.{i}.self_attn.{proj}.lora_{f}.default.weight"
        for i in range(2)
        for proj in LORA_TARGETS
        for f in ("A", "B")
    ]


DILOCO = {"peft": PEFT, "strategy": "diloco", "inner_steps": 3, "rounds": 2}


@pytest.fixture(scope="module")
def sft(llama, tmp_path_factory):
    """Two ``SFTTrainer`` sites with LoRA under DiLoCo against a real gRPC coordinator: its final
    model, each site's (federation, steps, task reports) and the run's metrics."""
    from fedgrid.integrations.transformers import FederatedCallback

    torch.set_num_threads(THREADS)
    tmp = tmp_path_factory.mktemp("sft")
    run = _Coordinator(tmp / "run", model=f"hf:{llama}", **DILOCO)
    reports: list = [[], []]
    files = [instruction_jsonl(tmp / f"site-{k}.jsonl", PAIRS[k::2]) for k in range(2)]
    callbacks = [
        FederatedCallback(run.address, name=f"site-{k}", verbose=False, on_task=reports[k].append)
        for k in range(2)
    ]
    trainers = [_sft(llama, tmp / f"out-{k}", files[k], callbacks[k]) for k in range(2)]

    def train(k: int):
        trainers[k].train()
        return callbacks[k].federation, trainers[k].state.global_step, reports[k]

    results = _sites(train)
    return run.finish(), results, read_metrics(tmp / "run")


def test_sfttrainer_with_lora_under_diloco_sends_only_the_adapters(sft):
    final, results, metrics = sft
    assert list(final) == _adapter_names()
    # r=4 on 32x32 projections: A [4, 32] and B [32, 4], 128 floats each, 8 tensors: 4,096 bytes.
    assert sum(t.numel() * t.element_size() for t in final.values()) == 4096
    assert any(t.abs().sum() > 0 for n, t in final.items() if ".lora_B." in n)  # B moved off zero
    for federation, steps, _ in results:
        assert federation.finished and federation.rounds == 2 and steps == 2 * 3  # H = 3 inner steps
    fits = [r for _, _, site in results for r in site if r.kind == "fit"]
    assert len(fits) == 4
    # The adapters' 4,096 bytes with the frames' names and headers; the base's ~100 kB never travel.
    assert all(4096 < r.bytes_up < 4096 + 1500 and 4096 < r.bytes_down < 4096 + 1500 for r in fits), fits
    assert [row["clients_ok"] for row in metrics] == [2, 2]


def test_a_simulated_sfttrainer_run_with_lora_under_diloco_ends_on_the_deployed_runs_bits(
    sft, llama, tmp_path
):
    from fedgrid.integrations.simulated import TrainerClient, simulate
    from fedgrid.integrations.transformers import FederatedCallback

    deployed = sft[0]
    files = [instruction_jsonl(tmp_path / f"site-{k}.jsonl", PAIRS[k::2]) for k in range(2)]
    trainers: dict = {}

    def site(k: int) -> TrainerClient:
        def train(connection) -> None:
            trainers[k] = _sft(llama, tmp_path / f"out-{k}", files[k], FederatedCallback(connection))
            trainers[k].train()

        return TrainerClient(train, name=f"site-{k}", num_examples=len(PAIRS[k::2]))

    config = load_config(
        overrides={"model": f"hf:{llama}", "clients": 2, "threads": THREADS, "seed": 1, "out": "", **DILOCO}
    )
    final, history = simulate(config, [site(0), site(1)])
    assert [m.clients_ok for m in history] == [2, 2]
    assert list(final) == _adapter_names()
    for name, tensor in final.items():
        assert torch.equal(tensor, deployed[name]), name
    assert [trainers[k].state.global_step for k in range(2)] == [2 * 3, 2 * 3]


def test_a_callback_at_a_coordinator_of_another_base_fails_at_train_begin_naming_both_hashes(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from fedgrid.integrations.federation import wire_model
    from fedgrid.integrations.transformers import FederatedCallback

    other = tiny_llama_folder(tmp_path / "other-llama", seed=1)  # the same architecture, other weights
    run = _Coordinator(
        tmp_path / "run",
        model=f"hf:{other}",
        peft=PEFT,
        strategy="diloco",
        inner_steps=3,
        min_clients=1,
        rounds=1,
    )
    data = instruction_jsonl(tmp_path / "site.jsonl")
    callback = FederatedCallback(run.address, name="site-0", verbose=False, connect_timeout=20)
    trainer = _sft(llama, tmp_path / "out", data, callback)
    with pytest.raises(Exception) as info:
        trainer.train()
    text = str(info.value)
    from peft import LoraConfig, get_peft_model

    ours = wire_model(
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(llama, local_files_only=True),
            LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS)),
        )
    ).base_hash
    theirs = wire_model(
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(other, local_files_only=True),
            LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS)),
        )
    ).base_hash
    assert ours != theirs and ours in text and theirs in text, text
    assert callback.federation.rounds == 0 and callback.federation.session is None


def _held_port() -> socket.socket:
    """A listening socket on a port the kernel handed out for port 0, held for the launch.

    Given a port in use, ``accelerate launch`` starts torchrun standalone, whose rendezvous binds
    port 0 itself. A free port picked here and closed could be taken by another test's process
    before torchrun bound it (EADDRINUSE, seen in CI); a held one cannot be mistaken for free."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_a_trainer_under_accelerate_launch_with_two_processes_agrees_on_every_rank(llama, tmp_path):
    import os
    import subprocess
    import sys

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer

    from fedgrid.integrations.transformers import FederatedCallback

    torch.set_num_threads(THREADS)
    run = _Coordinator(tmp_path / "run", model=f"hf:{llama}", rounds=2, local_epochs=1, fraction_evaluate=1.0)
    support = Path(__file__).resolve().parents[1] / "support"
    out = tmp_path / "ddp"
    out.mkdir()
    held = _held_port()
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--num_cpu_threads_per_process", "1", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(held.getsockname()[1]), str(support / "hf_ddp_site.py"), str(llama), run.address, str(out),
    ]  # fmt: skip  # --multi_gpu: torchrun's launcher (gloo here: use_cpu); --cpu runs one process
    # The ranks import the fedgrid under test (a PYTHONPATH of sources first stays first).
    path = os.pathsep.join(p for p in (str(support), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    ddp = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    model = AutoModelForCausalLM.from_pretrained(llama, local_files_only=True)
    callback = FederatedCallback(run.address, name="site-1", verbose=False)
    rows = token_rows(char_tokenizer())[1::2]
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "site-1"),
        train_dataset=Dataset.from_list(rows),
        callbacks=[callback],
    )
    site = threading.Thread(target=trainer.train, daemon=True)
    site.start()
    try:  # the thread waits for the other site: a launch that fails must end the wait
        wait_until(lambda: not site.is_alive() or ddp.poll() not in (None, 0), timeout=180, what="the sites")
        log, _ = ddp.communicate(timeout=120)
    finally:
        ddp.kill()
        held.close()
    assert ddp.returncode == 0, log[-4000:]
    final = run.finish()
    assert [row["clients_ok"] for row in read_metrics(tmp_path / "run")] == [2, 2]
    for rank in range(2):  # both ranks trained the two rounds and hold the final aggregate
        assert (out / f"rank-{rank}.steps").read_text() == "6 2"
        state = load_model(out / f"rank-{rank}.safetensors")
        for name, tensor in state.items():
            assert torch.equal(tensor, final["net." + name]), (rank, name)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, final["net." + name]), name


def test_overlapped_diloco_uploads_then_trains_tau_steps_before_the_merge(llama, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer

    from fedgrid.integrations.transformers import FederatedCallback

    torch.set_num_threads(THREADS)
    run = _Coordinator(
        tmp_path / "run", model=f"hf:{llama}", strategy="diloco", inner_steps=3, sync_delay_steps=1, rounds=2
    )
    rows = token_rows(char_tokenizer())
    callbacks = [FederatedCallback(run.address, name=f"site-{k}", verbose=False) for k in range(2)]
    trainers = [
        Trainer(
            model=AutoModelForCausalLM.from_pretrained(llama, local_files_only=True),
            args=_args(tmp_path / f"site-{k}"),
            train_dataset=Dataset.from_list(rows[k::2]),
            callbacks=[callbacks[k]],
        )
        for k in range(2)
    ]
    _sites(lambda k: trainers[k].train())
    run.finish()
    assert [row["clients_ok"] for row in read_metrics(tmp_path / "run")] == [2, 2]
    for callback, trainer in zip(callbacks, trainers):
        # Round 1: 3 steps, the upload, 1 step while it travels, the merge; round 2: 2 more steps
        # (the one trained during the sync counts), the upload, 1 step; then the run's end.
        assert callback.federation.finished and callback.federation.rounds == 2
        assert trainer.state.global_step == 2 * 3 + 1
