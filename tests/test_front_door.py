"""The README's front door says what one stored `make bench` run measured, word for word
(benchmarks/front_door.py wrote it from that run; docs/front-door/ holds the run's files)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.front_door import (
    BEGIN,
    END,
    FIGURE,
    FILES,
    README,
    STORED,
    block,
    check_run,
    replace_block,
)


def test_the_readme_front_door_is_what_its_stored_run_said():
    text = README.read_text()
    assert BEGIN in text and END in text, "README.md lost its front-door markers"
    written = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert written == block(STORED), (
        "README.md's front door differs from what docs/front-door/'s run says: rerun "
        "`python benchmarks/front_door.py RUN_DIR` on a fresh clone's `make bench`, "
        "never edit the block by hand")
    env = json.loads((STORED / "env.json").read_text())
    assert not env["git"]["dirty"] and env["git"]["sha"][:7] in written


def test_a_run_is_refused_where_it_cannot_speak_for_a_fresh_clone(tmp_path):
    for name in FILES:
        shutil.copyfile(STORED / name, tmp_path / name)
    assert check_run(tmp_path) == [f"{tmp_path} lacks {FIGURE}"]
    (tmp_path / FIGURE).write_bytes(b"")
    assert check_run(tmp_path) == []
    env = json.loads((tmp_path / "env.json").read_text())
    env["git"]["dirty"] = True
    (tmp_path / "env.json").write_text(json.dumps(env))
    assert any("dirty" in why for why in check_run(tmp_path))


def test_the_block_is_replaced_whole_and_only_between_its_markers():
    text = f"intro\n{BEGIN}\nold words\n{END}\noutro\n"
    assert replace_block(text, "new words") == f"intro\n{BEGIN}\nnew words\n{END}\noutro\n"
    with pytest.raises(ValueError, match="no front-door block"):
        replace_block("intro\noutro\n", "new words")
