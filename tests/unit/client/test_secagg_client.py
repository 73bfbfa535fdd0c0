"""``fedgrid client`` under mutual TLS wraps its client for SecAgg+ under its certificate's
identity; the wrapper hands every other task to the client unchanged."""

from __future__ import annotations

import argparse
import logging
from collections import OrderedDict

import pytest
import torch

from fedgrid.client import Client, FitOutput
from fedgrid.client.secagg import SecAggClient
from fedgrid.client.serve import _with_secagg
from fedgrid.ops import pki
from fedgrid.types import FitIns, MessageIns


class Plus(Client):
    name, region = "plus", "eu"

    def fit(self, state, ins):  # type: ignore[no-untyped-def]
        return FitOutput(OrderedDict((k, v + 1) for k, v in state.items()), 3, {"loss": 0.5})

    def exchange(self, ins):  # type: ignore[no-untyped-def]
        return {"": b"mine"}


def test_a_client_with_a_certificate_takes_part_under_its_identity(tmp_path) -> None:
    pki.init_ca(tmp_path)
    pki.issue(tmp_path, "site-a")
    files = argparse.Namespace(
        ca=str(tmp_path / "ca.pem"), cert=str(tmp_path / "site-a.pem"), key=str(tmp_path / "site-a.key")
    )
    wrapped = _with_secagg(Plus(), files)
    assert isinstance(wrapped, SecAggClient)
    assert (wrapped.name, wrapped.region, wrapped.party.client_name) == ("plus", "eu", "site-a")
    assert wrapped.party.credential
    state = OrderedDict(w=torch.zeros(2))
    out = wrapped.fit(state, FitIns(round=1, config={"lr": 0.1}))  # not a masked task: the client's own
    assert torch.equal(out.state["w"], torch.ones(2)) and out.num_examples == 3
    assert wrapped.exchange(MessageIns(round=1, phase="ring")) == {"": b"mine"}
    assert wrapped.timeline is wrapped.inner.timeline


def test_files_that_cannot_sign_adverts_leave_the_client_as_it_is(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    pki.init_ca(tmp_path)
    pki.issue(tmp_path, "coordinator", server=True)  # a server certificate is no client identity
    files = argparse.Namespace(
        ca=str(tmp_path / "ca.pem"),
        cert=str(tmp_path / "coordinator.pem"),
        key=str(tmp_path / "coordinator.key"),
    )
    client = Plus()
    with caplog.at_level(logging.WARNING):
        assert _with_secagg(client, files) is client
    assert "no secure aggregation" in caplog.text and "not a client certificate" in caplog.text
