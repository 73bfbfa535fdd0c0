"""SecAgg+ identities from certificates, with no I/O: a client's Ed25519 advert key bound to
the identity its X.509 client certificate proves.

A client makes an Ed25519 key and signs ``(identity, Ed25519 public key)`` with its
certificate's private key (EC or RSA); the credential (certificate, Ed25519 key, that
signature) travels in each advert. A peer's ``CertificateKeyring`` accepts the Ed25519 key
for an identity only if the certificate is signed by one of its CA certificates, is valid now,
is a client certificate whose common name is that identity (``fedgrid.trust.identity_of``),
and its key signed the binding. A coordinator relaying the adverts cannot present a key of its
own for any client without a certificate of the CA for that client's name.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedgrid.aggregation.secagg_crypto import SecAggRefusedError, pack_fields, raw_public, unpack_fields
from fedgrid.trust import identity_of

__all__ = ["CertificateKeyring", "certificate_credential"]

_BINDING = b"fedgrid-secagg-identity-key"


def _binding(name: str, ed25519_public: bytes) -> bytes:
    return _BINDING + pack_fields(name.encode(), ed25519_public)


def certificate_credential(cert_pem: bytes, key_pem: bytes, signer: Ed25519PrivateKey) -> tuple[str, bytes]:
    """The identity of the client certificate ``cert_pem`` and the credential binding
    ``signer``'s public key to it, signed with the certificate's key ``key_pem``.

    Raises:
        ValueError: not a client certificate, or a key of another kind than EC or RSA.
    """
    cert = x509.load_pem_x509_certificate(cert_pem)
    name = identity_of(cert)
    key = serialization.load_pem_private_key(key_pem, password=None)
    public = raw_public(signer)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(_binding(name, public), ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(_binding(name, public), padding.PKCS1v15(), hashes.SHA256())
    else:
        raise ValueError(f"a certificate key of type {type(key).__name__}: EC or RSA needed")
    return name, pack_fields(cert.public_bytes(serialization.Encoding.DER), public, signature)


class CertificateKeyring:
    """A ``Keyring`` that takes each identity's Ed25519 key from the credential in its advert,
    checked against the CA certificates ``ca_pem`` (a PEM bundle; certificates signed directly
    by one of them)."""

    def __init__(self, ca_pem: bytes) -> None:
        self.cas: Sequence[x509.Certificate] = x509.load_pem_x509_certificates(ca_pem)

    def public_key(self, name: str, credential: bytes = b"") -> Ed25519PublicKey | None:
        if not credential:
            return None
        der, public, signature = unpack_fields(credential, 3)
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            raise SecAggRefusedError(f"identity {name[:64]!r}: its credential holds no certificate") from None
        if not any(self._issued_by(cert, ca) for ca in self.cas):
            raise SecAggRefusedError(f"identity {name[:64]!r}: its certificate is not signed by the CA")
        now = datetime.now(timezone.utc)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise SecAggRefusedError(f"identity {name[:64]!r}: its certificate is expired or not yet valid")
        try:
            if identity_of(cert) != name:
                raise SecAggRefusedError(f"identity {name[:64]!r}: its certificate is another identity's")
        except ValueError as exc:
            raise SecAggRefusedError(f"identity {name[:64]!r}: {exc}") from None
        key = cert.public_key()
        try:
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, _binding(name, public), ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, rsa.RSAPublicKey):
                key.verify(signature, _binding(name, public), padding.PKCS1v15(), hashes.SHA256())
            else:
                return None
        except InvalidSignature:
            raise SecAggRefusedError(
                f"identity {name[:64]!r}: its certificate's key did not bind this advert key"
            ) from None
        return Ed25519PublicKey.from_public_bytes(public)

    @staticmethod
    def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            return False
