from moekit.corpus.roff import roff_to_text

from corpus_fixtures import MAN_PAGE


def test_a_man_page_becomes_its_prose_without_markup_or_comments():
    text = roff_to_text(MAN_PAGE)
    assert "grep - print lines that match patterns" in text
    assert "grep\nsearches for patterns in each FILE." in text
    assert "egrep(1)" in text  # .BR joins its arguments
    assert "grep -E" in text
    assert "Text—with a dash and “quotes”." in text
    for gone in ("Copyright", "never printed", "\\f", ".TH", ".SH"):
        assert gone not in text
