"""A tiny Llama with context parallelism (CP=2, gloo, CPU) gives the one-process loss and gradients, for an
ordinary batch that needs padding (under DDP) and for a packed batch (under FSDP2); plus the Transformers wiring's errors and the example's
CPU smoke run under `accelerate launch`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_fastpath.parallel import context_parallel_loss, shard_causal_lm_batch, zigzag_unshard
from hf_fastpath.parallel.launch import run_in_processes

REPO = Path(__file__).resolve().parents[1]
WORKER_ENV = {"TRITON_INTERPRET": "0"}  # float64 reference kernels: this checks the wiring, not the kernels


def _tiny_llama(attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn, use_cache=False)
    return LlamaForCausalLM(cfg).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    dense = {"input_ids": torch.randint(0, 97, (2, 13), generator=g)}  # 13: padded to 16 for CP=2
    docs = [5, 8, 7]
    ids = torch.randint(0, 97, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[0, [0, 5, 13]] = -100  # as DataCollatorWithFlattening does: no target across documents
    packed = {"input_ids": ids, "labels": labels, "position_ids": pos}
    return {"dense": dense, "packed": packed}


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2 shards are DTensors
            out[n.replace("module.", "")] = g.detach().clone()
    return out


def _inner(model):
    return getattr(model, "module", model)


def _wrap(model, how, world_size):
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _llama_worker(rank, world_size):
    from hf_fastpath.parallel import context_parallel

    for (name, batch), how in zip(_batches().items(), ("ddp", "fsdp2")):
        model = _tiny_llama()
        labels = batch.get("labels", batch["input_ids"])
        ref = model(**{k: v for k, v in batch.items() if k != "labels"}, labels=labels)
        # float64 one-process loss (Transformers' own loss is fp32): mean over the next-token targets
        ref_loss = F.cross_entropy(ref.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100)
        assert torch.allclose(ref_loss.float(), ref.loss, rtol=1e-6)
        ref_loss.backward()
        ref_grads = _grads(model)

        model = _wrap(_tiny_llama(), how, world_size)  # the CP group is the whole world here: DP size 1
        shard = shard_causal_lm_batch(batch, None)
        shift_labels = shard.pop("shift_labels")
        assert shard["input_ids"].shape[1] == (8 if name == "dense" else 12)
        with context_parallel(model, None):
            assert _inner(model).config._attn_implementation == "fastpath_ring"
            logits = model(**shard).logits
            loss = context_parallel_loss(logits, shift_labels, None)
            loss.backward()  # DDP / FSDP2 average the gradients over the ranks
        assert _inner(model).config._attn_implementation == "eager"  # restored

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        assert torch.allclose(mean_loss, ref_loss.detach(), rtol=0, atol=1e-8), (name, (mean_loss - ref_loss).item())
        grads = _grads(model)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            # Llama's RMSNorm computes in fp32 even for a float64 model: relative error ~1e-7 is the floor here;
            # a ring that lost or duplicated any block, or a wrong loss normalisation, is off by O(1)
            rel = (g - ref_grads[n]).norm() / ref_grads[n].norm()
            assert rel < 1e-5, (name, how, n, rel.item())
        if name == "dense":  # and the logits themselves, unsharded, equal the one-process logits
            full = zigzag_unshard(logits.detach(), 1, None)[:, :13]
            assert ((full - ref.logits.detach()).norm() / ref.logits.norm()) < 1e-6


def _families_worker(rank, world_size):
    """GPT-2 (absolute positions, layer-scaled attention), GPT-NeoX / GPT-J (partial rotary), GPT-BigCode (MQA),
    Qwen2 (q/k/v biases), Qwen3 (q/k norms): CP=2 logits and loss equal the one-process ones."""
    from hf_fastpath.parallel import context_parallel
    from tests.models import VOCAB, tiny_model

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 11), generator=g)
    for family in ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "qwen2", "qwen3"):
        model = tiny_model(family, "eager", dtype=torch.float64)
        ref = model(input_ids=ids)
        ref_loss = F.cross_entropy(ref.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        shard = shard_causal_lm_batch({"input_ids": ids}, None)
        labels = shard.pop("shift_labels")
        with context_parallel(model, None):
            logits = model(**shard).logits
        loss = context_parallel_loss(logits, labels, None).detach()
        dist.all_reduce(loss)
        assert torch.allclose(loss / world_size, ref_loss, rtol=0, atol=1e-8), family
        full = zigzag_unshard(logits.detach(), 1, None)[:, :11]
        assert ((full - ref.logits).norm() / ref.logits.norm()) < 1e-6, family


def _model_worker(rank, world_size):
    _llama_worker(rank, world_size)
    _families_worker(rank, world_size)


def test_tiny_models_cp2_match_one_process():
    run_in_processes(_model_worker, 2, env=WORKER_ENV)


def test_ring_attention_errors_without_context_and_on_padding():
    from hf_fastpath.integrations.context_parallel import register

    register()
    model = _tiny_llama()
    model.set_attn_implementation("fastpath_ring")
    with pytest.raises(RuntimeError, match="context_parallel"):
        model(input_ids=torch.randint(0, 97, (1, 4)))
    with pytest.raises(ValueError, match="padded batches"):
        model(input_ids=torch.randint(0, 97, (1, 4)), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="padding"):
        shard_causal_lm_batch({"input_ids": torch.ones(1, 4, dtype=torch.long),
                               "attention_mask": torch.tensor([[0, 1, 1, 1]])})


@pytest.mark.parametrize("family", ["falcon", "gemma2"])
def test_models_without_ring_attention_are_refused_by_name(family):
    from hf_fastpath.integrations.context_parallel import enable_context_parallel
    from tests.models import tiny_model

    with pytest.raises(NotImplementedError, match=f"{family}.*supported: .*llama"):
        enable_context_parallel(tiny_model(family), None)


def test_world_size_one_context_parallel_equals_plain_model(monkeypatch):
    from hf_fastpath.parallel import context_parallel

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference kernels for float64
    model = _tiny_llama()
    batch = _batches()["packed"]
    ref = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    labels = batch["labels"]
    ref_loss = F.cross_entropy(ref.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100)
    shard = shard_causal_lm_batch(batch)  # world 1: shift, pad every document to even length
    labels = shard.pop("shift_labels")
    with context_parallel(model):
        loss = context_parallel_loss(model(**shard).logits, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-8)


def test_example_cpu_smoke_run_under_accelerate_launch(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # `accelerate launch --cpu` starts a single process (multi-CPU needs mpirun); --multi_gpu goes through torchrun
    # and the script's --cpu makes Accelerate pick gloo
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "examples" / "long_context_finetune.py"), "--cpu", "--tiny", "--cp-size", "2", "--packed",
           "--steps", "2", "--seq-len", "64", "--out", str(tmp_path / "log.json")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import json

    log = json.loads((tmp_path / "log.json").read_text())
    assert len(log["losses"]) == 2 and all(torch.isfinite(torch.tensor(log["losses"])))
    assert log["cp_size"] == 2 and log["dp_size"] == 1 and log["packed"]
    assert log["model_class"] == "DistributedDataParallel"


def test_batch_sharding_shifts_labels_per_document_then_pads():
    ids = torch.tensor([[11, 12, 13, 21, 22, 31, 32, 33, 34]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    out = shard_causal_lm_batch({"input_ids": ids, "position_ids": pos}, None, pad_token_id=5)  # world 1
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 6, 10]  # documents padded to even lengths
    assert out["input_ids"].tolist() == [[11, 12, 13, 5, 21, 22, 31, 32, 33, 34]]
    # next-token targets inside each document only; padding and every document's last token ignored
    assert out["shift_labels"].tolist() == [[12, 13, -100, -100, 22, -100, 32, 33, 34, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="batch size 1"):
        shard_causal_lm_batch({"input_ids": ids.expand(2, -1), "position_ids": pos.expand(2, -1)}, None)
