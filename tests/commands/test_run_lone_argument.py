"""`moekit run ARG`, the one-argument form (issue 42, item 1): deciding whether ARG is a checkpoint
folder or the bundled model's prompt never raises, whatever the string, and stderr says which
reading was taken. A prompt longer than 255 bytes used to die with `File name too long`."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit

CONTEXT_REFUSAL = "exceeds the model's context"


def _prompt(size: int, newlines: bool) -> str:
    line = "the cat sat on the mat. "
    text = (line + "\n" if newlines else line) * (size // len(line) + 1)
    return text[:size]


def _generated_or_refused_for_length(code: int, out: str, err: str) -> None:
    """A prompt runs (tokens on stdout, the reading on stderr) or, past the model's 1,024 positions,
    is refused in one line naming the context; never a traceback."""
    assert "Traceback" not in err and "Errno" not in err, err
    if code == 0:
        assert out.strip() and "moekit-demo · greedy · prompt " in err, (out, err)
    else:
        assert code == 2 and out == "" and err.count("\n") == 1 and CONTEXT_REFUSAL in err, (code, err)


@pytest.mark.parametrize("newlines", [False, True], ids=["one-line", "with-newlines"])
@pytest.mark.parametrize("size", [1, 255, 256, 4096, 100_000])
def test_a_prompt_of_any_length_is_the_bundled_models_prompt(capsys, size, newlines):
    prompt = _prompt(size, newlines)
    assert len(prompt.encode()) == size
    code, out, err = moekit(capsys, "run", "--eager", prompt, "--max-new-tokens", "2")
    _generated_or_refused_for_length(code, out, err)
    if size <= 256:  # the bundled model's 1,024 positions hold these
        assert code == 0
    if size == 100_000:
        assert code == 2


def test_a_long_prompt_is_quoted_shortly_with_its_size(capsys):
    prompt = _prompt(800, newlines=False)
    code, _, err = moekit(capsys, "run", "--eager", prompt, "--max-new-tokens", "1")
    assert code == 0 and "… (800 bytes)" in err and prompt[:61] not in err


@pytest.mark.parametrize("arg", ["nul\0inside", "~", "~/no-such-model", "a" * 300 + "/b", "\0" * 256])
def test_strings_no_os_can_take_as_paths_are_prompts_with_a_note(capsys, arg):
    code, out, err = moekit(capsys, "run", "--eager", arg, "--max-new-tokens", "1", "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 1, err
    if "/" in arg or arg.startswith("~"):
        assert "is no checkpoint folder, so it is the prompt for the bundled model" in err


def test_a_file_that_is_no_checkpoint_is_the_prompt_and_the_note_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a model")
    code, out, err = moekit(capsys, "run", "--eager", "notes.txt", "--max-new-tokens", "1")
    assert code == 0 and "'notes.txt' is no checkpoint folder, so it is the prompt for the bundled model" in err


def test_a_folder_that_is_no_checkpoint_is_read_as_one_and_the_refusal_says_why(capsys, tmp_path):
    code, out, err = moekit(capsys, "run", "--eager", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no checkpoint (no config.json), so it was read as CHECKPOINT and no PROMPT follows: give a text PROMPT or --prompt-ids" in err
