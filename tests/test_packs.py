"""Pack assembly from installed chunk packages: found, checked, cached; clear errors otherwise."""

import hashlib
import sys

import pytest

from specdecode import packs
from specdecode.errors import SpecDecodeError


@pytest.fixture
def fake_pack(tmp_path, monkeypatch):
    """Three installed parts of a fake pack on sys.path, and a cache in tmp_path."""
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    site = tmp_path / "site"
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"fakepack_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    blob = b"".join(chunks)
    pack = packs.ModelPack("fake-pack", "test", "fakepack_part", "fakepack-part", "0", 3, len(blob),
                           hashlib.sha256(blob).hexdigest())
    return pack, blob, site


def test_assembles_once_and_checks(fake_pack):
    pack, blob, _ = fake_pack
    assert packs.installed(pack) and not packs.is_assembled(pack)
    path = packs.ensure_assembled(pack, progress=False)
    assert path.read_bytes() == blob and packs.is_assembled(pack)
    mtime = path.stat().st_mtime_ns
    assert packs.ensure_assembled(pack, progress=False) == path and path.stat().st_mtime_ns == mtime


def test_missing_part_names_the_install_command(fake_pack):
    pack, _, site = fake_pack
    (site / "fakepack_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(SpecDecodeError, match=r"missing fakepack-part2.*pip install"):
        packs.ensure_assembled(pack, progress=False)


def test_corrupt_part_is_detected_and_not_cached(fake_pack):
    pack, _, site = fake_pack
    (site / "fakepack_part3" / "data" / "part03.bin").write_bytes(b"\x00" * 1003)
    with pytest.raises(SpecDecodeError, match="corrupt"):
        packs.ensure_assembled(pack, progress=False)
    assert not packs.assembled_path(pack).exists()


def test_unknown_pack_path_command(capsys):
    from specdecode.cli import main

    assert main(["models", "path", "no-such-pack"]) == 2
    assert "unknown model pack" in capsys.readouterr().err


def test_default_packs_are_declared_with_their_checksums():
    target, draft = packs.PACKS[packs.DEFAULT_TARGET], packs.PACKS[packs.DEFAULT_DRAFT]
    assert (target.parts, target.size) == (22, 1_117_320_768)
    assert (draft.parts, draft.size) == (6, 491_400_064)
