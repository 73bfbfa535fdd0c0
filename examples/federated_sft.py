"""Federated instruction tuning with TRL's ``SFTTrainer`` and LoRA: two sites, one coordinator, only
the adapters on the wire.

``site`` is what a site runs: its own ``SFTTrainer`` with a ``FederatedCallback`` (the part to copy),
then ``site(...).train()``.
``main`` plays the whole federation on one machine: it writes a tiny Llama (2 layers, width 32,
a character tokenizer; nothing is downloaded), starts ``fedgrid coordinator --model hf:BASE --peft
lora:...`` under DiLoCo (``--inner-steps`` steps a round) in a thread, and trains two sites in
threads on halves of ``examples/data/instructions.jsonl`` (28 prompt/completion pairs, split by
``fedgrid.simulation.hf_data``). It prints the loss on all 28 pairs before and after, and the bytes
each site sent per round (the adapters: 4,096 bytes of tensors).

Run: ``python examples/federated_sft.py [--rounds 4] [--inner-steps 5]`` (about 30 s on 2 cores).
Returns the table from ``main``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "instructions.jsonl"


def site(coordinator: str, base: str, data, name: str, out: str, on_task=None):
    """One site: TRL's SFTTrainer with LoRA, joined to the federation by a callback; ``.train()`` joins,
    pulls the global adapters, syncs every H steps, merges the last ones and leaves."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from fedgrid.integrations.transformers import FederatedCallback

    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(base, local_files_only=True),
        processing_class=AutoTokenizer.from_pretrained(base, local_files_only=True),
        train_dataset=data,
        args=SFTConfig(output_dir=out, max_steps=10_000, per_device_train_batch_size=2, learning_rate=1e-2,
                       max_length=48, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=[FederatedCallback(coordinator, name=name, on_task=on_task, verbose=False)],
    )
    return trainer


def make_base(folder: Path) -> Path:
    """A tiny Llama with weights and a character tokenizer (printable ASCII) in ``folder``."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(c): 3 + c - 32 for c in range(32, 127)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="<unk>")),
                                        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=0, eos_token_id=1, bos_token_id=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def loss_on(model, tokenizer, rows) -> float:
    """Mean token loss of ``model`` on the prompts and completions of ``rows``."""
    with torch.no_grad():
        losses = [model(input_ids=ids, labels=ids).loss.item() for ids in (
            torch.tensor([tokenizer(r["prompt"] + r["completion"])["input_ids"] + [1]]) for r in rows)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--work", default="", help="folder for the model and the run (default: a temporary one)")
    args = parser.parse_args(argv)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedgrid.cli import serve
    from fedgrid.config import load_config
    from fedgrid.simulation.hf_data import load_local, load_partition

    torch.set_num_threads(1)
    work = Path(args.work or tempfile.mkdtemp(prefix="federated-sft-"))
    base = make_base(work / "base")
    config = load_config(overrides={
        "model": f"hf:{base}", "peft": "lora:r=4,alpha=8,targets=q_proj,v_proj", "strategy": "diloco",
        "inner_steps": args.inner_steps, "rounds": args.rounds, "clients": 2, "min_clients": 2,
        "fraction_evaluate": 1.0, "listen": "127.0.0.1:0", "threads": 1, "progress": False, "out": str(work / "run")})
    threading.Thread(target=serve, args=(config,), daemon=True).start()
    address = work / "run" / "address"
    for _ in range(1200):  # the coordinator writes its address once it listens (a minute at most)
        if address.exists() and address.read_text().strip():
            break
        threading.Event().wait(0.05)
    rows = list(load_local(f"hf:{DATA}"))
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    before = loss_on(AutoModelForCausalLM.from_pretrained(base, local_files_only=True), tokenizer, rows)
    parts = [load_partition(f"hf:{DATA}", "iid", partitions=2, index=k, seed=0) for k in range(2)]
    reports: list[list] = [[], []]
    # Made one after the other: SFTTrainer prepares its data with `datasets`, whose locks two threads contend for.
    trainers = [site(address.read_text().strip(), str(base), parts[k], f"site-{k}", str(work / f"site-{k}"),
                     on_task=reports[k].append) for k in range(2)]
    threads = [threading.Thread(target=trainer.train) for trainer in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model = trainers[0].model  # a PeftModel holding the final global adapters
    assert isinstance(model, PeftModel)
    fits = [r for site_reports in reports for r in site_reports if r.kind == "fit"]
    table = {
        "rounds": max(r.round for r in fits),
        "loss_before": before,
        "loss_after": loss_on(model.eval(), tokenizer, rows),
        "bytes_up_per_round": sum(r.bytes_up for r in fits) / len(fits),
        "bytes_down_per_round": sum(r.bytes_down for r in fits) / len(fits),
    }
    for key, value in table.items():
        print(f"{key:>22}  {value:.4g}" if isinstance(value, float) else f"{key:>22}  {value}")
    return table


if __name__ == "__main__":
    main()
