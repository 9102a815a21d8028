"""Keys for kiln's signed provenance: where they are read from, which kinds, and their ids.

A key is named by a *reference*: a file path, ``env:NAME`` (an environment variable holding the
PEM text, as CI secrets arrive) or ``fd:N`` (an open file descriptor, as ``3< key.pem`` or a
secret mount hands one over without the key ever touching a path). Private keys sign
(``kiln sign``, ``bake --sign-key``), public keys verify (``restore --verify-key``); both are PEM,
unencrypted, Ed25519 or ECDSA P-256 — what ``openssl genpkey`` makes and what cosign, in-toto and
securesystemslib all read, so an attestation kiln writes verifies elsewhere too.

A key's id is its OpenSSH SHA256 fingerprint (``SHA256:…``, as ``ssh-keygen -l`` prints it). That
is the id the Go DSSE verifier (cosign's) computes for a key and compares with a signature's
``keyid`` hint, so kiln's envelopes verify there; it is also a short, recognisable name to print.

Torch-free. ``cryptography`` and ``securesystemslib`` (the ``[sign]`` extra) are imported only
when a key is used, so a restore without ``--verify-key`` and a bake without ``--sign-key`` never
need them; without them a key is a usage error (exit 2) naming the extra.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import Param, UsageError, Worded
from kiln.installs import extra_hint

if TYPE_CHECKING:
    from securesystemslib.signer import Signature, Signer, SSlibKey

MAX_KEY_BYTES = 64 << 10  # a PEM key is a few hundred bytes
VERIFY_KEY_ENV = "KILN_VERIFY_KEY"
KINDS = "Ed25519 or ECDSA P-256"
_PEM_BEGIN = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")


def article(word: str) -> str:
    """``a`` or ``an`` before ``word`` as it is read aloud: an RSA key, an EC key, a DSA key."""
    first = word[:1]
    spelled = word.split(" ")[0].isupper() and len(word.split(" ")[0]) <= 5  # RSA, EC, DSA
    return "an" if first in "AEIOUaeiou" or (spelled and first in "FHLMNRSX") else "a"


def require_sign_extra() -> None:
    """Import what signing and verifying need, or say in one line how to get it (exit 2)."""
    try:
        import cryptography  # noqa: F401
        import securesystemslib.dsse
        import securesystemslib.signer  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"signed provenance needs the [sign] extra ({exc.name} is missing): "
            + extra_hint("sign")
        ) from None


def read_key_bytes(ref: str, param: str) -> bytes:
    """The bytes ``ref`` names (a path, ``env:NAME`` or ``fd:N``), bounded; :class:`UsageError`
    (exit 2) for anything that cannot be read, quoting the reference as the parameter ``param``
    that gave it (``verify_keys=pub.pem``; the CLI says its flag: ``--verify-key pub.pem``)."""
    where = Worded(Param(param, ref))
    if not ref:
        raise UsageError(Worded(Param(param), ": empty key reference (a path, env:NAME or fd:N)"))
    if ref.startswith("env:"):
        name = ref[4:]
        value = os.environ.get(name) if name else None
        if value is None:
            raise UsageError(Worded(where, f": environment variable {name or '(none)'} is not set"))
        data = value.encode()
    elif ref.startswith("fd:"):
        number = ref[3:]
        if not number.isdigit():
            raise UsageError(Worded(where, ": expected fd:N with N a file descriptor number"))
        try:
            # A duplicate, so the caller's descriptor stays open (it is read to its end anyway).
            with os.fdopen(os.dup(int(number)), "rb") as fh:
                data = fh.read(MAX_KEY_BYTES + 1)
        except OSError as exc:
            raise UsageError(Worded(where, f": cannot read: {exc.strerror}")) from None
    else:
        try:
            with open(Path(ref), "rb") as fh:
                data = fh.read(MAX_KEY_BYTES + 1)
        except FileNotFoundError:
            raise UsageError(Worded(where, ": no such file")) from None
        except OSError as exc:
            raise UsageError(Worded(where, f": cannot read: {exc.strerror}")) from None
    if len(data) > MAX_KEY_BYTES:
        raise UsageError(Worded(where, f": more than {MAX_KEY_BYTES} bytes: not a PEM key"))
    if not data.strip():
        raise UsageError(Worded(where, ": empty"))
    return data


def _pem_kinds(data: bytes) -> list[str]:
    return [m.group(1).decode() for m in _PEM_BEGIN.finditer(data)]


def key_id(public_key: Any) -> str:
    """The OpenSSH SHA256 fingerprint of a ``cryptography`` public key: ``SHA256:<base64>``."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    blob = public_key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).split()[1]
    digest = hashlib.sha256(base64.b64decode(blob)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _check_kind(key: Any, where: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and isinstance(
        key.curve, ec.SECP256R1
    ):
        return
    kind = type(key).__name__.lstrip("_").replace("PrivateKey", "").replace("PublicKey", "")
    curve = getattr(getattr(key, "curve", None), "name", None)
    shown = f"{kind} ({curve})" if curve else kind
    raise UsageError(
        Worded(where, f": {article(shown)} {shown} key; kiln signs and verifies with {KINDS} keys")
    )


def _sslib_key(public_key: Any) -> SSlibKey:
    from securesystemslib.signer import SSlibKey

    return SSlibKey.from_crypto(public_key, keyid=key_id(public_key))


@dataclass(frozen=True)
class SigningKey:
    """A private key ready to sign: ``ref`` is how it was named (never its contents)."""

    ref: str
    keyid: str
    signer: Signer


@dataclass(frozen=True)
class VerifyKey:
    """A trusted public key: ``ref`` is how it was named, ``keyid`` its fingerprint."""

    ref: str
    keyid: str
    key: SSlibKey

    def verifies(self, signature_hex: str, data: bytes) -> bool:
        """Whether this key made ``signature_hex`` over ``data``, whatever keyid the signature
        claims: in DSSE the keyid is an unauthenticated hint, so it is never the reason to trust
        (or to skip) a signature."""
        from securesystemslib.exceptions import UnverifiedSignatureError
        from securesystemslib.signer import Signature

        claimed: Signature = Signature(self.key.keyid, signature_hex)
        try:
            self.key.verify_signature(claimed, data)
        except UnverifiedSignatureError:  # and its subclass VerificationError (malformed input)
            return False
        return True


def load_signing_key(ref: str, param: str = "key") -> SigningKey:
    """Read and check a PEM private key (exit 2 for anything that is not a usable one)."""
    require_sign_extra()
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    where = Worded(Param(param, ref))
    data = read_key_bytes(ref, param)
    kinds = _pem_kinds(data)
    if kinds and all("PRIVATE" not in k for k in kinds):
        raise UsageError(
            Worded(
                where,
                f": holds {article(kinds[0])} {kinds[0]}, not a private key: "
                "sign with the private key",
            )
        )
    try:
        key = load_pem_private_key(data, password=None)
    except TypeError:
        raise UsageError(
            Worded(
                where,
                ": the key is encrypted; kiln reads unencrypted PEM keys (keep the key in a "
                "CI secret and pass it as env:NAME or fd:N)",
            )
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise UsageError(
            Worded(
                where,
                ": not a PEM private key (make one with `openssl genpkey -algorithm ed25519`)",
            )
        ) from None
    _check_kind(key, where)
    public = key.public_key()
    return SigningKey(ref, key_id(public), CryptoSigner(key, _sslib_key(public)))


def load_verify_key(ref: str, param: str = "verify_keys") -> VerifyKey:
    """Read and check one PEM public key (exit 2 for anything that is not a usable one)."""
    require_sign_extra()
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    where = Worded(Param(param, ref))
    data = read_key_bytes(ref, param)
    kinds = _pem_kinds(data)
    if any("PRIVATE" in k for k in kinds):
        raise UsageError(
            Worded(
                where,
                ": holds a private key; verify with the public key only "
                "(`openssl pkey -in key.pem -pubout -out pub.pem`)",
            )
        )
    if len(kinds) > 1:
        raise UsageError(
            Worded(where, f": holds {len(kinds)} PEM blocks; give one key per ", Param(param))
        )
    try:
        key = load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise UsageError(Worded(where, ": not a PEM public key")) from None
    _check_kind(key, where)
    return VerifyKey(ref, key_id(key), _sslib_key(key))


def load_verify_keys(refs: Iterable[str | Path], param: str = "verify_keys") -> list[VerifyKey]:
    keys = [load_verify_key(str(ref), param) for ref in refs]
    if not keys:
        raise UsageError(Worded(Param(param), ": no key given"))
    return keys


def verify_keys_from_env(environ: dict[str, str] | None = None) -> list[str] | None:
    """``KILN_VERIFY_KEY`` as key references (comma- or newline-separated), or None when unset.

    Set but empty is a usage error, never "verify nothing": a secret that failed to mount must not
    turn verification off silently.
    """
    env = os.environ if environ is None else environ
    value = env.get(VERIFY_KEY_ENV)
    if value is None:
        return None
    refs = [part.strip() for part in re.split(r"[,\n]", value) if part.strip()]
    if not refs:
        raise UsageError(f"{VERIFY_KEY_ENV} is set but names no key (paths, env:NAME or fd:N)")
    return refs


def as_refs(keys: str | Path | Sequence[str | Path] | None) -> list[str]:
    """Library callers may pass one reference or several."""
    if keys is None:
        return []
    if isinstance(keys, (str, Path)):
        return [str(keys)]
    return [str(k) for k in keys]
