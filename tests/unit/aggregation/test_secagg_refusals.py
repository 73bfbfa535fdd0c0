"""A dishonest coordinator: each request that could reveal both shares of one client, and each
message a client cannot authenticate, is refused with a typed error and zero share bytes."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from secagg_sim import Federation, relay

from fedgrid.aggregation.secagg_crypto import SecAggRefusedError
from fedgrid.aggregation.secagg_server import SecAggServerRound
from fedgrid.client.secagg_party import SecAggParty
from fedgrid.types import TO_SERVER

N, K, T = 10, 8, 5


def _masked(fed: Federation, server_round: int = 1) -> SecAggServerRound:
    """A round run up to every client's masked input."""
    srv = fed.server(server_round)
    sent = {cid: fed.parties[cid].advertise(srv.plan_for(cid)) for cid in fed.ids}
    srv.record_adverts({cid: m[TO_SERVER] for cid, m in sent.items()})
    inbox = relay(sent)
    shared = {}
    for cid in fed.ids:
        fed.parties[cid].receive_adverts(server_round, inbox.get(cid, {}))
        shared[cid] = fed.parties[cid].share(server_round)
    srv.record_shares(shared)
    inbox = relay(shared)
    for cid in fed.ids:
        fed.parties[cid].receive_shares(server_round, inbox.get(cid, {}))
        fed.parties[cid].mask(server_round, torch.arange(4), bits=32)
    return srv


def _refused(call: Callable[[], object], match: str) -> None:
    """``call`` raises ``SecAggRefusedError`` (so it returns, hence sends, no share bytes)."""
    with pytest.raises(SecAggRefusedError, match=match):
        call()


@pytest.fixture()
def fed() -> Federation:
    return Federation(N, K, T)


def test_an_honest_request_gets_the_shares(fed: Federation) -> None:
    _masked(fed)
    me = fed.ids[0]
    answer = fed.parties[me].unmask(1, survivors=fed.ids[:9], dropped=fed.ids[9:])
    assert len(answer[TO_SERVER]) > 8 * 68  # eight holders' shares of 68 bytes, and framing


def test_overlapping_survivors_and_dropouts_are_refused(fed: Federation) -> None:
    _masked(fed)
    me, other = fed.ids[0], fed.ids[1]
    _refused(
        lambda: fed.parties[me].unmask(1, survivors=fed.ids, dropped=[other]),
        "survivors and dropouts overlap",
    )
    # Refused once, the round is over for this client: even an honest request gets nothing.
    _refused(lambda: fed.parties[me].unmask(1, survivors=fed.ids, dropped=[]), "refused earlier")


def test_a_second_unmask_request_is_refused(fed: Federation) -> None:
    _masked(fed)
    me = fed.ids[0]
    assert fed.parties[me].unmask(1, survivors=fed.ids, dropped=[])[TO_SERVER]
    # Asking again, now calling a survivor dropped, would reveal its mask key too.
    _refused(
        lambda: fed.parties[me].unmask(1, survivors=fed.ids[:9], dropped=fed.ids[9:]),
        "a second unmask request",
    )


def test_unknown_ids_are_refused(fed: Federation) -> None:
    _masked(fed)
    _refused(
        lambda: fed.parties[fed.ids[0]].unmask(1, survivors=fed.ids, dropped=["intruder"]),
        "1 ids not in the round",
    )


