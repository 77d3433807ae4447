"""Optional CURVE encryption and authentication for TCP between processes (`server.curve_keys_dir`).

One deployment key (made by `omni-server keys DIR`) is shared by every process of a pipeline: each
bound socket is a CURVE server with it, each connecting socket a CURVE client with it, and a ZAP
handler admits only clients whose public key is in the directory. A peer without the secret key
can neither read the traffic nor get a message accepted.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.asyncio

KEY_NAME = "omni"


def create_keys(directory: str | os.PathLike[str]) -> Path:
    """Write a new deployment keypair (`omni.key` public, `omni.key_secret` private, mode 0600)."""
    import zmq.auth

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (path / f"{KEY_NAME}.key_secret").exists():
        raise FileExistsError(f"{path / (KEY_NAME + '.key_secret')} exists; remove it to make a new key")
    public, secret = zmq.auth.create_certificates(str(path), KEY_NAME)
    os.chmod(secret, 0o600)
    return Path(secret)


class Curve:
    def __init__(self, keys_dir: str | os.PathLike[str]):
        import zmq.auth

        self.keys_dir = Path(keys_dir)
        secret_file = self.keys_dir / f"{KEY_NAME}.key_secret"
        if not secret_file.is_file():
            raise FileNotFoundError(f"no CURVE key at {secret_file}; create one with `omni-server keys {keys_dir}`")
        self.public, self.secret = zmq.auth.load_certificate(str(secret_file))
        self._auth = None

    def start_authenticator(self, ctx: zmq.Context) -> None:
        """Admit only CURVE clients whose public key is in keys_dir (one per context)."""
        if isinstance(ctx, zmq.asyncio.Context):
            from zmq.auth.asyncio import AsyncioAuthenticator as Authenticator
        else:
            from zmq.auth.thread import ThreadAuthenticator as Authenticator
        self._auth = Authenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(self.keys_dir))

    def server(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def curve_for(keys_dir: str | None) -> Curve | None:
    return Curve(keys_dir) if keys_dir else None
