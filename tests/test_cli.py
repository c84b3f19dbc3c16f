"""`hf-fastpath quantize` -> `hf-fastpath eval` round trip on a tiny model saved with a tiny tokenizer, the text
sources, and the perplexity protocol."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_fastpath.cli import main
from hf_fastpath.quantization import data
from hf_fastpath.quantization.workflow import perplexity
from tests.models import VOCAB, tiny_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny_tokenizer():
    """A byte-level BPE tokenizer with the tiny models' vocabulary size, trained on a little text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["In the beginning God created the heaven and the earth. And the earth was without form, and void."] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>", pad_token="<unk>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", hidden_size=128, intermediate_size=256).save_pretrained(path)
    tokenizer = _tiny_tokenizer()
    assert len(tokenizer) <= VOCAB
    tokenizer.save_pretrained(path)
    (path / "calib.txt").write_text("And God said, Let there be light: and there was light.\n" * 200)
    return path


def _eval(capsys, path, *extra) -> dict:
    capsys.readouterr()
    # eager attention: the fastpath backend would run its Triton kernel in the (slow) interpreter here
    assert main(["eval", str(path), "--seq-len", "32", "--max-tokens", "512", "--device", "cpu",
                 "--attn-implementation", "eager", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("method,flags", [("gptq", ["--desc-act"]), ("gptq", ["--no-gptaq"]), ("awq", []),
                                          ("rtn", ["--asym"])])
def test_quantize_then_eval_round_trip(model_dir, tmp_path, capsys, method, flags):
    out = tmp_path / f"{method}"
    argv = ["quantize", str(model_dir), str(out), "--method", method, "--group-size", "32", "--dataset",
            str(model_dir / "calib.txt"), "--num-samples", "4", "--seq-len", "32", "--device", "cpu", *flags]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("awq" if method == "awq" else "gptq")
    assert config["bits"] == 4 and config["group_size"] == 32
    if method == "gptq":
        assert config["desc_act"] == ("--desc-act" in flags)
        assert config["meta"]["gptaq_alpha"] == (0.0 if "--no-gptaq" in flags else 0.25)  # GPTAQ by default
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()

    fp = _eval(capsys, model_dir, "--dataset", str(model_dir / "calib.txt"))
    q = _eval(capsys, out, "--dataset", str(model_dir / "calib.txt"))
    assert fp["tokens"] == q["tokens"] == 512
    assert math.isfinite(q["perplexity"]) and q["perplexity"] > 1
    # Random weights: both near the vocabulary size, and 4-bit keeps the quantized model close to the float one.
    assert abs(math.log(q["perplexity"] / fp["perplexity"])) < 0.2, (fp, q)


def test_perplexity_protocol_matches_a_direct_computation():
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (100,), generator=torch.Generator().manual_seed(3))
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in ids.split(32):  # 32, 32, 32, 4: the short last window counts too
            logits = model(window[None]).logits[0]
            nll += torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
            count += window.numel() - 1
    assert perplexity(model, ids, seq_len=32, batch_size=2) == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_text_sources():
    calib, held_out = data.load_texts("bible-calib"), data.load_texts("bible-eval")
    assert len(calib) == 39 and len(held_out) == 27  # Old and New Testament books, no overlap
    assert calib[0].startswith("In the beginning God created") and held_out[0].startswith("The book of the generation")
    assert data.load_texts(["a", "b"]) == ["a", "b"]
    with pytest.raises(TypeError):
        data.load_texts([1, 2])


def test_fortunes_are_found_when_installed():
    if not data.fortune_files():
        with pytest.raises(FileNotFoundError, match="fortunes"):
            data.fortune_texts()
        return
    fortunes = data.fortune_texts()
    assert len(fortunes) > 20 and all(f.strip() and "\n%\n" not in f for f in fortunes)


def test_calibration_windows_are_deterministic_and_in_range(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a = data.calibration_windows(tok, str(model_dir / "calib.txt"), num_samples=5, seq_len=16, seed=0)
    b = data.calibration_windows(tok, str(model_dir / "calib.txt"), num_samples=5, seq_len=16, seed=0)
    assert a.shape == (5, 16) and torch.equal(a, b) and a.max() < VOCAB
    ids = torch.randint(0, VOCAB, (3, 8))
    assert torch.equal(data.calibration_windows(None, ids, num_samples=2, seq_len=8), ids[:2])
    with pytest.raises(ValueError, match="tokenizer"):
        data.calibration_windows(None, "bible-calib", 2, 8)


def test_bad_arguments_are_clear_errors(model_dir, tmp_path):
    with pytest.raises(ValueError, match="desc_act"):
        main(["quantize", str(model_dir), str(tmp_path / "x"), "--method", "awq", "--desc-act"])


@pytest.mark.slow
def test_demo_fast_runs_end_to_end(capsys, smollm2_installed):
    assert main(["demo", "--fast", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "quantized ppl" in out and "bible-eval" in out and "fortunes" in out
