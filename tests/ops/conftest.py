"""The builds the operator tests share: this machine's variants, loaded once per pytest session (from
the machine's cache, built there first if need be), and the forced scalar build beside them."""

from __future__ import annotations

import types

import pytest
import torch

from moekit.ops import OPERATORS, load, op
from moekit.ops.build import NARROW, NATIVE, SCALAR
from moekit.ops.runtime import load_variant


@pytest.fixture(scope="session")
def machine_builds():
    """This machine's builds, registered: a missing compiler is a failure here (the set-up installs one)."""
    loaded = load()
    assert loaded.ok, loaded.failures()
    return loaded


@pytest.fixture(scope="session")
def scalar_build():
    """The portable code paths, built for x86-64 without AVX (-march=x86-64) and registered as moekit_scalar."""
    result = load_variant(SCALAR)
    assert result.ok, result.line()
    return result


@pytest.fixture(scope="module", params=[NATIVE.namespace, NARROW.namespace, SCALAR.namespace])
def ops(request, machine_builds):
    """Each build's operators by their plain names: the machine's widest vectors, on an AVX-512
    machine the AVX2 build beside it, and the scalar build."""
    space = request.param
    if space == SCALAR.namespace:
        request.getfixturevalue("scalar_build")
    elif space == NARROW.namespace and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("an AVX2-only machine builds the operators once")
    return types.SimpleNamespace(namespace=space, **{name: op(space, name) for name in OPERATORS})
