"""A client of another fedgrid release is refused at Join, naming both releases, and joins nothing
(issue 38: a client image built from another version). The check is the coordinator's, so a
region, which joins upstream with the same client code, is refused the same way."""

from __future__ import annotations

import grpc
import pytest

import fedgrid
from fedgrid.client.rpc import RpcFailed
from fedgrid.client.runtime import Connection
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc

from harness_clients import Named


def test_another_release_is_refused_naming_both_and_joins_nothing(coordinator):
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Join(pb.JoinRequest(name="old", num_examples=3, fedgrid_version="0.0.9"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == (
        f"fedgrid version mismatch: the client runs fedgrid '0.0.9', the coordinator fedgrid {fedgrid.__version__}; "
        "run the same release on both (the same image or package)"
    )
    assert coordinator.fleet.membership.live() == []
    # The same release joins; so does a request that predates the field (a bare probe).
    same = stub.Join(
        pb.JoinRequest(name="same", num_examples=3, fedgrid_version=fedgrid.__version__), timeout=10
    )
    bare = stub.Join(pb.JoinRequest(name="bare", num_examples=3), timeout=10)
    assert sorted(i.client_id for i in coordinator.fleet.membership.live()) == sorted(
        (same.client_id, bare.client_id)
    )


def test_the_client_sends_its_release_and_is_told_both(coordinator):
    conn = Connection(coordinator.address, retry_max_elapsed=2, retry_max_wait=0.1)
    try:
        coordinator.fleet.fedgrid_version = "9.9.9"  # a coordinator of another release
        with pytest.raises(RpcFailed) as caught:
            conn.join(Named("site-0"))
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"the client runs fedgrid '{fedgrid.__version__}', the coordinator fedgrid 9.9.9" in str(
            caught.value
        )
        assert coordinator.fleet.membership.live() == []
        coordinator.fleet.fedgrid_version = fedgrid.__version__
        conn.join(Named("site-0"))  # the same release: admitted
        assert [i.name for i in coordinator.fleet.membership.live()] == ["site-0"]
    finally:
        conn.close()
