"""Training end to end on the tiny corpus: it learns, it resumes exactly, it saves what others load."""

import json

import pytest
import torch
from safetensors.torch import load_file

from moekit.train.data import batch_at, domain_weights, load_streams
from moekit.train.forward import RoutingOptions, train_forward
from moekit.train.session import train

from train_fixtures import tiny_config


def _params(run):
    return {k: v for k, v in load_file(str(run / "state.safetensors")).items() if k.startswith("param/")}


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(tiny_corpus, tmp_path):
    config = tiny_config(tmp_path, tiny_corpus, steps=1)
    first = train(config, tmp_path / "run", say=lambda s: None)["decoder"]
    streams = load_streams(tmp_path / "run" / "tokens.safetensors")
    inputs, targets, _ = batch_at(streams, domain_weights(streams, "sqrt"), 99, 0, 8, 32)

    def loss(decoder):
        with torch.no_grad():
            logits, _ = train_forward(decoder, inputs, RoutingOptions())
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))

    before = loss(first)
    config = tiny_config(tmp_path, tiny_corpus, steps=25, every=25)
    after = loss(train(config, tmp_path / "run", force=True, say=lambda s: None)["decoder"])
    assert after < before - 0.5


def test_metrics_log_loss_load_imbalance_and_entropy_per_step(tiny_run):
    run, _, _ = tiny_run
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    layer = lines[-1]["layers"][0]
    assert len(layer["load"]) == 8 and abs(sum(layer["load"]) - 1) < 1e-3
    assert layer["imbalance"] >= 1.0 and 0 < layer["entropy"] <= 2.08  # ≤ log 8


def test_resume_reaches_the_parameters_of_an_uninterrupted_run(tiny_run, tiny_corpus, tmp_path):
    run, config, _ = tiny_run  # 6 steps straight, checkpoints at 3 and 6
    half = tmp_path / "half"
    train(config, half, say=lambda s: None, stop_after=3)  # "interrupted" after the step-3 checkpoint
    assert json.loads((half / "state.json").read_text())["step"] == 3
    train(config, half, resume=True, say=lambda s: None)
    straight, resumed = _params(run), _params(half)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert (half / "metrics.jsonl").read_text() .count("\n") == 6


def test_a_folder_holding_another_run_is_refused_unless_resume_or_force(tiny_run, tiny_corpus, tmp_path):
    from moekit.train.state import RunFolderError

    run, config, _ = tiny_run
    with pytest.raises(RunFolderError, match="already holds a run"):
        train(config, run, say=lambda s: None)
    other = tiny_config(tmp_path, tiny_corpus, steps=6)
    other.write_text(other.read_text().replace("seed = 5", "seed = 6"))
    with pytest.raises(RunFolderError, match="different run"):
        train(other, run, resume=True, say=lambda s: None)
    with pytest.raises(RunFolderError, match="no checkpoint to resume"):
        train(other, tmp_path / "fresh", resume=True, say=lambda s: None)


def test_the_saved_checkpoint_generates_in_transformers_what_the_engine_generates(tiny_run):
    transformers = pytest.importorskip("transformers")
    from moekit.engine.loader import load_engine

    model_dir = tiny_run[0] / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    engine = load_engine(model_dir, compile=False)
    prompt = engine.encode("def main(argv):\n    ")
    ours = engine.generate(prompt, max_new_tokens=16, stop_ids=()).token_ids[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=16, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    # Six steps of training mostly predict the commonest token, so compare every position's logits too.
    text = engine.encode("import os\nfor name in sorted(os.listdir(path)):\n    print(name)\n")
    with torch.inference_mode():
        hf_logits = model(torch.tensor([text])).logits[0]
        cache = engine.decoder.new_cache(1, len(text))
        our_logits = engine.decoder(torch.tensor([text]), cache, torch.arange(len(text))[None])[0]
    assert hf_logits.argmax(-1).unique().numel() >= 2
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_training_runs_on_cuda_and_saves_a_checkpoint_the_cpu_engine_loads(tiny_corpus, tmp_path):
    from moekit.engine.loader import load_engine

    config = tiny_config(tmp_path, tiny_corpus, steps=3, every=3)
    result = train(config, tmp_path / "run", device="cuda", say=lambda s: None)
    assert next(result["decoder"].parameters()).is_cuda
    engine = load_engine(tmp_path / "run" / "model", compile=False)
    assert len(engine.generate("def f(", max_new_tokens=4, stop_ids=()).token_ids[0]) == 4
