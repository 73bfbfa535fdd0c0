"""A client's side of SecAgg+ (``fedgrid.aggregation.secagg``): ``SecAggClient`` wraps any
``Client`` and answers the secure-aggregation phases; every other phase and task goes to it.

A masked fit trains with the wrapped client, takes its update (its floating tensors minus the
global ones), adds the rounding error it kept from its last masked round (error feedback stays
here, on the client), clips it to the round's range, optionally perturbs it (``add_noise``: the
hook where distributed DP noise goes, added by each client so the coordinator never sees an
unnoised sum), quantizes it into the ring with its weight premultiplied, masks it and uploads
the one integer tensor. The state machine (``fedgrid.client.secagg_party.SecAggParty``) refuses,
with ``SecAggRefusedError`` and nothing sent, any request that could unmask a client.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections import OrderedDict
from typing import Any, Callable, Mapping

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedgrid.aggregation.privacy import KEY_BYTES, clip_update, noise_share
from fedgrid.aggregation.secagg import ADVERTISE, MASKED, SHARE, UNMASK, flat_floating
from fedgrid.aggregation.secagg_crypto import Keyring, PinnedKeys, SecAggRefusedError
from fedgrid.aggregation.secagg_identity import CertificateKeyring, certificate_credential
from fedgrid.aggregation.secagg_math import RoundPlan, quantize, to_wire
from fedgrid.capabilities import Capabilities
from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.secagg_party import SecAggParty
from fedgrid.client.timeline import Timeline
from fedgrid.types import FitIns, MessageIns, ModelState, Scalar

__all__ = ["SecAggClient", "NoiseHook", "DistributedNoise", "seeded_noise", "with_secagg", "from_certificate"]

#: ``add_noise(update, ins)``: the clipped update (float64, flat) with noise added, same shape.
NoiseHook = Callable[[torch.Tensor, FitIns], torch.Tensor]


class DistributedNoise:
    """The ``NoiseHook`` of DP under SecAgg+ (docs/privacy.rst): when the round's task asks for
    DP (``dp_clip``, ``dp_noise_std``), the update is clipped to L2 norm ``dp_clip`` and gets its
    share of Gaussian noise of std ``dp_noise_std`` on a sum of ``secagg_threshold`` parties
    (``noise_share``: std ``dp_noise_std / sqrt(t)``), so any ``s >= t`` survivors' unmasked sum
    holds noise of std ``dp_noise_std * sqrt(s / t)``; without DP it returns the update as is.

    Args:
        key: the client's own noise key (at least 32 bytes), keying one stream per round;
            ``None`` (a deployment's client): a fresh ``os.urandom`` key for every fit, which no
            one else ever holds, so a redone round never reuses noise.
    """

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and len(key) < KEY_BYTES:
            raise ValueError(f"a noise key needs at least {KEY_BYTES} bytes, got {len(key)}")
        self.key = key

    def __call__(self, update: torch.Tensor, ins: FitIns) -> torch.Tensor:
        c = ins.config
        if "dp_noise_std" not in c:
            return update
        try:
            clip, std, t = float(c["dp_clip"]), float(c["dp_noise_std"]), int(c["secagg_threshold"])  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError) as exc:
            raise SecAggRefusedError(f"round {ins.round}: a malformed DP task ({exc})") from None
        clipped, _ = clip_update({"update": update}, clip)
        key = self.key if self.key is not None else os.urandom(KEY_BYTES)
        noise = noise_share(key, ins.round, clipped, std=std, parties=max(t, 1), purpose="secagg")
        return clipped["update"] + noise["update"]

    def count(self, unclipped: bool, ins: FitIns) -> float:
        """Adaptive clipping's count coordinate before scaling: this client's unclipped bit plus its
        share of the count's noise, std ``dp_count_std / sqrt(t)`` (its own key's ``secagg-count``
        stream), so the survivors' sum holds noise of std ``dp_count_std * sqrt(s / t)``.

        Raises:
            SecAggRefusedError: a malformed DP task.
        """
        try:
            std, t = float(ins.config["dp_count_std"]), int(ins.config["secagg_threshold"])  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError) as exc:
            raise SecAggRefusedError(
                f"round {ins.round}: a malformed adaptive-clipping task ({exc})"
            ) from None
        key = self.key if self.key is not None else os.urandom(KEY_BYTES)
        like = {"count": torch.zeros(1, dtype=torch.float64)}
        noise = noise_share(key, ins.round, like, std=std, parties=max(t, 1), purpose="secagg-count")
        return float(unclipped) + float(noise["count"][0])


def seeded_noise(seed: int, name: str) -> DistributedNoise:
    """A simulated client's ``DistributedNoise``, keyed by ``HMAC-SHA256(seed, name)``: a
    simulation's noise is reproducible bit for bit (and not secret: anyone with the seed can
    subtract it, which a simulation's measured privacy does not need)."""
    key = hmac.new(f"fedgrid-dp-client|{seed}".encode(), name.encode(), hashlib.sha256).digest()
    return DistributedNoise(key)


