"""The CA directory (``fedgrid.pki``): certificate fields, file modes, the CRL and the
``RevocationList`` that follows it, one-time enrollment tokens, and ``load_pem_files`` on
fedgrid's own files and on a PKI made elsewhere (here: with ``cryptography`` directly)."""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import fedgrid.pki as pki_kernel  # the kernel half: its clock and files serve both halves
from fedgrid.errors import AuthenticationError, EnrollmentError, PKIError
from fedgrid.ops import pki


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _ext(cert: x509.Certificate, kind: type) -> x509.Extension:
    return cert.extensions.get_extension_for_class(kind)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    pki.init_ca(d, name="test CA", days=30)
    return d


def _later(monkeypatch: pytest.MonkeyPatch, delta: timedelta) -> None:
    real = pki_kernel.utcnow()
    monkeypatch.setattr(pki_kernel, "utcnow", lambda: real + delta)


# --- identities -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["alice", "client-0007", "a.b_c-d@site:1", "x" * 128, "0"])
def test_valid_identities_pass_unchanged(name):
    assert pki.check_identity(name) == name


@pytest.mark.parametrize(
    "name,problem",
    [
        ("alice\nbob", r"character '\\n' at position 5"),
        ("\x1b[31mred", r"character '\\x1b' at position 0"),
        ("x" * 129, "129 characters long; at most 128"),
        ("", "empty"),
        ("al ice", "character ' ' at position 2"),
        ("caf\u00e9", "position 3"),
        ("a/b", "character '/'"),
    ],
)
def test_invalid_identities_are_refused_with_the_problem_named(name, problem):
    with pytest.raises(ValueError, match=problem):
        pki.check_identity(name)


def test_durations():
    assert pki.parse_duration("24h") == timedelta(hours=24)
    assert pki.parse_duration("30m") == timedelta(minutes=30)
    assert pki.parse_duration("7d") == timedelta(days=7)
    assert pki.parse_duration("1d12h") == timedelta(hours=36)
    for bad in ("", "5", "h", "5x", "-1h", "0m", "1h 2m"):
        with pytest.raises(ValueError, match="duration"):
            pki.parse_duration(bad)


# --- the CA and its certificates ------------------------------------------------------


