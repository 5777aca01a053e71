"""The C-shim table handed to Inductor (moekit.ops.shims.ShimTable) must pickle, by its operators'
names: Inductor keys its FX-graph and AOTAutograd caches by pickling its config, and a table that
does not pickle makes every compile of the decode step bypass both (a full compile per process)."""

from __future__ import annotations

import pickle

from moekit.ops import c_shims, load


def test_the_shim_table_pickles_by_operator_name():
    load()
    table = c_shims()
    assert table, "the operators' C shims are registered"
    assert pickle.dumps(table) == pickle.dumps(c_shims())  # the same bytes: a stable cache key
    again = pickle.loads(pickle.dumps(table))
    assert again == table and type(again) is type(table)
