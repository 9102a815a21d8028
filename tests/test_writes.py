"""What a served process wrote (kiln.compiler.writes), on real folders: no torch needed."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from kiln.compiler.dynamo_log import DynamoLog
from kiln.compiler.measure import Clock, Forward, Meter
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
    shipped.write_bytes(b"changed, and longer")  # a new size: seen whatever the mtime's tick
    assert "served/entry" in watch.written(before, watch.snapshot())


def test_kilns_own_looking_is_not_the_served_process_time() -> None:
    clock = Clock()
    start_wall, start = time.time(), clock.now()
    with clock.looking():
        time.sleep(0.05)
    assert time.time() - start_wall >= 0.05 > clock.now() - start
    assert clock.looking_s >= 0.05


def test_a_write_between_two_steps_is_the_next_steps(tmp_path: Path) -> None:
    """One walk per step: a step's closing snapshot opens the next, so a file written between
    two steps (an input made, an event sent) is counted in the next, never lost."""
    served = tmp_path / "served"
    served.mkdir()
    watch = Watch({"served": served}, {})
    forward = Forward(fn=lambda: None, call_kwargs={}, sync=lambda: None)
    meter = Meter(None, DynamoLog(), forward, watch, watch.snapshot())
    (served / "at-start-up").write_text("x")  # start-up's writes are the first step's
    _, first = meter.measure("b=1", lambda: (served / "first").write_text("x"))
    (served / "between").write_text("x")
    _, second = meter.measure("b=2", lambda: None)
    assert (first.written, second.written) == (2, 1)
    assert second.new_files == ["served/between"]
