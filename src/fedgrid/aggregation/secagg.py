"""SecAgg+ as the phases of a round: a strategy wrapping one whose clients send whole models
(FedAvg, the FedOpt family, FedProx, DiLoCo) so that the coordinator learns only the sum of
the clients' updates.

A round is ``secagg-advertise`` (each selected client sends signed keys to its neighbours
and the coordinator), ``secagg-share`` (Shamir shares of its secrets, sealed for each
neighbour), a masked ``fit`` (the update, clipped, weight-premultiplied and quantized into the
ring, plus masks), ``secagg-unmask`` (the survivors' holders return the shares that strip the
masks), then the wrapped strategy's other phases (``evaluate``). Clients that drop at any step
are dropped from the round; with fewer survivors or shares than the threshold the round aborts
(``SecAggAbortedError``, metric ``secagg_aborted``) and the global model is kept. The unmasked
weighted mean is handed to the wrapped strategy as one result, so its server optimizer runs
as without masking. Clients run ``fedgrid.client.secagg.SecAggClient``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from fedgrid.aggregation.base import Strategy
from fedgrid.aggregation.privacy import next_clip, split_noise
from fedgrid.aggregation.secagg_math import (
    SecAggAbortedError,
    default_neighbours,
    dequantize,
    from_wire,
    ring_dtype,
    ring_scale,
)
from fedgrid.aggregation.secagg_server import SecAggServerRound
from fedgrid.errors import ConfigError
from fedgrid.types import (
    EVALUATE,
    FIT,
    TO_SERVER,
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
    TensorSpec,
)

__all__ = ["SecAgg", "ADVERTISE", "SHARE", "UNMASK", "MASKED", "COUNT_SCALE", "flat_floating"]

log = logging.getLogger(__name__)

ADVERTISE, SHARE, UNMASK = "secagg-advertise", "secagg-share", "secagg-unmask"
#: The one tensor a masked fit uploads.
MASKED = "secagg"
#: Adaptive clipping's count coordinate: a client's (unclipped bit + count noise) times this times
#: ``secagg_clip``, inside the ring's range as the update's coordinates are.
COUNT_SCALE = 0.5
#: The adaptive clip's key in the strategy's checkpointed state.
_CLIP_KEY = "secagg_dp_clip"


def flat_floating(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``state``'s floating tensors, in order: what a masked update covers."""
    return [name for name, t in state.items() if t.dtype.is_floating_point]