def test_a_threshold_below_a_majority_of_the_neighbours_is_refused() -> None:
    weak = Federation(N, K, K // 2)  # 4 of 8: the holders could be split, 4 revealing each share
    srv = weak.server(1)
    _refused(lambda: weak.parties[weak.ids[0]].advertise(srv.plan_for(weak.ids[0])), "not a majority")


def test_fewer_survivors_than_the_threshold_are_refused(fed: Federation) -> None:
    _masked(fed)
    _refused(
        lambda: fed.parties[fed.ids[0]].unmask(1, survivors=fed.ids[:4], dropped=fed.ids[4:]),
        "4 survivors, fewer than the threshold 5",
    )


def test_a_client_named_dropped_or_that_sent_no_input_refuses(fed: Federation) -> None:
    _masked(fed)
    _refused(
        lambda: fed.parties[fed.ids[0]].unmask(1, survivors=fed.ids[1:], dropped=fed.ids[:1]),
        "sent no masked input",
    )


def _adverts(fed: Federation) -> tuple[SecAggServerRound, dict[str, dict[str, bytes]]]:
    srv = fed.server(1)
    sent = {cid: fed.parties[cid].advertise(srv.plan_for(cid)) for cid in fed.ids}
    return srv, relay(sent)


def test_a_forged_advert_is_refused(fed: Federation) -> None:
    srv, inbox = _adverts(fed)
    victim, me = fed.ids[1], fed.ids[0]
    # The coordinator swaps a neighbour's keys for its own, signed with a key not the identity's.
    impostor = SecAggParty(
        client_name=victim, signer=Ed25519PrivateKey.generate(), keyring=fed.parties[me].keyring
    )
    forged = impostor.advertise(srv.plan_for(victim))[TO_SERVER]
    assert victim in inbox[me]
    _refused(lambda: fed.parties[me].receive_adverts(1, {**inbox[me], victim: forged}), "does not verify")
    _refused(lambda: fed.parties[me].share(1), "refused earlier")


def test_an_unsigned_advert_is_refused(fed: Federation) -> None:
    _, inbox = _adverts(fed)
    me, victim = fed.ids[0], fed.ids[1]
    good = inbox[me][victim]
    unsigned = good[:-64] + bytes(64)
    _refused(lambda: fed.parties[me].receive_adverts(1, {**inbox[me], victim: unsigned}), "does not verify")


def test_an_advert_of_another_round_is_refused(fed: Federation) -> None:
    _, old = _adverts(fed)  # round 1
    srv = fed.server(2)
    sent = {cid: fed.parties[cid].advertise(srv.plan_for(cid)) for cid in fed.ids}
    inbox = relay(sent)
    me, victim = fed.ids[0], fed.ids[1]
    _refused(
        lambda: fed.parties[me].receive_adverts(2, {**inbox[me], victim: old[me][victim]}), "does not verify"
    )


def test_an_advert_relayed_under_another_id_is_refused(fed: Federation) -> None:
    _, inbox = _adverts(fed)
    me = fed.ids[0]
    a, b = list(inbox[me])[:2]
    _refused(lambda: fed.parties[me].receive_adverts(1, {a: inbox[me][b], b: inbox[me][a]}), "names client")


def _shares(fed: Federation, server_round: int) -> dict[str, dict[str, bytes]]:
    """A round run up to its share step; the envelopes by recipient."""
    srv = fed.server(server_round)
    inbox = relay({cid: fed.parties[cid].advertise(srv.plan_for(cid)) for cid in fed.ids})
    for cid in fed.ids:
        fed.parties[cid].receive_adverts(server_round, inbox.get(cid, {}))
    return relay({cid: fed.parties[cid].share(server_round) for cid in fed.ids})


def test_an_envelope_replayed_from_another_round_is_refused(fed: Federation) -> None:
    old = _shares(fed, 1)  # round 1's envelopes, kept by the coordinator ...
    new = _shares(fed, 2)
    me = fed.ids[0]
    fed.parties[fed.ids[1]].receive_shares(2, new[fed.ids[1]])  # the round's own envelopes open
    _refused(lambda: fed.parties[me].receive_shares(2, old[me]), "does not open")  # ... replayed in round 2
    _refused(lambda: fed.parties[me].mask(2, torch.arange(4), bits=32), "refused earlier")
    _refused(lambda: fed.parties[me].unmask(2, survivors=fed.ids, dropped=[]), "refused earlier")


def test_an_envelope_opens_only_for_its_sender_receiver_round_and_run() -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from fedgrid.aggregation.secagg_crypto import open_sealed, raw_public, seal

    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    bound = {"sender": "a", "receiver": "b", "run": "r", "server_round": 3}
    envelope = seal(a, raw_public(b), b"shares", **bound)  # type: ignore[arg-type]
    assert open_sealed(b, raw_public(a), envelope, **bound) == b"shares"  # type: ignore[arg-type]
    for key, other in [("sender", "c"), ("receiver", "c"), ("run", "r2"), ("server_round", 4)]:
        _refused(
            lambda: open_sealed(b, raw_public(a), envelope, **{**bound, key: other}),  # type: ignore[arg-type]
            "does not open",
        )
    _refused(
        lambda: open_sealed(b, raw_public(a), envelope[:-1] + bytes([envelope[-1] ^ 1]), **bound),
        "does not open",
    )  # type: ignore[arg-type]