def test_init_writes_a_ca_with_the_right_fields_and_modes(ca_dir):
    assert _mode(ca_dir) == 0o700
    assert _mode(ca_dir / "ca.key") == 0o600 and _mode(ca_dir / "tokens.json") == 0o600
    assert _mode(ca_dir / "ca.pem") == 0o644 and _mode(ca_dir / "crl.pem") == 0o644
    ca = _cert(ca_dir / "ca.pem")
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "test CA"
    assert ca.issuer == ca.subject
    ca.verify_directly_issued_by(ca)  # self-signed
    bc = _ext(ca, x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = _ext(ca, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    assert _ext(ca, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(
        ca.public_key()
    )
    assert (
        isinstance(ca.public_key(), ec.EllipticCurvePublicKey) and ca.public_key().curve.name == "secp256r1"
    )
    assert ca.not_valid_after_utc - ca.not_valid_before_utc == timedelta(days=30) + pki.CLOCK_SKEW
    crl = x509.load_pem_x509_crl((ca_dir / "crl.pem").read_bytes())
    assert crl.is_signature_valid(ca.public_key()) and len(crl) == 0
    assert pki.list_certs(ca_dir) == []
    assert not [p for p in ca_dir.iterdir() if p.name.endswith(".tmp")]


def test_init_refuses_to_overwrite_a_ca(ca_dir):
    before = (ca_dir / "ca.key").read_bytes()
    with pytest.raises(PKIError, match=r"ca\.pem exists: refusing to overwrite"):
        pki.init_ca(ca_dir)
    assert (ca_dir / "ca.key").read_bytes() == before


def test_client_certificate_fields(ca_dir):
    cert_path, key_path = pki.issue(ca_dir, "alice", days=10)
    assert (cert_path, key_path) == (ca_dir / "alice.pem", ca_dir / "alice.key")
    assert _mode(key_path) == 0o600
    text = cert_path.read_bytes()
    assert text.startswith(b"-----BEGIN CERTIFICATE-----") and text.rstrip().endswith(
        b"-----END CERTIFICATE-----"
    )
    assert text.count(b"-----BEGIN") == 1  # the certificate and nothing else
    cert, ca = _cert(cert_path), _cert(ca_dir / "ca.pem")
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "alice"
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert _ext(cert, x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    ) == ["fedgrid://client/alice"]
    ku = _ext(cert, x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_cert_sign
    assert not _ext(cert, x509.BasicConstraints).value.ca
    assert (
        _ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier
        == _ext(ca, x509.SubjectKeyIdentifier).value.digest
    )
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == timedelta(days=10) + pki.CLOCK_SKEW
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == cert.public_key()
    [record] = pki.list_certs(ca_dir)
    assert (record.name, record.kind, record.serial, record.status()) == (
        "alice",
        "client",
        cert.serial_number,
        "valid",
    )
    assert record.not_after == cert.not_valid_after_utc
    assert pki.identity_of(text) == "alice" and pki.serial_of(text) == cert.serial_number
    assert pki.identity_of(cert.public_bytes(serialization.Encoding.DER)) == "alice"


def test_server_certificate_sans_and_eku(ca_dir):
    cert = _cert(pki.issue(ca_dir, "coord", server=True, sans=["coord.example.org", "10.1.2.3", "::1"])[0])
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["coord.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("::1"),
    ]
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    with pytest.raises(ValueError, match="not a client certificate"):
        pki.identity_of(cert)
    default = _cert(pki.issue(ca_dir, "local", server=True)[0])
    san = _ext(default, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert [r.kind for r in pki.list_certs(ca_dir)] == ["server", "server"]


def test_issue_refuses_bad_names_duplicates_and_misplaced_sans(ca_dir):
    with pytest.raises(ValueError, match="position 3"):
        pki.issue(ca_dir, "bad\nname")
    with pytest.raises(ValueError, match="reserved"):
        pki.issue(ca_dir, "ca")
    with pytest.raises(ValueError, match="for server certificates"):
        pki.issue(ca_dir, "alice", sans=["x"])
    with pytest.raises(ValueError, match="neither an IP address nor"):
        pki.issue(ca_dir, "coord", server=True, sans=["bad host"])
    first = pki.issue(ca_dir, "alice")[0].read_bytes()
    with pytest.raises(PKIError, match="'alice' already has a valid certificate"):
        pki.issue(ca_dir, "alice")
    assert (ca_dir / "alice.pem").read_bytes() == first
    pki.revoke(ca_dir, "alice")
    second = pki.issue(ca_dir, "alice")[0].read_bytes()  # reissued after revocation
    assert pki.serial_of(second) != pki.serial_of(first)
    assert [r.status() for r in pki.list_certs(ca_dir)] == ["revoked", "valid"]


def test_issue_without_a_ca_names_the_missing_file(tmp_path):
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(PKIError, match=r"ca\.pem: no CA in .*fedgrid certs init"):
        pki.issue(tmp_path / "empty", "alice")


def test_a_leaf_never_outlives_its_ca(ca_dir):
    cert = _cert(pki.issue(ca_dir, "alice", days=365)[0])
    assert cert.not_valid_after_utc == _cert(ca_dir / "ca.pem").not_valid_after_utc


def test_expired_status(ca_dir):
    pki.issue(ca_dir, "alice", days=1)
    [record] = pki.list_certs(ca_dir)
    assert record.status(record.not_after + timedelta(seconds=1)) == "expired"
    assert record.status(record.not_after - timedelta(seconds=1)) == "valid"


def test_revoke_lists_the_serial_in_a_crl_signed_by_the_ca(ca_dir):
    alice = pki.serial_of(pki.issue(ca_dir, "alice")[0].read_bytes())
    bob = pki.serial_of(pki.issue(ca_dir, "bob")[0].read_bytes())
    assert pki.revoke(ca_dir, "alice") == [alice]
    crl = x509.load_pem_x509_crl((ca_dir / "crl.pem").read_bytes())
    ca = _cert(ca_dir / "ca.pem")
    assert crl.is_signature_valid(ca.public_key()) and crl.issuer == ca.subject
    assert [r.serial_number for r in crl] == [alice]
    assert crl.get_revoked_certificate_by_serial_number(bob) is None
    assert {r.name: r.status() for r in pki.list_certs(ca_dir)} == {"alice": "revoked", "bob": "valid"}
    assert pki.list_certs(ca_dir)[0].revoked_at is not None
    pki.revoke(ca_dir, "bob")
    assert sorted(
        r.serial_number for r in x509.load_pem_x509_crl((ca_dir / "crl.pem").read_bytes())
    ) == sorted([alice, bob])
    with pytest.raises(PKIError, match="no certificate named 'carol'"):
        pki.revoke(ca_dir, "carol")
    with pytest.raises(PKIError, match="revoked already"):
        pki.revoke(ca_dir, "bob")


# --- RevocationList -------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _bump_mtime(path: Path) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_revocation_list_follows_a_rewritten_crl_after_the_interval(ca_dir):
    serial = pki.serial_of(pki.issue(ca_dir, "alice")[0].read_bytes())
    clock = _Clock()
    crl = pki.RevocationList(ca_dir / "crl.pem", ca_dir / "ca.pem", interval_s=1.0, clock=clock)
    assert not crl.is_revoked(serial)
    pki.revoke(ca_dir, "alice")
    _bump_mtime(ca_dir / "crl.pem")
    assert not crl.is_revoked(serial)  # within the interval: not even a stat
    clock.t = 1.0
    assert crl.is_revoked(serial) and crl.serials == frozenset({serial})


def test_revocation_list_rereads_an_in_place_rewrite_by_mtime(ca_dir):
    serial = pki.serial_of(pki.issue(ca_dir, "alice")[0].read_bytes())
    crl = pki.RevocationList(ca_dir / "crl.pem", ca_dir / "ca.pem", interval_s=0)
    empty = (ca_dir / "crl.pem").read_bytes()
    pki.revoke(ca_dir, "alice")
    revoked = (ca_dir / "crl.pem").read_bytes()
    assert crl.is_revoked(serial)
    with open(ca_dir / "crl.pem", "wb") as f:  # same inode; only mtime (and size) tell
        f.write(empty)
    _bump_mtime(ca_dir / "crl.pem")
    assert not crl.is_revoked(serial)
    with open(ca_dir / "crl.pem", "wb") as f:
        f.write(revoked)
    _bump_mtime(ca_dir / "crl.pem")
    assert crl.is_revoked(serial)


def test_revocation_list_keeps_the_last_good_list_on_a_bad_rewrite(ca_dir, tmp_path, caplog):
    serial = pki.serial_of(pki.issue(ca_dir, "alice")[0].read_bytes())
    pki.revoke(ca_dir, "alice")
    crl = pki.RevocationList(ca_dir / "crl.pem", ca_dir / "ca.pem", interval_s=0)
    assert crl.is_revoked(serial)
    good = (ca_dir / "crl.pem").read_bytes()
    other = tmp_path / "other"
    pki.init_ca(other)  # a CRL signed by another CA
    for bad, problem in (
        (good[: len(good) // 2], "not a CRL"),
        ((other / "crl.pem").read_bytes(), "not signed by the CA"),
    ):
        caplog.clear()
        (ca_dir / "crl.pem").write_bytes(bad)
        _bump_mtime(ca_dir / "crl.pem")
        with caplog.at_level(logging.ERROR, logger="fedgrid.trust"):
            assert crl.is_revoked(serial)
            assert crl.is_revoked(serial)  # logged once per bad file, not once per call
        assert [
            problem in r.getMessage() and "keeping the last good" in r.getMessage() for r in caplog.records
        ] == [True]
    (ca_dir / "crl.pem").unlink()
    assert crl.is_revoked(serial) and not crl.reload()
    (ca_dir / "crl.pem").write_bytes(good)
    assert crl.reload() and crl.is_revoked(serial)


def test_revocation_list_fails_closed_on_first_load(ca_dir, tmp_path):
    with pytest.raises(PKIError, match="CRL file not found"):
        pki.RevocationList(tmp_path / "missing.pem", ca_dir / "ca.pem")
    (tmp_path / "junk.pem").write_bytes(b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n")
    with pytest.raises(PKIError, match="not a CRL"):
        pki.RevocationList(tmp_path / "junk.pem", ca_dir / "ca.pem")
    pki.init_ca(tmp_path / "other")
    with pytest.raises(PKIError, match="not signed by the CA"):
        pki.RevocationList(tmp_path / "other" / "crl.pem", ca_dir / "ca.pem")


def test_revocation_list_under_concurrent_readers(ca_dir):
    serial = pki.serial_of(pki.issue(ca_dir, "alice")[0].read_bytes())
    crl = pki.RevocationList(ca_dir / "crl.pem", ca_dir / "ca.pem", interval_s=0)
    seen: list[list[bool]] = [[] for _ in range(4)]
    start, revoked = threading.Barrier(5), threading.Event()

    def read(mine: list[bool]) -> None:
        start.wait(timeout=10)
        while not (revoked.is_set() and mine and mine[-1]) and len(mine) < 100_000:
            mine.append(crl.is_revoked(serial))

    threads = [threading.Thread(target=read, args=(mine,)) for mine in seen]
    for t in threads:
        t.start()
    start.wait(timeout=10)
    pki.revoke(ca_dir, "alice")
    revoked.set()
    for t in threads:
        t.join(timeout=30)
    for mine in seen:  # each reader: not revoked, then revoked for good (never a flicker back)
        assert mine[-1] and mine == sorted(mine), mine.count(True)


# --- enrollment -----------------------------------------------------------------------


def test_token_store_keeps_only_the_hash(ca_dir):
    token = pki.issue_token(ca_dir, name="alice", expires=timedelta(minutes=30))
    token_id, secret = token.split(".", 1)
    text = (ca_dir / "tokens.json").read_text()
    assert _mode(ca_dir / "tokens.json") == 0o600
    assert token_id in text and secret not in text
    assert pki.issue_token(ca_dir) != token
    with pytest.raises(ValueError, match="must be positive"):
        pki.issue_token(ca_dir, expires=timedelta(0))
    with pytest.raises(ValueError, match="identity"):
        pki.issue_token(ca_dir, name="bad name")


def test_enroll_issues_a_client_certificate_once(ca_dir):
    token = pki.issue_token(ca_dir, name="alice")
    key_pem, csr_pem = pki.make_csr("alice")
    cert_pem, name = pki.enroll(ca_dir, token, csr_pem, days=7)
    assert name == "alice" and pki.identity_of(cert_pem) == "alice"
    cert = x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(_cert(ca_dir / "ca.pem"))
    assert serialization.load_pem_private_key(key_pem, password=None).public_key() == cert.public_key()
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == timedelta(days=7) + pki.CLOCK_SKEW
    assert [(r.name, r.serial, r.kind) for r in pki.list_certs(ca_dir)] == [
        ("alice", cert.serial_number, "client")
    ]
    assert (ca_dir / "alice.pem").read_bytes() == cert_pem
    with pytest.raises(EnrollmentError, match="already used"):
        pki.enroll(ca_dir, token, pki.make_csr("alice")[1])
    assert len(pki.list_certs(ca_dir)) == 1
    assert issubclass(EnrollmentError, AuthenticationError)  # UNAUTHENTICATED at the servicer


def test_enrolling_a_reissued_name_drops_the_old_key(ca_dir):
    pki.issue(ca_dir, "alice")
    pki.revoke(ca_dir, "alice")
    cert_pem, _ = pki.enroll(ca_dir, pki.issue_token(ca_dir), pki.make_csr("alice")[1])
    assert (ca_dir / "alice.pem").read_bytes() == cert_pem and not (ca_dir / "alice.key").exists()
    assert [r.status() for r in pki.list_certs(ca_dir)] == ["revoked", "valid"]


def test_concurrent_enrollments_with_one_token_issue_one_certificate(ca_dir):
    token = pki.issue_token(ca_dir)
    csrs = [pki.make_csr(f"client-{i}")[1] for i in range(6)]
    start = threading.Barrier(len(csrs))
    results: list[object] = [None] * len(csrs)

    def go(i: int) -> None:
        start.wait(timeout=10)
        try:
            results[i] = pki.enroll(ca_dir, token, csrs[i])
        except EnrollmentError as exc:
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(csrs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    won = [r for r in results if isinstance(r, tuple)]
    lost = [r for r in results if isinstance(r, EnrollmentError)]
    assert len(won) == 1 and len(lost) == len(csrs) - 1
    assert all("already used" in str(e) for e in lost)
    assert [r.name for r in pki.list_certs(ca_dir)] == [won[0][1]]


@pytest.mark.parametrize("when", [timedelta(hours=1), timedelta(hours=1, seconds=1)])
def test_an_expired_token_is_refused(ca_dir, monkeypatch, when):
    token = pki.issue_token(ca_dir, expires=timedelta(hours=1))
    _later(monkeypatch, when)
    with pytest.raises(EnrollmentError, match="expired"):
        pki.enroll(ca_dir, token, pki.make_csr("alice")[1])
    assert pki.list_certs(ca_dir) == []


def test_a_revoked_token_is_refused(ca_dir):
    token = pki.issue_token(ca_dir)
    pki.revoke_token(ca_dir, token.split(".")[0])
    with pytest.raises(EnrollmentError, match="revoked"):
        pki.enroll(ca_dir, token, pki.make_csr("alice")[1])
    with pytest.raises(PKIError, match="no enrollment token with id 'nope'"):
        pki.revoke_token(ca_dir, "nope")


def test_enroll_refuses_wrong_tokens_and_names(ca_dir):
    token = pki.issue_token(ca_dir, name="alice")
    token_id, secret = token.split(".", 1)
    csr = pki.make_csr("alice")[1]
    for bad in (f"{token_id}.x{secret}", f"ffff{token_id}.{secret}"):
        with pytest.raises(EnrollmentError, match="unknown enrollment token"):
            pki.enroll(ca_dir, bad, csr)
    for bad in ("nodot", ".secret", "id."):
        with pytest.raises(EnrollmentError, match="malformed enrollment token"):
            pki.enroll(ca_dir, bad, csr)
    with pytest.raises(
        EnrollmentError, match="name mismatch: the token is for 'alice', the CSR asks for 'bob'"
    ):
        pki.enroll(ca_dir, token, pki.make_csr("bob")[1])
    pki.issue(ca_dir, "carol")
    with pytest.raises(EnrollmentError, match="'carol' already has a valid certificate"):
        pki.enroll(ca_dir, pki.issue_token(ca_dir), pki.make_csr("carol")[1])
    assert pki.enroll(ca_dir, token, csr)[1] == "alice"  # the refusals spent nothing


def _csr(cn: str | None, key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn is not None else [])
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )


def test_enroll_refuses_bad_csrs(ca_dir):
    token = pki.issue_token(ca_dir)
    der = bytearray(x509.load_pem_x509_csr(_csr("alice")).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the last byte of the signature
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(EnrollmentError, match="CSR signature invalid"):
        pki.enroll(ca_dir, token, tampered)
    with pytest.raises(EnrollmentError, match="not a PEM certificate request"):
        pki.enroll(ca_dir, token, b"hello")
    with pytest.raises(EnrollmentError, match=r"CSR name invalid: .*character '\\x1b'"):
        pki.enroll(ca_dir, token, _csr("\x1b[31mred"))
    with pytest.raises(EnrollmentError, match="exactly one common name"):
        pki.enroll(ca_dir, token, _csr(None))
    with pytest.raises(EnrollmentError, match="CSR name invalid: name 'ca' is reserved"):
        pki.enroll(ca_dir, token, _csr("ca"))
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bob")]))
        .sign(small, hashes.SHA256())
    )
    with pytest.raises(EnrollmentError, match="CSR key unsupported"):
        pki.enroll(ca_dir, token, weak.public_bytes(serialization.Encoding.PEM))
    assert pki.enroll(ca_dir, token, _csr("alice"))[1] == "alice"  # still unused


def test_make_csr_checks_the_name():
    with pytest.raises(ValueError, match="129 characters"):
        pki.make_csr("x" * 129)


# --- identity_of on certificates made elsewhere ---------------------------------------


def _make_ca(cn: str, key=None, *, days: int = 30, issuer: tuple | None = None, ca: bool = True):
    """A certificate made with cryptography directly, as another PKI would: (cert, key)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    issuer_cert, issuer_key = issuer or (None, key)
    now = datetime.now(timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1 - days) if days < 0 else now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256()), key


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key(key, password: bytes | None = None, fmt=serialization.PrivateFormat.TraditionalOpenSSL) -> bytes:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, fmt, enc)


def test_identity_of_refuses_certificates_without_a_valid_identity():
    ca = _make_ca("root")
    assert pki.identity_of(_pem(_make_ca("site-7", issuer=ca, ca=False)[0])) == "site-7"
    with pytest.raises(ValueError, match=r"character ' '"):
        pki.identity_of(_pem(_make_ca("two words", issuer=ca, ca=False)[0]))
    with pytest.raises(ValueError, match="no extended key usage"):
        pki.identity_of(_pem(ca[0]))


@pytest.fixture
def own_pki(tmp_path: Path) -> dict[str, Path]:
    """A PKI made elsewhere: an RSA root, an EC intermediate, an RSA leaf with the
    intermediate after it, and a CA bundle of two unrelated roots plus this one."""
    root = _make_ca("Corp Root", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    inter = _make_ca("Corp Issuing CA", issuer=root)
    leaf = _make_ca(
        "hospital-3", rsa.generate_private_key(public_exponent=65537, key_size=2048), issuer=inter, ca=False
    )
    files = {
        "bundle": tmp_path / "bundle.pem",
        "cert": tmp_path / "leaf.pem",
        "key": tmp_path / "leaf.key",
        "root": tmp_path / "root.pem",
        "inter_key": tmp_path / "inter.key",
    }
    files["bundle"].write_bytes(
        _pem(_make_ca("Other Root A")[0]) + _pem(root[0]) + _pem(_make_ca("Other Root B")[0])
    )
    files["cert"].write_bytes(_pem(leaf[0]) + _pem(inter[0]))
    files["key"].write_bytes(_key(leaf[1]))  # PKCS#1 "BEGIN RSA PRIVATE KEY", as openssl writes it
    files["root"].write_bytes(_pem(root[0]))
    return files


def test_load_pem_files_accepts_a_pki_made_elsewhere(own_pki):
    ca, cert, key = pki.load_pem_files(own_pki["bundle"], own_pki["cert"], own_pki["key"])
    assert (
        ca == own_pki["bundle"].read_bytes()
        and cert == own_pki["cert"].read_bytes()
        and key == own_pki["key"].read_bytes()
    )
    assert key.startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    assert pki.identity_of(cert) == "hospital-3"


def test_load_pem_files_accepts_fedgrid_files(ca_dir):
    pki.issue(ca_dir, "coord", server=True)
    ca, cert, key = pki.load_pem_files(ca_dir / "ca.pem", ca_dir / "coord.pem", ca_dir / "coord.key")
    assert cert == (ca_dir / "coord.pem").read_bytes()


def test_load_pem_files_accepts_a_direct_rsa_leaf(tmp_path):
    root = _make_ca("root", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    leaf = _make_ca(
        "node", rsa.generate_private_key(public_exponent=65537, key_size=2048), issuer=root, ca=False
    )
    (tmp_path / "ca.pem").write_bytes(_pem(root[0]))
    (tmp_path / "c.pem").write_bytes(_pem(leaf[0]))
    (tmp_path / "c.key").write_bytes(_key(leaf[1], fmt=serialization.PrivateFormat.PKCS8))
    pki.load_pem_files(tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "c.key")


def test_load_pem_files_names_the_bad_file(own_pki, tmp_path, ca_dir):
    b, c, k = own_pki["bundle"], own_pki["cert"], own_pki["key"]
    with pytest.raises(PKIError, match=r"nope\.pem: CA certificate bundle file not found"):
        pki.load_pem_files(tmp_path / "nope.pem", c, k)
    with pytest.raises(PKIError, match=r"nope\.key: private key file not found"):
        pki.load_pem_files(b, c, tmp_path / "nope.key")
    (tmp_path / "text.pem").write_text("not a certificate\n")
    with pytest.raises(PKIError, match=r"text\.pem: not a PEM certificate"):
        pki.load_pem_files(b, tmp_path / "text.pem", k)
    with pytest.raises(PKIError, match=r"leaf\.pem: not a PEM private key"):
        pki.load_pem_files(b, c, c)
    pki.issue(ca_dir, "alice")
    with pytest.raises(
        PKIError, match=r"alice\.key: the private key does not match the certificate .*leaf\.pem"
    ):
        pki.load_pem_files(b, c, ca_dir / "alice.key")
    with pytest.raises(
        PKIError, match=r"leaf\.pem: certificate CN=hospital-3 is not signed by any certificate in .*ca\.pem"
    ):
        pki.load_pem_files(ca_dir / "ca.pem", c, k)
    (tmp_path / "leaf-only.pem").write_bytes(
        c.read_bytes().split(b"-----END CERTIFICATE-----")[0] + b"-----END CERTIFICATE-----\n"
    )
    with pytest.raises(PKIError, match="is not signed by any certificate"):  # the intermediate is missing
        pki.load_pem_files(b, tmp_path / "leaf-only.pem", k)
    leaf = serialization.load_pem_private_key(k.read_bytes(), password=None)
    (tmp_path / "enc.key").write_bytes(_key(leaf, b"secret"))
    with pytest.raises(PKIError, match=r"enc\.key: the private key is encrypted"):
        pki.load_pem_files(b, c, tmp_path / "enc.key")


def test_load_pem_files_refuses_an_expired_certificate(tmp_path):
    root = _make_ca("root")
    old = _make_ca("old", issuer=root, ca=False, days=-1)
    (tmp_path / "ca.pem").write_bytes(_pem(root[0]))
    (tmp_path / "old.pem").write_bytes(_pem(old[0]))
    (tmp_path / "old.key").write_bytes(_key(old[1]))
    with pytest.raises(PKIError, match=r"old\.pem: certificate CN=old expired on"):
        pki.load_pem_files(tmp_path / "ca.pem", tmp_path / "old.pem", tmp_path / "old.key")
