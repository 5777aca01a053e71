import pytest

from moekit.calc.request import parse_request
from moekit.errors import MoekitError


def test_defaults():
    r = parse_request()
    assert (r.dtype.name, r.kv_dtype.name, r.context, r.batch, r.gpus, r.hardware, r.sla_ms) == (
        "bf16", "bf16", 4096, 1, 1, None, None,
    )


def test_values_given_as_text_are_parsed():
    r = parse_request(dtype="fp8", context="32768", batch="8", hardware="h100", gpus="2", sla_ms="12.5")
    assert (r.dtype.name, r.kv_dtype.name, r.context, r.batch, r.gpus, r.sla_ms) == ("fp8", "bf16", 32768, 8, 2, 12.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"context": "abc"}, "--context"),
        ({"context": "0"}, "--context"),
        ({"context": "1.5"}, "--context"),
        ({"batch": "-3"}, "--batch"),
        ({"batch": "inf"}, "--batch"),
        ({"hardware": "h100", "gpus": "0"}, "--gpus"),
        ({"hardware": "h100", "sla_ms": "-1"}, "--sla-ms"),
        ({"hardware": "h100", "sla_ms": "nan"}, "--sla-ms"),
        ({"sla_ms": "50"}, "needs --hardware"),
        ({"gpus": "4"}, "needs --hardware"),
        ({"dtype": "int2"}, "unknown dtype"),
        ({"kv_dtype": "int4"}, "KV cache dtype"),
    ],
)
def test_nonsense_is_refused_naming_the_option(kwargs, message):
    with pytest.raises(MoekitError, match=message):
        parse_request(**kwargs)
