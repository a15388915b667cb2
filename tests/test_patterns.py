"""Path patterns (treetools.shared.patterns): compiled once, matched with re.search, an unmatched pattern an error."""

import pytest

from treetools.shared import patterns


def test_match_patterns_rejects_unmatched_pattern():
    pats = patterns.compile_patterns([r"bias$", r"nonexistent"], name="exclude")
    with pytest.raises(ValueError, match=r"`exclude` pattern 'nonexistent' matches no leaf; nearby paths"):
        patterns.match_patterns(["a/bias", "a/kernel"], pats, name="exclude")


def test_bad_regex_names_argument():
    with pytest.raises(ValueError, match=r"`include` pattern '\(' is not a valid regex"):
        patterns.compile_patterns(["("], name="include")


def test_select_keeps_includes_and_drops_excludes_matching_each_path_once():
    # include "^a/" keeps a/w, a/b and a/w again (a path repeated across items); exclude "b$" drops a/b.
    assert patterns.select(["a/w", "a/b", "c/w", "a/w"], include=["^a/"], exclude=["b$"]) == [True, False, False, True]
    assert patterns.select(["a/w", "c/w"]) == [True, True]  # no pattern keeps everything
    with pytest.raises(ValueError, match=r"`exclude` pattern 'zz' matches no leaf; nearby paths: \[('a/w', 'c/w'|'c/w', 'a/w')\]\."):
        patterns.select(["a/w", "c/w", "a/w"], exclude=["zz"])  # each nearby path listed once
