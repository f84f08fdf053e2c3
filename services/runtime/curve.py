"""ZeroMQ CURVE on the stack's links: encryption, and only the stack's own clients admitted.

A stack's keys dir (made by `epd keys`) holds two ZeroMQ certificates (zmq.auth format): the
server pair, which every Inbox (ROUTER, bind) serves with, and the client pair, which every Link
(DEALER, connect) and every tool presents. CURVE alone only encrypts: a CURVE server admits any
client that knows the server's public key. What admits only this stack's client key is a ZAP
handler in the server's zmq.Context (zmq.auth's ThreadAuthenticator, one per context), so
`serve_curve` refuses a socket whose context has none running.

ServiceConfig.keys_dir (EPD_KEYS_DIR) empty = plaintext. A keys dir with a file missing or a bad
key fails with a KeysError naming the file, before any socket opens.
"""
from __future__ import annotations

import hmac
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

KEYS_ENV = "EPD_KEYS_DIR"
SERVER_PUBLIC, SERVER_SECRET = "server.key", "server.key_secret"
CLIENT_PUBLIC, CLIENT_SECRET = "client.key", "client.key_secret"
KEY_FILES = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET)
SECRET_FILES = (SERVER_SECRET, CLIENT_SECRET)
ZAP_DOMAIN = "epd"   # set on every CURVE inbox; the authenticator answers for this domain only

# Contexts with a running authenticator for this stack's client key (see serve_curve).
_guarded: "weakref.WeakSet[zmq.Context]" = weakref.WeakSet()


class KeysError(ValueError):
    """A keys dir that cannot be used: a file missing, unreadable, or not a valid key."""


@dataclass(frozen=True)
class CurveKeys:
    """The z85-encoded keys of one stack. `server_secret` is None for a client-only load (tools)."""
    directory: str
    server_public: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)
    server_secret: bytes | None = field(default=None, repr=False)


def load_keys(directory: str | os.PathLike, *, server: bool = True) -> CurveKeys:
    """Read and check a keys dir. `server=False` (a tool that only connects) skips server.key_secret."""
    root = Path(directory)
    if not root.is_dir():
        raise KeysError(f"keys dir {root}: not a directory (make one with `epd keys --out {root}`)")
    server_public, _ = _read_certificate(root / SERVER_PUBLIC, secret=False)
    client_public, _ = _read_certificate(root / CLIENT_PUBLIC, secret=False)
    client_pair_public, client_secret = _read_certificate(root / CLIENT_SECRET, secret=True)
    _same_pair(root / CLIENT_PUBLIC, client_public, root / CLIENT_SECRET, client_pair_public)
    server_secret = None
    if server:
        server_pair_public, server_secret = _read_certificate(root / SERVER_SECRET, secret=True)
        _same_pair(root / SERVER_PUBLIC, server_public, root / SERVER_SECRET, server_pair_public)
    return CurveKeys(str(root), server_public, client_public, client_secret, server_secret)


def keys_from_env(environ: Mapping[str, str] = os.environ, explicit: str | None = None) -> CurveKeys | None:
    """A tool's client keys: from `explicit` (a --keys flag), else EPD_KEYS_DIR; None = plaintext."""
    directory = explicit if explicit is not None else environ.get(KEYS_ENV, "")
    return load_keys(directory, server=False) if directory else None


def _read_certificate(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"{path}: missing (a keys dir holds {', '.join(KEY_FILES)}; make one with `epd keys`)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: not a readable ZeroMQ certificate ({exc})") from None
    _check_key(path, "public-key", public)
    if not secret:
        return public, None
    if secret_key is None:
        raise KeysError(f"{path}: no secret-key in it")
    _check_key(path, "secret-key", secret_key)
    if zmq.curve_public(secret_key) != public:
        raise KeysError(f"{path}: its secret-key does not belong to its public-key")
    return public, secret_key


def _check_key(path: Path, name: str, key: bytes) -> None:
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise KeysError(f"{path}: {name} is not a 40-character z85 CURVE key")


def _same_pair(public_path: Path, public: bytes, secret_path: Path, paired: bytes) -> None:
    if not hmac.compare_digest(public, paired):
        raise KeysError(f"{public_path} and {secret_path} are not one key pair")


# ---- sockets -------------------------------------------------------------------------------
class _ClientKeyCheck:
    """ZAP credentials provider: admits exactly the stack's client public key."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        # runs on the authenticator's thread; a refused client does not retry, so this cannot flood
        structlog.get_logger().warning("curve.client_refused", client_key=key.decode(errors="replace"))
        return False


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """The ZAP handler of `ctx` (a thread): CURVE inboxes of this context admit only keys.client_public.
    Stop it with `stop_authenticator` before the context is destroyed."""
    auth = ThreadAuthenticator(ctx)
    auth.configure_curve_callback(ZAP_DOMAIN, _ClientKeyCheck(keys.client_public))   # before any request
    auth.start()
    _guarded.add(ctx)
    return auth


def stop_authenticator(auth: ThreadAuthenticator) -> None:
    _guarded.discard(auth.context)
    auth.stop()


def serve_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a not yet bound socket a CURVE server of this stack (call before bind)."""
    if keys.server_secret is None:
        raise KeysError(f"{keys.directory}: these keys were loaded without {SERVER_SECRET}; a bound socket needs it")
    if sock.context not in _guarded:   # without ZAP every client knowing the server key would be admitted
        raise RuntimeError("CURVE server socket on a context without a running authenticator (start_authenticator)")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def connect_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a not yet connected socket a CURVE client of this stack (call before connect)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
