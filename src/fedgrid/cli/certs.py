"""``fedgrid certs``: the certificate authority for mutual TLS (``fedgrid.ops.pki``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    certs = sub.add_parser(
        "certs", help="the certificate authority for mutual TLS: certificates, revocation, enrollment tokens"
    )
    csub = certs.add_subparsers(
        dest="certs_command", required=True, metavar="{init,issue,revoke,list,token,revoke-token}"
    )

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = csub.add_parser(name, help=help, description=help)
        p.add_argument("--dir", required=True, metavar="DIR", help="the certificate directory")
        return p

    init = command("init", "create a CA in DIR: ca.pem, ca.key, crl.pem, index.json, tokens.json")
    init.add_argument("--name", default="fedgrid CA", help="the CA's common name (default: fedgrid CA)")
    init.add_argument("--days", type=int, default=3650, help="validity in days (default: 3650)")
    issue = command("issue", "issue a client (default) or server certificate: DIR/NAME.pem and DIR/NAME.key")
    issue.add_argument("--name", required=True, help="the client identity, or the server's name")
    issue.add_argument(
        "--server", action="store_true", help="a server certificate (EKU serverAuth) instead of a client one"
    )
    issue.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="a server's DNS name or IP address; repeat for more (default: localhost and 127.0.0.1)",
    )
    issue.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    revoke = command("revoke", "revoke NAME's certificate and rewrite DIR/crl.pem")
    revoke.add_argument("--name", required=True)
    command("list", "list the certificates issued: name, kind, serial, expiry, status")
    token = command("token", "print a one-time enrollment token (shown once: only its hash is kept)")
    token.add_argument("--name", default=None, help="the only identity the token may enroll (default: any)")
    token.add_argument(
        "--expires", default="24h", metavar="DURATION", help="e.g. 30m, 24h, 7d (default: 24h)"
    )
    token.add_argument(
        "--out",
        default="",
        metavar="FILE",
        help="write the token to FILE (new, mode 0600) for fedgrid client --enroll-file, instead of printing it",
    )
    revoke_token = command("revoke-token", "revoke an enrollment token by its id (the part before the dot)")
    revoke_token.add_argument("--id", dest="token_id", required=True, metavar="TOKEN_ID")
    return certs


def run(args: argparse.Namespace) -> int:
    """``fedgrid certs ...``: bad input (an unknown name, an invalid identity, an existing CA)
    exits 2 with the problem named, like a bad flag."""
    from fedgrid.ops import pki

    d = args.dir
    try:
        if args.certs_command == "init":
            path = pki.init_ca(d, name=args.name, days=args.days)
            print(f"CA {args.name!r} created: {path} (key {pki.CA_KEY}, 0600); revocation list {pki.CRL}")
        elif args.certs_command == "issue":
            cert, key = pki.issue(d, args.name, server=args.server, sans=args.san, days=args.days)
            print(
                f"{'server' if args.server else 'client'} certificate for {args.name!r}: {cert} (key {key}, 0600)"
            )
        elif args.certs_command == "revoke":
            serials = pki.revoke(d, args.name)
            print(
                f"revoked {args.name!r} (serial {', '.join(f'{s:x}' for s in serials)}); {pki.CRL} rewritten"
            )
        elif args.certs_command == "list":
            print(_certs_table(pki.list_certs(d)))
        elif args.certs_command == "token":
            expires = pki.parse_duration(args.expires)
            scope = f"for {args.name!r}" if args.name else "for any name"
            if args.out:
                token = _token_to_file(args.out, lambda: pki.issue_token(d, name=args.name, expires=expires))
                print(
                    f"enrollment token {token.partition('.')[0]} {scope}, valid {args.expires}: written to {args.out} (0600)"
                )
            else:
                token = pki.issue_token(d, name=args.name, expires=expires)
                print(
                    f"enrollment token {token.partition('.')[0]} {scope}, valid {args.expires}; shown once:",
                    file=sys.stderr,
                )
                print(token)
        else:
            pki.revoke_token(d, args.token_id)
            print(f"enrollment token {args.token_id} revoked")
    except ValueError as exc:  # PKIError is one
        print(f"fedgrid certs {args.certs_command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _token_to_file(path: str, issue: Callable[[], str]) -> str:
    """``issue()``'s token, written to the new file ``path`` (mode 0600 from its creation). The
    file is made first, so a path that cannot be written spends no token; a failed issue
    leaves no file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ValueError(f"cannot create {path}: {exc.strerror} (the token file must be new)") from None
    try:
        token = issue()
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except BaseException:
        os.unlink(path)
        raise
    return token


def _certs_table(records: Sequence[Any]) -> str:
    rows = [("NAME", "KIND", "SERIAL", "NOT AFTER", "STATUS")]
    rows += [
        (r.name, r.kind, f"{r.serial:x}", r.not_after.strftime("%Y-%m-%d %H:%M:%SZ"), r.status())
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
