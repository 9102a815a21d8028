"""What a served process wrote (kiln.compiler.writes), on real folders: no torch needed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kiln.compiler.writes import LAUNCHER, Snapshot, Watch, kind_of


def test_a_snapshot_names_every_file_under_its_label_and_never_follows_a_link(
    tmp_path: Path,
) -> None:
    served, home = tmp_path / "served", tmp_path / "home"
    (served / "inductor" / "ab").mkdir(parents=True)
    (served / "inductor" / "ab" / "entry").write_bytes(b"x")
    (served / "kiln.env").write_text("export A=1\n")
    home.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 10)
    (served / "link").symlink_to(outside)
    snap = Snapshot.of({"served": served, "home": home, "gone": tmp_path / "never"})
    assert set(snap.files) == {"served/inductor/ab/entry", "served/kiln.env", "served/link"}
    st = (served / "inductor" / "ab" / "entry").lstat()
    assert snap.files["served/inductor/ab/entry"] == (1, st.st_mtime_ns, st.st_ino)


def test_a_watch_names_what_was_added_or_rewritten_but_not_the_same_bytes_again(
    tmp_path: Path,
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    shipped = served / "entry"
    shipped.write_bytes(b"shipped")
    watch = Watch({"served": served}, {"served/entry": hashlib.sha256(b"shipped").hexdigest()})
    before = watch.snapshot()
    shipped.write_bytes(b"shipped")  # the same bytes again: a new mtime, no change
    os.utime(shipped, ns=(1, 1))
    (served / "__triton_launcher.so").write_bytes(b"elf")
    assert watch.written(before, watch.snapshot()) == ["served/__triton_launcher.so"]
    assert kind_of("served/__triton_launcher.so") == LAUNCHER
    shipped.write_bytes(b"changed")
    assert "served/entry" in watch.written(before, watch.snapshot())
