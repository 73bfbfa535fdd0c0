"""``explain_certificate``: what is wrong with a coordinator's certificate, in words with the fix."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from ipaddress import ip_address

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.client.diagnose import certificate_names, explain_certificate

NOW = datetime(2026, 6, 1, tzinfo=timezone.utc)


def _cert(
    *,
    sans: list[str],
    days: tuple[int, int] = (-1, 30),
    usage=ExtendedKeyUsageOID.SERVER_AUTH,
    cn: str = "coord",
) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site CA")]))
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW + timedelta(days=days[0]))
        .not_valid_after(NOW + timedelta(days=days[1]))
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256())


def _explain(
    cert: x509.Certificate, *, host: str = "127.0.0.1", server_name: str = "", code: int | None = None
):
    return explain_certificate(
        cert, host=host, server_name=server_name, ca="ca.pem", verify_code=code, now=NOW
    )


def test_names_are_listed_dns_then_ip_and_a_peers_odd_text_is_escaped():
    assert certificate_names(_cert(sans=["10.0.0.5", "coord.example.org"])) == [
        "coord.example.org",
        "10.0.0.5",
    ]
    assert certificate_names(_cert(sans=[])) == []
    assert certificate_names(_cert(sans=["evil\nname.example"])) == ["'evil\\nname.example'"]


def test_a_wrong_server_name_lists_the_names_to_choose_from():
    cert = _cert(sans=["coord.example.org", "10.0.0.5"])
    assert _explain(cert, server_name="coordinator", code=62) == (
        "its certificate (CN=coord) holds the names coord.example.org, 10.0.0.5, not 'coordinator': give "
        "--server-name one of its names (coord.example.org), or issue the coordinator a certificate with "
        "--san coordinator"
    )


def test_an_address_only_certificate_says_which_addresses_to_dial():
    assert _explain(_cert(sans=["10.0.0.5"]), code=64) == (
        "its certificate (CN=coord) holds the names 10.0.0.5, not '127.0.0.1': dial one of its addresses "
        "(10.0.0.5), or issue the coordinator a certificate with --san 127.0.0.1"
    )


def test_validity_comes_before_the_chain_and_the_name():
    assert _explain(_cert(sans=["x"], days=(-30, -2)), code=10) == (
        "its certificate (CN=coord) expired on 2026-05-30 00:00 UTC: issue the coordinator a new one"
    )
    assert "is not valid before 2026-06-03 00:00 UTC: check the clocks" in _explain(
        _cert(sans=["x"], days=(2, 9))
    )


def test_a_client_certificate_as_the_servers_and_another_ca():
    client_cert = _cert(sans=["127.0.0.1"], usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    assert _explain(client_cert, code=26) == (
        "its certificate (CN=coord) is not a server certificate: issue it with `fedgrid certs issue NAME --server`"
    )
    assert _explain(_cert(sans=["127.0.0.1"]), code=20) == (
        "its certificate (CN=coord), issued by CN=site CA, is not signed by a CA in --ca ca.pem: give the CA "
        "bundle of the federation that issued the coordinator's certificate"
    )


def test_a_certificate_that_passed_needs_no_words():
    assert _explain(_cert(sans=["127.0.0.1"])) is None
