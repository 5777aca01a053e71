"""The child-process protocol's parent side: a crash is told apart from an error the child reported."""

from __future__ import annotations

import sys

import pytest

from moekit.bench.child import ChildCrashed, run_json_child
from moekit.errors import MoekitError


def test_a_child_killed_by_a_signal_is_a_crash_naming_the_signal():
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(ChildCrashed, match=r"the worker crashed \(signal 11\)"):
        run_json_child(argv, "the worker", timeout_s=60)


def test_a_child_that_reports_an_error_is_not_a_crash():
    argv = [sys.executable, "-c", "import sys; print('error: no such file', file=sys.stderr); sys.exit(2)"]
    with pytest.raises(MoekitError, match="no such file") as err:
        run_json_child(argv, "the worker", timeout_s=60)
    assert not isinstance(err.value, ChildCrashed)


def test_a_child_result_is_its_last_json_line():
    argv = [sys.executable, "-c", "print('progress'); print('{\"tokens_per_s\": 5.0}')"]
    assert run_json_child(argv, "the worker", timeout_s=60) == {"tokens_per_s": 5.0}
