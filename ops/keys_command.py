"""`epd keys --out DIR`: a stack's CURVE keys (server and client pairs, ZeroMQ certificate format).

With them every service link is encrypted and a service admits only clients holding the client
pair (services/runtime/curve.py). The files are made in a private temporary dir inside DIR and
moved into place together, so a failed run leaves no half set; secrets are mode 0600.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.runtime.curve import KEY_FILES, KEYS_ENV, SECRET_FILES

PUBLIC_MODE, SECRET_MODE, DIR_MODE = 0o644, 0o600, 0o700
ROLES = {
    "server.key": "server public key: every client (service link, tool) checks the server with it",
    "server.key_secret": "server secret key: every service's inbox; keep private",
    "client.key": "client public key: the only client key a service admits",
    "client.key_secret": "client secret key: every service and tool that connects; keep private",
}


def write_keys(out: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Write the four key files into `out` (made mode 0700 if absent); FileExistsError if any of
    them exists and not `force`."""
    import zmq.auth
    out = Path(out)
    existing = [name for name in KEY_FILES if (out / name).exists()]
    if existing and not force:
        raise FileExistsError(f"{out} already holds {', '.join(existing)} (pass --force to replace them)")
    if not out.exists():
        out.mkdir(mode=DIR_MODE, parents=True)
        out.chmod(DIR_MODE)   # mkdir's mode is masked by the umask
    elif not out.is_dir():
        raise NotADirectoryError(f"{out}: not a directory")
    staging = Path(tempfile.mkdtemp(prefix=".epd-keys-", dir=out))   # mode 0700: secrets never readable
    try:
        for name in ("server", "client"):
            zmq.auth.create_certificates(staging, name)
        for name in KEY_FILES:
            (staging / name).chmod(SECRET_MODE if name in SECRET_FILES else PUBLIC_MODE)
        for name in KEY_FILES:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in KEY_FILES]


def run(args) -> int:
    try:
        paths = write_keys(args.out, force=args.force)
    except (FileExistsError, NotADirectoryError, OSError) as exc:
        print(f"epd keys: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    print(f"epd keys: wrote the CURVE keys of one stack to {out.resolve()}/ "
          f"(dir mode {oct(out.stat().st_mode & 0o777)[2:]})")
    for path in paths:
        print(f"  {path.name:<18} {oct(path.stat().st_mode & 0o777)[2:]}  {ROLES[path.name]}")
    print(f"""Use them (every service and tool of one stack uses the same dir):
  local stack  epd up --keys {out}   (epd status finds them; for other tools export {KEYS_ENV}={out},
               or pass --keys: epd health --keys {out} --address ..., epd tap --keys {out} ...)
  a service    {KEYS_ENV}=<the dir> in its environment
  Compose      mount the dir as a secret (e.g. /run/secrets/epd-keys) and set {KEYS_ENV} to it
  Kubernetes   kubectl create secret generic epd-keys --from-file={out}
               then mount the secret as a volume and set {KEYS_ENV} to its mount path""")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("keys", help="make a stack's CURVE keys (encrypted, authenticated service links)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write them (made mode 0700)")
    parser.add_argument("--force", action="store_true", help="replace keys already in DIR")
    parser.set_defaults(func=run)
