"""The README's front door, from one `make bench` run: what a newcomer reads first is what that
run said, word for word.

    python benchmarks/front_door.py RUN_DIR

copies the run's ``cases.csv``, ``env.json`` and ``duty.json`` into ``docs/front-door/``, its
waterfall figure to ``docs/img/waterfall.png``, and rewrites the README's block between the
``front-door`` markers from those files: the commit, machine and wall time, the answer in
words (``report.answer.answer_lines``, as the report's "In short") and the prediction's
score (``report.time_prediction.score_lines``). ``tests/test_front_door.py`` rebuilds the
block from ``docs/front-door/`` and fails where the README says anything else, so a figure
on the front door is always one that run measured, at the commit it names.

The run must be a fresh clone's (its env.json: git not dirty) of the ``default`` profile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_lib.report.answer import answer_lines  # noqa: E402
from bench_lib.report.figure_kit import records  # noqa: E402
from bench_lib.report.time_prediction import score_lines  # noqa: E402
from bench_lib.results.read import read_cases, read_env  # noqa: E402

STORED = REPO / "docs" / "front-door"
FILES = ("cases.csv", "env.json", "duty.json")
FIGURE = "fig11_waterfall.png"
README = REPO / "README.md"
BEGIN = "<!-- front-door: written by benchmarks/front_door.py from docs/front-door/; " \
        "tests/test_front_door.py checks it -->"
END = "<!-- /front-door -->"


def block(folder: Path) -> str:
    """The README's front-door block (markers excluded) from a run folder's files."""
    env = read_env(folder)
    duty = json.loads((folder / "duty.json").read_text())
    rows = records(read_cases(folder))
    git, versions, rig = env["git"], env["versions"], env["rig"]
    kind = "with" if rig["kind"] == "cuda" else "without"
    where = (f"a {env['cpu_cores']}-core {env['cpu_model']} machine {kind} a GPU (rig "
             f"`{rig['label']}`")
    if rig["kind"] == "cpu":
        where += (": each \"device\" is a worker process pinned to its own core, talking "
                  "through gloo")
    answer, score = ("\n>\n".join(f"> {line}" for line in lines)
                     for lines in (answer_lines(rows), score_lines(rows)))
    return (f"A fresh clone's `make bench` at commit `{git['sha'][:7]}` on {where}; torch "
            f"{versions['torch']}) took {duty['wall_s'] / 60:.1f} minutes and opens its report "
            f"with the answer in words:\n\n{answer}\n\nIts prediction of each case's step, "
            f"made before the case ran, kept score:\n\n{score}")


def check_run(folder: Path) -> list[str]:
    """Why ``folder`` cannot be the front door's run; empty where it can."""
    missing = [f for f in (*FILES, FIGURE) if not (folder / f).is_file()]
    if missing:
        return [f"{folder} lacks {', '.join(missing)}"]
    env = read_env(folder)
    why = []
    if env.get("git", {}).get("dirty", True):
        why.append("its working tree was dirty (env.json git.dirty): run it from a fresh clone")
    profile = env.get("profile")
    name = profile.get("name") if isinstance(profile, dict) else profile
    if not str(name).startswith("default"):
        why.append(f"its profile is {name!r}, not the default one `make bench` runs")
    return why


def replace_block(text: str, new: str) -> str:
    """``text`` (the README) with its front-door block replaced by ``new``."""
    head, found, rest = text.partition(BEGIN)
    if not found or END not in rest:
        raise ValueError(f"README.md has no front-door block ({BEGIN} ... {END})")
    return f"{head}{BEGIN}\n{new}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a fresh clone's `make bench` run folder")
    args = parser.parse_args(argv)
    why = check_run(args.run_dir)
    if why:
        print("error: " + "; ".join(why), file=sys.stderr)
        return 2
    text = replace_block(README.read_text(), block(args.run_dir))  # checked before writing
    STORED.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(args.run_dir / name, STORED / name)
    shutil.copyfile(args.run_dir / FIGURE, REPO / "docs" / "img" / "waterfall.png")
    README.write_text(text)
    print(f"README.md's front door now says what {args.run_dir} measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
