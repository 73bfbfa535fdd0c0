"""DiLoCo: a tiny character-level transformer trained on Shakespeare by workers that sync
every H steps.

Each worker holds whole speaking roles of the LEAF Shakespeare split
(``fedgrid.simulation.shakespeare``: one role per (play, speaker)) and runs H AdamW steps
(its inner optimizer, kept across rounds) from the global model; the coordinator applies
DiLoCo's outer step (Nesterov SGD, lr 0.7, momentum 0.9) to the averaged pseudo-gradient.
The model is a 2-layer causal transformer (d_model 64, 4 heads, 81 k parameters) that
predicts the next character at every position of a window. Runs through fedgrid's round
engine and in-process fleet, with the same wire serialization as a deployment.

Data: ``gutenberg-texts.tar.gz`` in ``--data-dir`` (default ``../shared/data/shakespeare``
beside the repository; see the README's Shakespeare section).

Run: ``python examples/diloco_shakespeare.py [--data-dir DIR] [--rounds 8] [--inner-steps 25]``
(about 30 s on 2 cores). Prints the held-out loss (mean cross-entropy per character,
ln 80 = 4.38 for a uniform guess) before training and after every round, then
``held-out loss A -> B``.
"""

from __future__ import annotations

import argparse
import math
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from fedgrid import ModelState, TorchClient
from fedgrid.aggregation.selection import Sampling
from fedgrid.plugins import initial_state
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.shakespeare import VOCAB, NextChars, load_shakespeare, partition_natural
from fedgrid.strategies import DiLoCo

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare"


class TinyTransformer(nn.Module):
    """Token + position embeddings, ``layers`` pre-norm causal encoder layers, a linear head."""

    def __init__(self, *, vocab: int = len(VOCAB), seq_len: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        h = self.tok(x) + self.pos(torch.arange(n, device=x.device))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))  # [batch, n, vocab]


def char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))



def main(argv: list[str] | None = None) -> tuple[float, float]:
    p = argparse.ArgumentParser(description="DiLoCo on Shakespeare with a tiny character transformer.", allow_abbrev=False)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA), help="folder holding gutenberg-texts.tar.gz")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=25, help="DiLoCo's H: inner steps per round")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW learning rate")
    p.add_argument("--test-windows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # workers train one after another; one thread each is the fair CPU share

    data = load_shakespeare(args.data_dir, seq_len=args.seq_len)
    parts = partition_natural(data.train_roles, args.workers)
    test_starts = data.test_starts[torch.randperm(len(data.test_starts), generator=torch.Generator().manual_seed(args.seed))]
    test = NextChars(data.text, test_starts[: args.test_windows], args.seq_len)
    test_x, test_y = (torch.stack(t) for t in zip(*(test[i] for i in range(len(test)))))
    print(f"{len(data.roles)} roles, {len(data.train_starts):,} training windows dealt to {args.workers} workers, "
          f"{len(test)} held-out windows")

    def model() -> TinyTransformer:
        return TinyTransformer(seq_len=args.seq_len)

    @torch.no_grad()
    def evaluate(state: ModelState) -> tuple[float, dict[str, float]]:
        m = model()
        m.load_state_dict(state)
        m.eval()
        return float(char_loss(m(test_x), test_y)), {}

    start = initial_state(model, args.seed)
    strategy = DiLoCo(sampling=Sampling(seed=args.seed), inner_steps=args.inner_steps)
    strategy.initialize(initial_state=start)
    workers = []
    for w, part in enumerate(parts):
        loader = DataLoader(NextChars(data.text, data.train_starts[torch.from_numpy(part)], args.seq_len),
                            batch_size=args.batch_size, shuffle=True, drop_last=True)
        adamw = lambda params: torch.optim.AdamW(params, lr=args.lr)  # noqa: E731
        workers.append(TorchClient(model(), loader, char_loss, adamw, inner_optimizer=adamw, device="cpu", seed=args.seed,
                                   name=f"worker-{w}"))
    before = evaluate(start)[0]
    print(f"round   0: held-out loss {before:.4f} (uniform: {math.log(len(VOCAB)):.4f})")
    t0 = time.monotonic()
    engine = RoundEngine(
        strategy=strategy, fleet=InProcessFleet(workers),
        schedule=Schedule(rounds=args.rounds, min_clients=args.workers, round_timeout=timedelta(minutes=10),
                          join_timeout=timedelta(seconds=5)),
        io=RunIO(evaluate_fn=evaluate,
                 on_round=lambda m: print(f"round {m.round:3d}: held-out loss {m.loss:.4f}, worker train loss "
                                          f"{m.extra.get('train_loss', float('nan')):.4f}, {m.bytes_up / 1e6:.2f} MB up",
                                          flush=True)),
    )
    engine.run()
    after = engine.history[-1].loss
    assert after is not None
    print(f"held-out loss {before:.4f} -> {after:.4f} after {args.rounds} rounds x {args.inner_steps} inner steps "
          f"({time.monotonic() - t0:.0f} s)")
    return before, after


if __name__ == "__main__":
    main()
