from moekit.corpus.clean import (Document, cap, cap_per_family, clean, dedupe, man_page_family, normalise, split,
                                 strip_licence_header)

from corpus_fixtures import SCRIPT


def test_normalise_unifies_newlines_trailing_space_and_blank_runs():
    assert normalise("a  \r\nb\t\n\n\n\n\nc\n\n") == "a\nb\n\nc"


def test_a_licence_header_goes_and_the_shebang_and_code_stay():
    out = strip_licence_header(SCRIPT)
    assert out.startswith("#!/bin/sh\nset -e")
    assert "Copyright" not in out and 'echo "processing $f"' in out


def test_a_comment_that_is_not_a_licence_stays():
    text = "#!/bin/sh\n# Print the date.\ndate\n"
    assert strip_licence_header(text) == text


def test_a_licence_docstring_goes():
    text = '"""Copyright 2001 PSF.\n\nLicensed under the PSF license."""\nimport os\n'
    assert strip_licence_header(text) == "import os\n"


def test_documents_outside_the_size_window_are_dropped():
    assert clean("d", "o", "tiny", 10, 100, code=False) is None
    assert clean("d", "o", "x" * 200, 10, 100, code=False) is None
    assert clean("d", "o", "just right here", 10, 100, code=False).text == "just right here"


def test_dedupe_keeps_the_first_of_each_exact_text():
    docs = [Document("d", "a", "same"), Document("d", "b", "other"), Document("d", "c", "same")]
    kept, dropped = dedupe(docs)
    assert [d.origin for d in kept] == ["a", "b"] and dropped == 1


def test_split_is_by_document_reproducible_and_order_independent():
    docs = [Document("d", str(i), f"document number {i}") for i in range(400)]
    train, held = split(docs, seed=7, fraction=0.1)
    assert 20 <= len(held) <= 60 and len(train) + len(held) == 400
    assert not {d.text for d in train} & {d.text for d in held}
    train2, held2 = split(list(reversed(docs)), seed=7, fraction=0.1)
    assert {d.text for d in held2} == {d.text for d in held}
    _, held3 = split(docs, seed=8, fraction=0.1)
    assert {d.text for d in held3} != {d.text for d in held}


def test_a_two_document_domain_gets_one_of_each_split():
    docs = [Document("d", "a", "alpha text"), Document("d", "b", "beta text")]
    train, held = split(docs, seed=0, fraction=0.01)
    assert len(train) == 1 and len(held) == 1


def test_cap_keeps_whole_documents_under_the_byte_budget():
    docs = [Document("d", str(i), "y" * 100 + str(i)) for i in range(50)]
    kept = cap(docs, 1000, seed=1)
    assert 0 < sum(len(d.text) for d in kept) <= 1000
    assert kept == cap(docs, 1000, seed=1)


def test_a_man_page_family_is_the_command_before_the_first_separator():
    assert man_page_family("/usr/share/man/man1/gcloud_compute_ssh.1.gz") == "gcloud"
    assert man_page_family("/usr/share/man/man1/git-commit.1.gz") == "git"
    assert man_page_family("/usr/share/man/man3/EVP_DigestInit.3ssl.gz") == "evp"
    assert man_page_family("/usr/share/man/man1/ls.1.gz") == "ls"


def test_the_family_cap_keeps_a_seeded_few_of_a_large_family_and_all_of_small_ones():
    docs = [Document("manpages", f"/m/gcloud_{i}.1.gz", f"gcloud page {i}") for i in range(50)]
    docs += [Document("manpages", f"/m/ls{i}.1.gz", f"ls page {i}") for i in range(3)]
    kept, dropped = cap_per_family(docs, man_page_family, 5, seed=1)
    assert dropped == 45 and len(kept) == 8
    assert sum(d.origin.startswith("/m/gcloud") for d in kept) == 5
    assert [d for d in docs if d in kept] == kept  # input order kept
    again, _ = cap_per_family(list(reversed(docs)), man_page_family, 5, seed=1)
    assert {d.origin for d in again} == {d.origin for d in kept}  # the choice ignores order
    other, _ = cap_per_family(docs, man_page_family, 5, seed=2)
    assert {d.origin for d in other} != {d.origin for d in kept}
