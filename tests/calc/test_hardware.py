import pytest

from moekit.calc.hardware import GIB, catalog, catalog_entries, get_hardware, known_names
from moekit.calc import probe
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
    with pytest.raises(MoekitError, match=r"tpu-v5.*h100-sxm|h100-sxm.*tpu-v5") as err:
        get_hardware("tpu-v5")
    assert "local" in str(err.value) and "\n" not in str(err.value)


def test_missing_tensor_rates_fall_back_to_bf16():
    assert get_hardware("a100-80gb").peak("fp8") == ("bf16", 312e12)
    assert get_hardware("h100").peak("fp8") == ("fp8", 1979e12)
    assert get_hardware("m2-ultra").peak("int8")[0] == "bf16"


def test_local_is_measured_by_the_given_probe():
    fake = get_hardware("l40s")
    assert get_hardware("local", probe=lambda: fake) is fake
    assert "local" in known_names()


class ScriptedClock:
    """perf_counter() for the probe: each timed call lasts the next scripted number of seconds."""

    def __init__(self, durations):
        self.durations, self.now, self.started = list(durations), 0.0, False

    def perf_counter(self):
        if self.started:
            self.now += self.durations.pop(0)
        self.started = not self.started
        return self.now


def test_bandwidth_is_the_best_of_copy_and_sum_in_bytes_per_second(monkeypatch):
    n_bytes = 8 * 2**20
    # (durations in powers of two, so the clock's sums are exact)
    # copy (counted as read + write) takes 1 s then 0.5 s: 2 x 8 MiB / 0.5 s = 32 MiB/s;
    # sum (read only) takes 0.25 s then 0.125 s: 8 MiB / 0.125 s = 64 MiB/s, the larger, so the answer.
    monkeypatch.setattr(probe, "time", ScriptedClock([1.0, 0.5, 0.25, 0.125]))
    assert measure_bandwidth(n_bytes=n_bytes, repeats=2) == 64 * 2**20
    monkeypatch.setattr(probe, "time", ScriptedClock([1.0, 0.0625, 0.25, 0.125]))  # now copy wins
    assert measure_bandwidth(n_bytes=n_bytes, repeats=2) == 256 * 2**20


def test_matmul_rate_is_2_n_cubed_over_the_best_time(monkeypatch):
    monkeypatch.setattr(probe, "time", ScriptedClock([0.5, 0.125, 0.25]))  # best of 3: 0.125 s
    assert measure_matmul_flops(n=64, repeats=3) == 2 * 64**3 / 0.125
    monkeypatch.setattr(probe, "time", ScriptedClock([0.0]))  # a clock too coarse to see the call
    assert measure_matmul_flops(n=64, repeats=1) == 2 * 64**3 / 1e-9  # floored, never a division by 0


def test_memory_capacity_is_this_machines_physical_ram():
    with open("/proc/meminfo") as fh:  # MemTotal, in KiB: the kernel's count of the same pages
        assert memory_capacity() == int(fh.readline().split()[1]) * 1024
