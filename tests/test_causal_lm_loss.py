"""use_chunked_loss (hf_fastpath.integrations.causal_lm_loss): the same loss and gradients as the unpatched
Transformers model, for every supported family, plain and with PEFT LoRA on 4-bit layers."""

from __future__ import annotations

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import hf_fastpath  # noqa: F401  (registers the PEFT mapping)
from hf_fastpath.integrations import causal_lm_loss
from hf_fastpath.integrations.causal_lm_loss import CHUNKED_LOSS_MODELS, use_chunked_loss
from hf_fastpath.quantization.calibrate import quantize_model
from hf_fastpath.quantization.config import W4A16Config
from hf_fastpath.quantization.training import prepare_model_for_qlora
from tests.models import BASE_FAMILIES, random_batch, tiny_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    output = model(**inputs)
    output.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return output, grads


def assert_same(got, want, rtol=1e-4, atol=1e-6):
    (out, grads), (ref_out, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys() and grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def labelled_batch(seed=0):
    ids, mask = random_batch(2, 12, right_pad=(0, 3), seed=seed)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100  # a masked prompt
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def test_the_table_names_every_family():
    assert set(CHUNKED_LOSS_MODELS) == set(BASE_FAMILIES)


@pytest.mark.parametrize("family", BASE_FAMILIES)
def test_same_loss_and_grads_as_transformers(family):
    """Every parameter trainable (tied embeddings and GPT-J's head bias included), fp32, eager attention."""
    model = tiny_model(family).train()
    batch = labelled_batch()
    want = loss_and_grads(model, **batch)
    use_chunked_loss(model, chunk_rows=5)  # several chunks
    got = loss_and_grads(model, **batch)
    assert got[0].logits is None
    assert_same(got, want)
    # gradient accumulation contract: sum / num_items_in_batch; return_dict=False drops the logits
    use_chunked_loss(model, enabled=False)
    want = loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(7))
    want_tuple = model(**batch, return_dict=False)
    use_chunked_loss(model)
    assert_same(loss_and_grads(model, **batch, num_items_in_batch=torch.tensor(7)), want)
    got_tuple = model(**batch, return_dict=False)
    torch.testing.assert_close(got_tuple[0], want_tuple[0], rtol=1e-5, atol=1e-6)
    assert len(got_tuple) == len(want_tuple) - 1, "the tuple is the reference's without the logits"


def test_router_loss_of_a_mixture_of_experts_is_kept():
    """gpt-oss with output_router_logits: the model adds router_aux_loss_coef * aux_loss to its loss; so do we,
    returned as a dict and as a tuple."""
    model = tiny_model("gpt_oss", output_router_logits=True, router_aux_loss_coef=0.5).train()
    batch = labelled_batch()
    want = loss_and_grads(model, **batch)
    want_tuple = model(**batch, return_dict=False)
    assert want[0].aux_loss is not None and want[0].aux_loss.item() > 0
    use_chunked_loss(model, chunk_rows=5)
    got = loss_and_grads(model, **batch)
    assert_same(got, want)
    torch.testing.assert_close(got[0].aux_loss, want[0].aux_loss)
    got_tuple = model(**batch, return_dict=False)
    assert len(got_tuple) == len(want_tuple) - 1
    for a, b in zip(got_tuple[:2], want_tuple[:2]):  # loss, aux_loss
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_sequences_with_shift_labels(family):
    """DataCollatorWithFlattening-style batch: one row, position_ids restarting per document, shift_labels given."""
    model = tiny_model(family).train()
    ids, _ = random_batch(1, 15, seed=3)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    shift_labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    shift_labels[0, [4, 11, 14]] = -100  # no target across a document boundary
    batch = dict(input_ids=ids, position_ids=position_ids, labels=ids, shift_labels=shift_labels)
    want = loss_and_grads(model, **batch)
    use_chunked_loss(model, chunk_rows=4)
    assert_same(loss_and_grads(model, **batch), want)


def test_outputs_unchanged_without_labels_and_in_eval_mode():
    model = tiny_model("llama").train()
    batch = labelled_batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        want = model(**batch)
    use_chunked_loss(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch["input_ids"]).logits, logits)
        model.eval()  # evaluation (e.g. Trainer with compute_metrics) keeps the logits
        out = model(**batch)
    assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)


