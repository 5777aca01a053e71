"""Grammar-constrained rows: output that follows the schema, beside free rows that are not touched.

Random weights make these real tests of the constraint: left alone, such a model writes noise. The
oracles: jsonschema for the output, llguidance's own byte mask for our unpacking of its bit mask,
and a free request's lone tokens for the rows that decode beside a constrained one.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hf_tiny import train_tokenizer, write_checkpoint
from moekit.engine.constraints import (
    ConstraintError,
    allowed_from_words,
    check_grammar,
    grammar_tokenizer,
    json_schema_grammar,
    mask_logits,
    new_constraint,
)
from moekit.engine.loader import load_engine
from moekit.engine.sampling import SamplingParams
from moekit.engine.scheduler import Request, Scheduler, generate_batch

TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # padded past the tokenizer's last id, as many Hub models are: those ids are never allowed

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("constrained"), seed=3, vocab_size=MODEL_VOCAB)
    train_tokenizer(folder / "tokenizer.json", vocab_size=TOKENIZER_VOCAB)
    return load_engine(folder, compile=False)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return grammar_tokenizer(engine.tokenizer, engine.spec.vocab_size, engine.eos_ids)


def _constrained(engine, tokenizer, schema, prompt, seed=None, new=120):
    sampling = SamplingParams(temperature=1.0, seed=seed) if seed is not None else SamplingParams()
    constraint = new_constraint(json_schema_grammar(schema), tokenizer, engine.spec.vocab_size)
    return Request(prompt=prompt, max_new_tokens=new, sampling=sampling, stop_ids=engine.eos_ids, constraint=constraint)


def test_unpacked_mask_equals_the_librarys_own_byte_mask(engine, tokenizer):
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, json_schema_grammar(PERSON), log_level=0)
    constraint = new_constraint(json_schema_grammar(PERSON), tokenizer, MODEL_VOCAB)
    for token in engine.encode('{"name":"ab","ok":true,')[:6]:
        want = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:MODEL_VOCAB] > 0
        assert torch.equal(constraint.allowed(), want)
        assert want.sum() > 0 and not want[TOKENIZER_VOCAB:].any()
        matcher.consume_token(token)
        constraint.accept(token)


def test_a_copy_follows_its_own_tokens(engine, tokenizer):
    first = new_constraint(json_schema_grammar(PERSON), tokenizer, MODEL_VOCAB)
    second = first.copy()
    for token in engine.encode('{"name":"a'):
        first.accept(token)
    assert not torch.equal(first.allowed(), second.allowed())
    assert torch.equal(second.allowed(), new_constraint(json_schema_grammar(PERSON), tokenizer, MODEL_VOCAB).allowed())


def test_bit_unpacking_reads_bit_i_of_word_w_as_token_32w_plus_i():
    words = torch.tensor([1 - (1 << 31), 1 << 3], dtype=torch.int32)  # bits 0 and 31 (the sign bit)
    allowed = allowed_from_words(words, 40)
    assert allowed.nonzero().flatten().tolist() == [0, 31, 35]


def test_free_rows_are_bit_for_bit_untouched_by_mask_logits(engine, tokenizer):
    logits = torch.randn(3, MODEL_VOCAB, generator=torch.Generator().manual_seed(0))
    constraint = new_constraint(json_schema_grammar(PERSON), tokenizer, MODEL_VOCAB)
    masked = mask_logits(logits, [None, constraint, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isinf(masked[1]).sum() > MODEL_VOCAB // 2
    assert mask_logits(logits, [None, None, None]) is logits


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_constrained_output_always_parses_and_validates(engine, tokenizer, seed):
    request = _constrained(engine, tokenizer, PERSON, engine.encode("person:"), seed=seed)
    outcome = generate_batch(Scheduler(engine.decoder, max_batch=2), [request])[0]
    assert outcome.finish_reason == "stop", outcome
    jsonschema.validate(json.loads(engine.decode(outcome.token_ids)), PERSON)


def test_a_free_greedy_request_gets_its_solo_tokens_beside_a_constrained_one(engine, tokenizer):
    prompt = engine.encode("The quick brown fox")
    free_alone = engine.generate([prompt], max_new_tokens=24, stop_ids=()).token_ids[0]
    free = Request(prompt=prompt, max_new_tokens=24, stop_ids=())
    structured = _constrained(engine, tokenizer, PERSON, engine.encode("def fibonacci(n):"), seed=5)
    scheduler = Scheduler(engine.decoder, max_batch=4)
    out_free, out_structured = generate_batch(scheduler, [free, structured])
    assert out_free.token_ids == free_alone
    jsonschema.validate(json.loads(engine.decode(out_structured.token_ids)), PERSON)
    # the constraint really bit: left free, the same request does not write this JSON
    loose = Request(prompt=engine.encode("def fibonacci(n):"), max_new_tokens=len(out_structured.token_ids),
                    sampling=SamplingParams(temperature=1.0, seed=5), stop_ids=())
    assert generate_batch(scheduler, [loose])[0].token_ids != out_structured.token_ids


def test_a_grammar_ends_the_row_even_when_eos_is_ignored(engine, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    request = _constrained(engine, tokenizer, schema, engine.encode("x"))
    request.stop_ids = ()
    outcome = generate_batch(Scheduler(engine.decoder), [request])[0]
    assert outcome.finish_reason == "stop"
    assert json.loads(engine.decode(outcome.token_ids)) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "frobnicate"}, "frobnicate"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ],
)
def test_a_schema_the_library_refuses_is_one_clear_line(tokenizer, schema, words):
    with pytest.raises(ConstraintError, match=words) as err:
        check_grammar(json_schema_grammar(schema), tokenizer)
    assert "\n" not in str(err.value)
