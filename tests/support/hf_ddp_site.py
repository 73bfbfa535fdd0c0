"""A site whose Trainer runs on several processes (``accelerate launch --cpu --num_processes 2``,
gloo): ``python hf_ddp_site.py MODEL_DIR COORDINATOR OUT``. Each rank writes its model after
training to ``OUT/rank-R.safetensors`` and its step count to ``OUT/rank-R.steps``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tiny_hf import char_tokenizer, token_rows


def main(model_dir: str, coordinator: str, out: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from fedgrid.integrations.transformers import FederatedCallback

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        max_steps=100,
        learning_rate=0.01,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    callback = FederatedCallback(coordinator, name="site-ddp", verbose=False)
    data = Dataset.from_list(token_rows(char_tokenizer())[0::2])  # 6 rows: 3 steps of 2 (1 per rank)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    rank = trainer.args.process_index
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(Path(out) / f"rank-{rank}.safetensors"))
    (Path(out) / f"rank-{rank}.steps").write_text(f"{trainer.state.global_step} {callback.federation.rounds}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
