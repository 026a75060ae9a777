"""The README's and the results pages' pictures are redrawn from committed files by tools/make_figures.py, and every
picture a page shows is in the repository and under 300 kB."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _make_figures():
    from fedtest import load_script

    return load_script(ROOT / "tools" / "make_figures.py")


def test_make_figures_redraws_every_committed_picture(tmp_path):
    mf = _make_figures()
    assert mf.main(["--check", "--out", str(tmp_path)]) == 0
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert len(drawn) == len(mf.FIGURES)
    committed = {p.name for p in (ROOT / "docs" / "img").glob("*.png")}
    assert drawn <= committed, f"commit the pictures make_figures draws: {sorted(drawn - committed)}"


def test_every_picture_a_page_shows_exists_and_is_small():
    pages = [ROOT / "README.md", *sorted((ROOT / "results").glob("*.md")), *sorted((ROOT / "docs").glob("*.md"))]
    shown = 0
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text()):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.name} shows missing {target}"
            assert path.stat().st_size < 300_000, f"{target} is {path.stat().st_size} bytes (keep pictures < 300 kB)"
            shown += 1
    assert shown >= 10
