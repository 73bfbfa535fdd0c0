"""``fedgrid certs``: the commands write what they say, print the table and the token, and
bad input exits 2 with the problem named and nothing changed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from fedgrid.cli import main
from fedgrid.ops import pki


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["certs", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_init_issue_list_revoke(tmp_path, capsys):
    d = str(tmp_path / "pki")
    assert _run(capsys, "init", "--dir", d, "--name", "site CA", "--days", "100")[0] == 0
    assert _run(capsys, "issue", "--dir", d, "--name", "alice")[0] == 0
    code, out, _ = _run(
        capsys,
        "issue",
        "--dir",
        d,
        "--name",
        "coord",
        "--server",
        "--san",
        "coord.example",
        "--san",
        "10.0.0.5",
    )
    assert code == 0 and "server certificate for 'coord'" in out
    for name in ("ca.key", "alice.key", "coord.key", "tokens.json"):
        assert stat.S_IMODE(os.stat(Path(d) / name).st_mode) == 0o600, name
    alice = pki.serial_of((Path(d) / "alice.pem").read_bytes())
    code, out, _ = _run(capsys, "revoke", "--dir", d, "--name", "alice")
    assert code == 0 and f"{alice:x}" in out
    code, out, _ = _run(capsys, "list", "--dir", d)
    header, *rows = [line.split() for line in out.splitlines()]
    assert header == ["NAME", "KIND", "SERIAL", "NOT", "AFTER", "STATUS"]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [
        ("alice", "client", f"{alice:x}", "revoked"),
        ("coord", "server", f"{pki.serial_of((Path(d) / 'coord.pem').read_bytes()):x}", "valid"),
    ]
    assert rows[0][3] == pki.list_certs(d)[0].not_after.strftime("%Y-%m-%d")


def test_bad_input_exits_2_and_names_the_problem(tmp_path, capsys):
    d = str(tmp_path / "pki")
    _run(capsys, "init", "--dir", d)
    index = (Path(d) / "index.json").read_bytes()
    cases = [
        (["revoke", "--dir", d, "--name", "nobody"], "no certificate named 'nobody'"),
        (["issue", "--dir", d, "--name", "bad\x1b[31m"], "character '\\x1b'"),
        (["issue", "--dir", d, "--name", "alice", "--san", "h"], "for server certificates"),
        (["init", "--dir", d], "refusing to overwrite an existing CA"),
        (["token", "--dir", d, "--expires", "soon"], "duration 'soon'"),
        (["revoke-token", "--dir", d, "--id", "nope"], "no enrollment token with id 'nope'"),
        (["list", "--dir", str(tmp_path / "elsewhere")], "index.json: missing"),
        (["token", "--dir", str(tmp_path / "elsewhere")], "elsewhere: no such certificate directory"),
        (
            ["issue", "--dir", str(tmp_path / "elsewhere"), "--name", "bob"],
            "elsewhere: no such certificate directory",
        ),
    ]
    for args, problem in cases:
        code, _, err = _run(capsys, *args)
        assert code == 2 and problem in err and err.startswith(f"fedgrid certs {args[0]}: error:"), (
            args,
            err,
        )
    assert (Path(d) / "index.json").read_bytes() == index


def test_token_is_printed_once_and_enrolls(tmp_path, capsys):
    d = str(tmp_path / "pki")
    _run(capsys, "init", "--dir", d)
    code, out, err = _run(capsys, "token", "--dir", d, "--name", "bob", "--expires", "30m")
    token = out.strip()
    token_id, secret = token.split(".", 1)
    assert code == 0 and token_id in err and "for 'bob'" in err and secret not in err
    store = json.loads((Path(d) / "tokens.json").read_text())["tokens"]
    assert list(store) == [token_id] and store[token_id]["name"] == "bob" and secret not in json.dumps(store)
    assert pki.enroll(d, token, pki.make_csr("bob")[1])[1] == "bob"
    code, out, err = _run(capsys, "token", "--dir", d)
    other = out.strip().split(".")[0]
    assert _run(capsys, "revoke-token", "--dir", d, "--id", other)[0] == 0
    assert json.loads((Path(d) / "tokens.json").read_text())["tokens"][other]["revoked"] is True


def test_token_out_writes_a_new_0600_file_and_prints_no_secret(tmp_path, capsys):
    d = str(tmp_path / "pki")
    _run(capsys, "init", "--dir", d)
    path = tmp_path / "edge.token"
    code, out, err = _run(capsys, "token", "--dir", d, "--name", "bob", "--out", str(path))
    token = path.read_text().strip()
    token_id, secret = token.split(".", 1)
    assert code == 0 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert f"{token_id} for 'bob'" in out and str(path) in out and secret not in out + err
    assert pki.enroll(d, token, pki.make_csr("bob")[1])[1] == "bob"


def test_token_out_refuses_an_existing_file_and_spends_no_token(tmp_path, capsys):
    d = str(tmp_path / "pki")
    _run(capsys, "init", "--dir", d)
    path = tmp_path / "edge.token"
    path.write_text("keep me\n")
    store = (Path(d) / "tokens.json").read_bytes()
    code, out, err = _run(capsys, "token", "--dir", d, "--out", str(path))
    assert code == 2 and f"cannot create {path}" in err and "must be new" in err and out == ""
    assert path.read_text() == "keep me\n" and (Path(d) / "tokens.json").read_bytes() == store


def test_token_out_leaves_no_file_when_the_token_cannot_be_issued(tmp_path, capsys):
    path = tmp_path / "edge.token"
    code, _, err = _run(capsys, "token", "--dir", str(tmp_path / "no-ca"), "--out", str(path))
    assert code == 2 and "no-ca: no such certificate directory" in err and not path.exists()
    assert not (tmp_path / "no-ca").exists()