class SecAgg(Strategy):
    """``inner`` under SecAgg+.

    Args:
        inner: the strategy whose selection, server optimizer and evaluation run unchanged.
        bits: the ring (8, 16 or 32 bits: the uplink codec's width, ``config_secagg.secagg_ring``).
        clip: each coordinate of an update is clipped to ``+-clip``.
        levels: QSGD's levels per sign (``qsgd:LEVELS``: the mean moves in steps of ``clip / levels``,
            the public range ``clip`` standing for QSGD's norm; ``secagg_math.ring_scale``); 0: the
            whole ring.
        neighbours: k of the masking graph (0: ``default_neighbours``).
        threshold: shares that rebuild a secret, and the fewest survivors; at least a majority of
            a neighbourhood (0: ``k // 2 + 1``).
        seed: the run's seed (the graph's order and the clients' rounding draw from it).
        dp_noise_multiplier: DP with the noise distributed among the clients (docs/privacy.rst):
            each clips its update to L2 norm ``dp_clip`` and adds its share of noise of std
            ``dp_noise_multiplier * dp_clip`` (``client.secagg.DistributedNoise``), and every
            client's weight is the same (a client's influence is bounded by the clip alone);
            0: no DP.
        dp_clip: the L2 clip of DP (above 0 with ``dp_noise_multiplier``); adaptive: the first round's.
        dp_adaptive: adaptive clipping (Andrew et al.) under SecAgg+: each client appends one
            coordinate to its masked input, ``COUNT_SCALE * secagg_clip`` times its unclipped bit
            (its update's norm at most the round's clip) plus its share of the count's noise (std
            ``sigma_count`` on the sum, ``privacy.split_noise``); the unmasked mean of that
            coordinate is the noised share of unclipped updates, from which the next round's clip
            follows the server-side formula (``privacy.next_clip``). The clip is checkpointed here.
    """

    #: The masked input is integers, which a delta uplink sends as they are: nothing to add back.
    accepts_deltas = True

    def __init__(
        self,
        inner: Strategy,
        *,
        bits: int = 32,
        clip: float = 1.0,
        levels: int = 0,
        neighbours: int = 0,
        threshold: int = 0,
        seed: int = 0,
        dp_noise_multiplier: float = 0.0,
        dp_clip: float = 0.0,
        dp_adaptive: bool = False,
    ) -> None:
        if set(inner.phases(server_round=1)) - {FIT, EVALUATE}:
            raise ConfigError("secagg", f"{type(inner).__name__} has message phases of its own")
        ring_scale(bits=bits, clip=clip, clients=1, levels=levels)  # checks bits, clip and levels
        self.inner, self.bits, self.clip, self.levels = inner, bits, clip, levels
        self.k, self.t, self.seed = neighbours, threshold, seed
        if dp_noise_multiplier and not (dp_noise_multiplier > 0 and dp_clip > 0 and math.isfinite(dp_clip)):
            raise ConfigError("dp_clip", f"DP under secagg needs a finite clip above 0, got {dp_clip}")
        if dp_adaptive and not dp_noise_multiplier:
            raise ConfigError("dp_clip", "adaptive clipping under secagg needs dp_noise_multiplier above 0")
        self.dp_noise_multiplier, self.dp_clip, self.dp_adaptive = dp_noise_multiplier, dp_clip, dp_adaptive
        self.run_label = os.urandom(8).hex()  # binds envelopes and adverts to this coordinator's run
        self._reset()

    def _reset(self) -> None:
        self._round: SecAggServerRound | None = None
        self._selected: dict[str, tuple[ClientInfo, FitIns]] = {}
        self._masked: dict[str, torch.Tensor] = {}
        self._fit: dict[str, FitRes] = {}
        self._weights: dict[str, float] = {}
        self._request: tuple[list[str], list[str]] | None = None

    # The wrapped strategy's own parts.
    def initialize(self, *, initial_state: ModelState) -> None:
        self.inner.initialize(initial_state=initial_state)

    @property
    def global_state(self) -> ModelState:
        return self.inner.global_state

    def downlink_state(self, *, server_round: int) -> ModelState:
        return self.inner.downlink_state(server_round=server_round)

    def configure_evaluate(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, EvaluateIns]]:
        return self.inner.configure_evaluate(server_round=server_round, clients=clients)

    def aggregate_evaluate(
        self, *, server_round: int, results: Sequence[EvaluateRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        return self.inner.aggregate_evaluate(server_round=server_round, results=results, failures=failures)

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        return {**state, _CLIP_KEY: self.dp_clip} if self.dp_adaptive else state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.dp_adaptive and _CLIP_KEY in state:  # the adaptive clip a resume goes on from
            self.dp_clip = float(state[_CLIP_KEY])
        self.inner.load_state_dict({k: v for k, v in state.items() if k != _CLIP_KEY})
        self._reset()  # a round redone after a restart starts again from its key adverts

    def check_preconditions(self, *, num_clients: int) -> None:
        self.inner.check_preconditions(num_clients=num_clients)
        k = min(self.k or default_neighbours(num_clients), max(num_clients - 1, 0))
        if self.t and 2 * self.t <= k:
            raise ConfigError(
                "secagg_threshold",
                f"{self.t} is not a majority of the {k} neighbours of {num_clients} clients: a coordinator "
                "could collect both shares of one client (at least k / 2 + 1)",
            )
        try:
            self._scale(num_clients)
        except ValueError as exc:
            raise ConfigError(
                "codec",
                f"with secagg: {exc} (a 16-bit ring: fp16, bf16 or qsgd:128 to qsgd:32767; 32 bits: none)",
            ) from None

    def _scale(self, clients: int) -> float:
        """The round's public quantization scale for ``clients`` weighted clients (``ring_scale``)."""
        return ring_scale(bits=self.bits, clip=self.clip, clients=clients, levels=self.levels)

    def phases(self, *, server_round: int) -> Sequence[str]:
        rest = [p for p in self.inner.phases(server_round=server_round) if p != FIT]
        return (ADVERTISE, SHARE, FIT, UNMASK, *rest)

    # The protocol.
    def _plan(self, server_round: int, clients: Sequence[ClientInfo]) -> None:
        chosen = self.inner.configure_round(server_round=server_round, clients=clients)
        self._reset()
        self._selected = {info.client_id: (info, ins) for info, ins in chosen}
        ids = tuple(self._selected)
        k = self.k or default_neighbours(len(ids))
        k = min(k, max(len(ids) - 1, 0))
        threshold = min(max(self.t, k // 2 + 1), max(k, 1))  # a majority (the clients refuse less)
        graph_seed = hashlib.sha256(f"fedgrid-secagg/{self.seed}/{server_round}".encode()).digest()
        self._round = SecAggServerRound(
            run=self.run_label, server_round=server_round, participants=ids, k=k,
            graph_seed=graph_seed, threshold=threshold, bits=self.bits,
        )  # fmt: skip

    def _message_config(self) -> dict[str, Any]:
        assert self._round is not None
        r = self._round
        return {
            "secagg_run": r.run,
            "secagg_k": r.k,
            "secagg_threshold": r.threshold,
            "secagg_graph": r.graph_seed.hex(),
        }

    def configure_messages(
        self, *, server_round: int, phase: str, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, MessageIns]]:
        if phase == ADVERTISE:
            self._plan(server_round, clients)
        assert self._round is not None, f"{phase} before {ADVERTISE}"
        r = self._round
        config = self._message_config()
        if phase == ADVERTISE:
            chosen = list(r.participants)
        elif phase == SHARE:
            chosen = [cid for cid in r.participants if cid in r.adverts]
        elif phase == UNMASK:
            chosen = self._unmask_request(server_round)
            if self._request is not None:
                config |= {
                    "secagg_survivors": ",".join(self._request[0]),
                    "secagg_dropped": ",".join(self._request[1]),
                }
        else:
            raise ValueError(f"unknown secagg phase {phase!r}")
        return [
            (
                self._selected[cid][0],
                MessageIns(round=server_round, phase=phase, peers=r.participants, config=config),
            )
            for cid in chosen
        ]

    def _unmask_request(self, server_round: int) -> list[str]:
        assert self._round is not None
        try:
            self._request = self._round.unmask_request(list(self._masked))
        except SecAggAbortedError as exc:
            log.error("%s", exc)
            self._request = None
            return []
        return self._request[0]

    def receive_messages(
        self, *, server_round: int, phase: str, results: Sequence[MessageRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        assert self._round is not None
        sent = {res.client.client_id: res.messages for res in results}
        if phase == ADVERTISE:
            self._round.record_adverts({cid: m[TO_SERVER] for cid, m in sent.items() if TO_SERVER in m})
            return {"secagg_advertised": float(len(self._round.adverts))}
        if phase == SHARE:
            self._round.record_shares(sent)
            return {"secagg_shared": float(len(self._round.sent_to))}
        return self._finish(server_round, {cid: m.get(TO_SERVER, b"") for cid, m in sent.items()})

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        assert self._round is not None, f"fit before {ADVERTISE}"
        r = self._round
        chosen = [cid for cid in r.participants if cid in r.sent_to]
        raw = {
            cid: 1.0 if self.dp_noise_multiplier else float(max(self._selected[cid][0].num_examples, 1))
            for cid in chosen
        }
        total = sum(raw.values())
        self._weights = {cid: w / total for cid, w in raw.items()}
        scale = self._scale(max(len(chosen), 1))
        length = sum(self.global_state[n].numel() for n in flat_floating(self.global_state))
        expected = {MASKED: TensorSpec(ring_dtype(self.bits), (length + int(self.dp_adaptive),))}
        dp = self._dp_config(len(chosen), r.threshold) if self.dp_noise_multiplier else {}
        out = []
        for cid in chosen:
            info, ins = self._selected[cid]
            config = {
                **ins.config, "secagg": True, "secagg_bits": self.bits, "secagg_clip": self.clip,
                "secagg_scale": scale, "secagg_weight": self._weights[cid], "secagg_seed": self.seed, **dp,
            }  # fmt: skip
            out.append((info, FitIns(round=server_round, config=config, expected=expected)))
        return out

    def _dp_config(self, clients: int, threshold: int) -> dict[str, Any]:
        """A masked fit's DP keys: the clip and the noise std on the sum (docs/privacy.rst), and with
        adaptive clipping the count's noise std and scale (Andrew et al.'s split of the noise)."""
        sigma, sigma_count = (
            split_noise(self.dp_noise_multiplier, max(clients, 1))
            if self.dp_adaptive
            else (self.dp_noise_multiplier, 0.0)
        )
        dp = {"dp_clip": self.dp_clip, "dp_noise_std": sigma * self.dp_clip, "secagg_threshold": threshold}
        if self.dp_adaptive:
            dp |= {"dp_count_std": sigma_count, "dp_count_scale": COUNT_SCALE * self.clip}
        return dp

    def _adapt(self, mean: torch.Tensor, survivors: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The model's part of an unmasked mean, and with adaptive clipping the round's clip and
        noised share of unclipped updates; the next round's clip follows (``next_clip``)."""
        if not self.dp_adaptive:
            return mean, {}
        share = float(mean[-1]) / (COUNT_SCALE * self.clip)  # (sum of bits + count noise) / survivors
        metrics = {"dp_clip": self.dp_clip, "dp_unclipped": share}
        self.dp_clip = next_clip(self.dp_clip, share * survivors, survivors, 0.0)
        return mean[:-1], metrics

    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        """Keeps the masked inputs; the model changes once they are unmasked."""
        for res in results:
            tensor = res.state.get(MASKED)
            if tensor is None or tensor.dtype != ring_dtype(self.bits) or tensor.dim() != 1:
                log.warning("round %d: a masked input of the wrong form is left out", server_round)
                continue
            self._masked[res.client.client_id] = from_wire(tensor, bits=self.bits)
            self._fit[res.client.client_id] = res
        return {"secagg_masked": float(len(self._masked))}

    def _finish(self, server_round: int, answers: Mapping[str, bytes]) -> dict[str, float]:
        r = self._round
        assert r is not None
        if self._request is None:
            return {"secagg_aborted": 1.0}
        alive, dropped = self._request
        try:
            total = r.unmask(self._masked, answers, survivors=alive)
        except SecAggAbortedError as exc:
            log.error("%s", exc)
            return {"secagg_aborted": 1.0}
        #: The last unmasked ring sum and whose inputs it holds (what tests check bit for bit).
        self.last_sum, self.last_survivors = total, list(alive)
        share = sum(self._weights[cid] for cid in alive)
        scale = self._scale(len(self._weights))
        mean, dp = self._adapt(dequantize(total, scale=scale, bits=self.bits) / share, len(alive))
        model, at = OrderedDict(), 0
        for name, tensor in self.global_state.items():
            if tensor.dtype.is_floating_point:
                part = mean[at : at + tensor.numel()].view(tensor.shape)
                model[name] = (tensor.to(torch.float64) + part).to(tensor.dtype)
                at += tensor.numel()
            else:
                model[name] = tensor.clone()
        fits = [self._fit[cid] for cid in alive]
        examples = sum(res.num_examples for res in fits)
        losses = [(res.num_examples, res.metrics["loss"]) for res in fits if "loss" in res.metrics]
        metrics = (
            {"loss": sum(n * v for n, v in losses) / max(sum(n for n, _ in losses), 1)} if losses else {}
        )
        one = FitRes(
            client=ClientInfo(client_id="secagg", name="secagg"),
            state=model,
            num_examples=max(examples, 1),
            metrics=metrics,
        )
        out = self.inner.aggregate(server_round=server_round, results=[one], failures=[])
        return {
            **out,
            "secagg_aborted": 0.0,
            "secagg_survivors": float(len(alive)),
            "secagg_dropped": float(len(dropped)),
            **dp,
        }
