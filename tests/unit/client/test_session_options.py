"""``SessionOptions.of``: ``connect``'s keywords split into the session's fields and ``Connection``'s."""

from __future__ import annotations

import pytest

from fedgrid.client.session import Session, SessionOptions, connect


def test_keywords_that_name_a_field_are_fields_and_the_others_go_to_the_connection() -> None:
    options = SessionOptions.of(name="a", num_examples=7, verbose=False, rpc_timeout=3.0, connect_timeout=2.0)
    assert options == SessionOptions(
        name="a", num_examples=7, verbose=False, connection={"rpc_timeout": 3.0, "connect_timeout": 2.0}
    )
    assert SessionOptions.of() == SessionOptions()


def test_connect_hands_the_connection_its_options_and_refuses_one_it_does_not_take() -> None:
    session = connect("127.0.0.1:1", name="a", rpc_timeout=3.0)  # never joined
    assert isinstance(session, Session) and session.conn.rpc_timeout == 3.0
    with pytest.raises(TypeError, match="no_such_option"):
        connect("127.0.0.1:1", no_such_option=1.0)
