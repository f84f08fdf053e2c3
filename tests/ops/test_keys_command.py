"""`epd keys --out DIR`: four ZeroMQ certificates a service can load, private modes, no overwrite
without --force."""
from __future__ import annotations

import stat
from pathlib import Path

from ops.cli import main
from services.runtime.curve import KEY_FILES, load_keys


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_writes_four_loadable_files_with_private_modes(tmp_path, capsys):
    out = tmp_path / "deep" / "keys"
    assert main(["keys", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(KEY_FILES)   # no staging dir left behind
    assert mode(out) == 0o700
    assert {name: mode(out / name) for name in KEY_FILES} == {
        "server.key": 0o644, "client.key": 0o644, "server.key_secret": 0o600, "client.key_secret": 0o600}
    assert "secret-key" not in (out / "server.key").read_text() + (out / "client.key").read_text()
    keys = load_keys(out)   # what a service does at start
    assert keys.server_public != keys.client_public and keys.server_secret is not None
    printed = capsys.readouterr().out
    assert all(name in printed for name in KEY_FILES)
    assert f"kubectl create secret generic epd-keys --from-file={out}" in printed
    assert f"epd up --keys {out}" in printed and "EPD_KEYS_DIR" in printed


def test_keys_refuses_to_overwrite_and_force_replaces(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keys", "--out", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in KEY_FILES}
    capsys.readouterr()
    assert main(["keys", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "already holds" in err and "--force" in err
    assert {name: (out / name).read_bytes() for name in KEY_FILES} == before
    assert main(["keys", "--out", str(out), "--force"]) == 0
    after = {name: (out / name).read_bytes() for name in KEY_FILES}
    assert all(after[name] != before[name] for name in KEY_FILES)
    assert mode(out / "client.key_secret") == 0o600
    load_keys(out)


def test_keys_refuses_when_one_key_file_is_already_there(tmp_path, capsys):
    out = tmp_path / "keys"
    out.mkdir()
    (out / "client.key_secret").write_text("someone's key\n")
    assert main(["keys", "--out", str(out)]) == 1
    assert "client.key_secret" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["client.key_secret"]


def test_keys_out_a_file_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("x")
    assert main(["keys", "--out", str(target)]) == 1
    assert "not a directory" in capsys.readouterr().err
