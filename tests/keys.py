"""Signing keys for tests: real key pairs as PEM files, as `openssl genpkey` and `openssl pkey
-pubout` make them (PKCS#8 private, SubjectPublicKeyInfo public). Needs `cryptography`, which
the [sign] extra brings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path

    def private_pem(self) -> str:
        return self.private.read_text()


def make_key(directory: Path, name: str, kind: str = "ed25519") -> KeyPair:
    """A fresh key pair (``kind`` ed25519 or p256) as ``NAME.pem`` and ``NAME.pub.pem``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    key = (
        ed25519.Ed25519PrivateKey.generate()
        if kind == "ed25519"
        else ec.generate_private_key(ec.SECP256R1())
    )
    private, public = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return KeyPair(private, public)
