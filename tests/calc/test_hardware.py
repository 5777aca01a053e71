import pytest

from moekit.calc.hardware import GIB, catalog, catalog_entries, get_hardware, known_names
from moekit.calc.probe import measure_bandwidth, measure_matmul_flops, memory_capacity
from moekit.errors import MoekitError

REQUIRED = {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s", "rtx-4090", "rtx-3090", "mi300x", "m2-ultra"}


def test_catalog_holds_the_named_devices_each_with_a_source():
    assert REQUIRED <= set(catalog())
    for entry in catalog_entries():
        assert entry["source"].strip(), entry["name"]
        assert entry["memory_gib"] > 0 and entry["bandwidth_gb_s"] > 0
        assert entry["tflops"]["fp32"] > 0
        # Tensor rates only grow as precision drops, when the part has them.
        rates = entry["tflops"]
        assert rates.get("fp8", rates["bf16"]) >= rates["bf16"] >= rates["fp32"]


def test_aliases_resolve():
    assert get_hardware("h100").name == "h100-sxm"
    assert get_hardware("H100_SXM").name == "h100-sxm"
    assert get_hardware("a100").name == "a100-80gb"
    assert get_hardware("h200").memory_bytes == 141 * GIB


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(MoekitError) as err:
        get_hardware("tpu-v5")
    assert "h100-sxm" in str(err.value) and "local" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_tensor_rates_fall_back_to_bf16():
    assert get_hardware("a100-80gb").peak("fp8") == ("bf16", 312e12)
    assert get_hardware("h100").peak("fp8") == ("fp8", 1979e12)
    assert get_hardware("m2-ultra").peak("int8")[0] == "bf16"


def test_local_is_measured_by_the_given_probe():
    fake = get_hardware("l40s")
    assert get_hardware("local", probe=lambda: fake) is fake
    assert "local" in known_names()


def test_probe_measurements_are_plausible():
    # Small sizes: this checks the arithmetic runs and returns rates, not the machine's speed.
    assert 1e8 < measure_bandwidth(n_bytes=16 * 1024**2, repeats=2) < 1e13
    assert 1e8 < measure_matmul_flops(n=256, repeats=2) < 1e15
    assert memory_capacity() > 256 * 1024**2