def _plan(ins: MessageIns) -> RoundPlan:
    c = ins.config
    try:
        return RoundPlan(
            run=str(c["secagg_run"]),
            server_round=ins.round,
            me=ins.client_id,
            participants=tuple(ins.peers),
            k=int(c["secagg_k"]),  # type: ignore[arg-type]
            graph_seed=bytes.fromhex(str(c["secagg_graph"])),
            threshold=int(c["secagg_threshold"]),  # type: ignore[arg-type]
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise SecAggRefusedError(f"round {ins.round}: a malformed secure-aggregation task ({exc})") from None


def _ids(text: Scalar | None) -> list[str]:
    return [cid for cid in str(text or "").split(",") if cid]


class SecAggClient(Client):
    """``inner`` taking part in SecAgg+ rounds.

    Args:
        inner: the client that trains and evaluates.
        signer: the Ed25519 key of its identity (its name).
        keyring: the identities' Ed25519 public keys it accepts adverts from.
        add_noise: see ``NoiseHook``; ``None``: no noise.
        identity: the identity its adverts claim (default: ``inner.name``).
        credential: what proves ``signer``'s key for that identity (``from_certificate``).
    """

    def __init__(
        self,
        inner: Client,
        *,
        signer: Ed25519PrivateKey,
        keyring: Keyring,
        add_noise: NoiseHook | None = None,
        identity: str = "",
        credential: bytes = b"",
    ) -> None:
        self.inner = inner
        self.name, self.region = inner.name, inner.region
        self.capability_override = inner.capability_override
        self.party = SecAggParty(
            client_name=identity or inner.name, signer=signer, keyring=keyring, credential=credential
        )
        self.add_noise = add_noise
        self.residual: torch.Tensor | None = None  # error feedback, in the update's units
        #: The ring integers of its last masked input, before masking (kept here, never sent).
        self.last_input: torch.Tensor | None = None

    @property
    def num_examples(self) -> int:
        return self.inner.num_examples

    @property
    def timeline(self) -> Timeline:  # the wrapped client's: what it and the runtime record
        return self.inner.timeline

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def __getattr__(self, name: str) -> Any:  # e.g. a TorchClient's device, model
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        return self.inner.evaluate(state, config)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        if ins.phase == ADVERTISE:
            return self.party.advertise(_plan(ins))
        if ins.phase == SHARE:
            return self.party.share(ins.round)
        if ins.phase == UNMASK:
            survivors, dropped = (
                _ids(ins.config.get("secagg_survivors")),
                _ids(ins.config.get("secagg_dropped")),
            )
            return self.party.unmask(ins.round, survivors=survivors, dropped=dropped)
        return self.inner.exchange(ins)

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        if ins.phase == ADVERTISE:
            self.party.receive_adverts(ins.round, inbox)
        elif ins.phase == SHARE:
            self.party.receive_shares(ins.round, inbox)
        elif ins.phase != UNMASK:
            self.inner.receive(ins, inbox)

    def _count(self, norm: float, ins: FitIns) -> torch.Tensor:
        """Adaptive clipping's coordinate: ``dp_count_scale`` times (its update's norm at most the
        round's ``dp_clip``, plus its share of the count's noise: ``DistributedNoise.count``).

        Raises:
            SecAggRefusedError: a noise hook without ``count``, or a malformed task.
        """
        counter = getattr(self.add_noise, "count", None)
        if counter is None:
            raise SecAggRefusedError(
                f"round {ins.round}: adaptive clipping needs a noise hook with count() (DistributedNoise)"
            )
        try:
            clip, scale = float(ins.config["dp_clip"]), float(ins.config["dp_count_scale"])  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError) as exc:
            raise SecAggRefusedError(
                f"round {ins.round}: a malformed adaptive-clipping task ({exc})"
            ) from None
        return torch.tensor(scale * counter(norm <= clip, ins), dtype=torch.float64)

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        if not ins.config.get("secagg"):
            return self.inner.fit(state, ins)
        c = ins.config
        bits, clip, scale, weight = (
            int(c["secagg_bits"]),
            float(c["secagg_clip"]),
            float(c["secagg_scale"]),
            float(c["secagg_weight"]),
        )  # type: ignore[arg-type]
        plain = dict(ins.config)
        for key in [k for k in plain if k.startswith("secagg")]:
            del plain[key]
        out = self.inner.fit(state, FitIns(round=ins.round, config=plain, download=ins.download))
        names = flat_floating(state)
        update = torch.cat(
            [(out.state[n].to(torch.float64) - state[n].to(torch.float64)).reshape(-1) for n in names]
        )
        if self.residual is not None and self.residual.shape == update.shape:
            update = update + self.residual
        norm = float(torch.linalg.vector_norm(update))  # adaptive clipping's bit: before any clip
        update = update.clamp(-clip, clip)
        dp = "dp_noise_std" in c  # DP under SecAgg+: this client adds its share of the noise
        if dp and int(c["secagg_threshold"]) != self.party.threshold(ins.round):  # type: ignore[arg-type]
            raise SecAggRefusedError(
                f"round {ins.round}: the DP task's threshold {c['secagg_threshold']} is not the round's "
                f"{self.party.threshold(ins.round)} (a smaller noise share than its survivors need)"
            )
        if dp and self.add_noise is None:
            self.add_noise = DistributedNoise()  # fresh secret keys: the coordinator cannot remove it
        if self.add_noise is not None:
            update = self.add_noise(update, ins)
        size = update.numel()
        if "dp_count_std" in c:  # adaptive clipping: one more coordinate, summed securely
            update = torch.cat([update, self._count(norm, ins).reshape(1)])
        seed = int.from_bytes(
            hashlib.sha256(f"{c.get('secagg_seed', 0)}/{ins.round}/{self.name}".encode()).digest()[:8],
            "little",
        )
        q, self.residual = quantize(
            update,
            weight=weight,
            clip=math.inf if dp else clip,  # noise is not clamped: the ring wraps (docs/privacy.rst)
            scale=scale,
            bits=bits,
            generator=torch.Generator().manual_seed(seed >> 1),
        )
        self.residual = self.residual[:size]  # error feedback of the update; not of a count
        self.last_input = q
        masked = self.party.mask(ins.round, q, bits=bits)
        return FitOutput(OrderedDict([(MASKED, to_wire(masked, bits=bits))]), out.num_examples, out.metrics)