def test_disable_restores_the_class_forward_and_signature_is_kept():
    model = tiny_model("gptj")
    before = inspect_signature(model)
    use_chunked_loss(model)
    use_chunked_loss(model, chunk_rows=3)  # again: re-wraps the original, not the wrapper
    assert inspect_signature(model) == before, "Trainer reads the signature to pass num_items_in_batch"
    assert getattr(model.forward, causal_lm_loss._MARK) is type(model).forward
    use_chunked_loss(model, enabled=False)
    assert "forward" not in model.__dict__


def test_a_deep_copy_runs_itself():
    """The patched forward is a method of the model, not a closure over it: a copy computes with its own weights."""
    import copy

    model = use_chunked_loss(tiny_model("llama").train(), chunk_rows=4)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)
    batch = labelled_batch()
    assert twin.forward.__self__ is twin
    assert not torch.equal(twin(**batch).loss, model(**batch).loss)
    use_chunked_loss(twin, enabled=False)
    want = twin(**batch).loss
    use_chunked_loss(twin)
    torch.testing.assert_close(twin(**batch).loss, want, rtol=1e-5, atol=1e-6)


def inspect_signature(model):
    import inspect

    return inspect.signature(model.forward)


def test_unsupported_models_fail_clearly():
    config = transformers.PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2)
    with pytest.raises(ValueError, match="'phi' .* not supported"):
        use_chunked_loss(transformers.AutoModelForCausalLM.from_config(config))
    model = tiny_model("gpt2")
    double_heads = transformers.GPT2DoubleHeadsModel(model.config)
    with pytest.raises(ValueError, match="not a GPT2LMHeadModel"):
        use_chunked_loss(double_heads)


def test_lora_on_the_head_fails_clearly():
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="not a plain nn.Linear"):
        use_chunked_loss(model)
    # patched first, adapted afterwards: refused at the first training forward
    model = use_chunked_loss(tiny_model("llama"))
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    model.train()
    with pytest.raises(ValueError, match="not a plain nn.Linear"):
        model(**labelled_batch())


@pytest.mark.parametrize("patch_peft_model", [False, True])
def test_qlora_on_4bit_layers_same_lora_grads(patch_peft_model):
    """PEFT LoRA on W4A16 layers (Triton kernels interpreted), prepare_model_for_qlora (checkpointing, fp32 norms):
    the chunked loss gives the adapters the same gradients."""
    model = tiny_model("llama")
    quantize_model(model, W4A16Config(method="rtn", group_size=32))
    prepare_model_for_qlora(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # nonzero B: every adapter gets a gradient
    model.train()
    batch = labelled_batch(seed=2)
    want = loss_and_grads(model, **batch)
    use_chunked_loss(model if patch_peft_model else model.get_base_model(), chunk_rows=8)
    got = loss_and_grads(model, **batch)
    assert got[0].logits is None and len(got[1]) == len(want[1]) > 0
    assert_same(got, want, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_loss_within_tolerance():
    """The logits come from bf16 operands under autocast in both paths; only the chunking differs."""
    model = tiny_model("gpt_neox").train()
    batch = labelled_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(model, **batch)
        use_chunked_loss(model, chunk_rows=6)
        got = loss_and_grads(model, **batch)
    assert_same(got, want, rtol=2e-2, atol=2e-3)


def _trained_weights(tmp_path, chunked):
    model = tiny_model("gpt2").train()
    if chunked:
        use_chunked_loss(model, chunk_rows=7)
    rows = []
    for i in range(8):
        ids, _ = random_batch(1, 10, seed=10 + i)
        labels = ids.clone()
        labels[0, : i % 5] = -100  # uneven targets per example: num_items_in_batch matters
        rows.append({"input_ids": ids[0].tolist(), "labels": labels[0].tolist()})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("chunked" if chunked else "plain")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    assert trainer.model_accepts_loss_kwargs, "Trainer must still see **kwargs in the forward signature"
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_with_gradient_accumulation(tmp_path):
    """Trainer passes num_items_in_batch to the patched forward; two accumulated steps land on the same weights."""
    want = _trained_weights(tmp_path, chunked=False)
    got = _trained_weights(tmp_path, chunked=True)
    changed = [n for n in want if not torch.equal(want[n], tiny_model("gpt2").state_dict()[n])]
    assert changed, "training should move the weights"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
