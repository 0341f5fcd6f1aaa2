"""The patch series step: applies in order, and a patch that does not apply stops with its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ggml_kvcomp import kvtypes, upstream

GOOD = """--- a/f.txt
+++ b/f.txt
@@ -1,2 +1,2 @@
 one
-two
+2
"""

BAD = """--- a/f.txt
+++ b/f.txt
@@ -1,2 +1,2 @@
 one
-three
+3
"""


def _series(tmp_path: Path, *bodies: str) -> list[Path]:
    out = []
    for i, body in enumerate(bodies, 1):
        p = tmp_path / f"{i:04d}-p{i}.patch"
        p.write_text(body)
        out.append(p)
    return out


def test_series_applies_in_order(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "f.txt").write_text("one\ntwo\n")
    upstream.apply_patches(tree, _series(tmp_path, GOOD))
    assert (tree / "f.txt").read_text() == "one\n2\n"


def test_failing_patch_is_named_and_tree_untouched(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "f.txt").write_text("one\ntwo\n")
    with pytest.raises(SystemExit, match=re.escape("patch 0001-p1.patch failed to apply")):
        upstream.apply_patches(tree, _series(tmp_path, BAD))
    assert (tree / "f.txt").read_text() == "one\ntwo\n"  # the dry run came first


def _type_entry(line: str) -> str | None:
    """The type an added `GGML_TYPE_<NAME> [= <n>],` line lists, or None for any other line."""
    m = re.fullmatch(r"\+\s+GGML_TYPE_(\w+)(\s*=\s*\d+)?,(\s*//.*)?", line)
    return m.group(1).lower() if m else None


def test_real_series_is_ordered_and_thin() -> None:
    series = upstream.patches()
    assert [p.name[:4] for p in series] == [f"{i:04d}" for i in range(1, len(series) + 1)]
    ours = sorted([*kvtypes.KVC_TYPES, *kvtypes.KVCT_TYPES])
    for p in series:
        added_per_hunk: list[int] = []
        listed_per_hunk: list[set[str]] = []
        for line in p.read_text().splitlines():
            if line.startswith("@@"):
                added_per_hunk.append(0)
                listed_per_hunk.append(set())
            elif line.startswith("+") and not line.startswith("+++"):
                entry = _type_entry(line)
                if entry is None:
                    added_per_hunk[-1] += 1
                else:
                    listed_per_hunk[-1].add(entry)
        # a hook is a call into cpp/ or a table entry; logic belongs there, not in hunks.
        # A list of types (the enum, -ctk's table) grows one line per format, so it is
        # counted apart, and it must list exactly our types.
        assert max(added_per_hunk) <= 8, f"{p.name}: a hunk adds {max(added_per_hunk)} lines"
        for listed in filter(None, listed_per_hunk):
            assert sorted(listed - {"count"}) == ours, f"{p.name}: lists {sorted(listed)}"