def from_certificate(inner: Client, *, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> SecAggClient:
    """``inner`` taking part in SecAgg+ under the identity of its client certificate: a fresh
    Ed25519 advert key bound to it, and peers' adverts checked against the CA bundle
    (``fedgrid.aggregation.secagg_identity``). ``fedgrid client`` with ``--ca``/``--cert``/``--key``
    runs its client so.

    Raises:
        ValueError: not a client certificate, or a key that is neither EC nor RSA.
    """
    signer = Ed25519PrivateKey.generate()
    identity, credential = certificate_credential(cert_pem, key_pem, signer)
    return SecAggClient(
        inner, signer=signer, keyring=CertificateKeyring(ca_pem), identity=identity, credential=credential
    )


def with_secagg(
    clients: list[Client], *, add_noise: NoiseHook | None = None, noise_seed: int | None = None
) -> list[SecAggClient]:
    """``clients`` (of distinct names) wrapped for SecAgg+, each with a fresh identity key and
    all of them trusting each other's (a simulation's, or one process's, federation). With
    ``noise_seed``, each adds DP noise keyed from it and its name (``seeded_noise``)."""
    names = [c.name for c in clients]
    if len(set(names)) != len(names) or not all(names):
        raise ValueError("secure aggregation needs clients of distinct, non-empty names (their identities)")
    signers = {c.name: Ed25519PrivateKey.generate() for c in clients}
    keyring = PinnedKeys({name: key.public_key() for name, key in signers.items()})
    return [
        SecAggClient(
            c,
            signer=signers[c.name],
            keyring=keyring,
            add_noise=seeded_noise(noise_seed, c.name) if noise_seed is not None else add_noise,
        )
        for c in clients
    ]
