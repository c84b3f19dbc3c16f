"""`fastpath*` attention for models that pick an attention *class* by name instead of calling
`ALL_ATTENTION_FUNCTIONS`: Falcon (`FALCON_ATTENTION_CLASSES`), and GPT-J on Transformers versions that still have
`GPTJ_ATTENTION_CLASSES` (5.17; 5.24 uses the attention interface).

Our classes subclass the model's own attention (same parameters, projections and rotary) and hand q/k/v to the
registered attention function of `config._attn_implementation`, so every `fastpath*` variant shares one class.

Falcon specifics:
- multi-query (one K/V head), `new_decoder_architecture` (GQA: K/V stay at `num_kv_heads` heads, not repeated, so the
  KV cache is smaller than eager's), plain multi-head, parallel attention (handled by the decoder layer);
- ALiBi: slopes are computed here and passed to the kernel (`alibi_slopes`), nothing `[B,H,S,S]` is materialised.
  Falcon adds `slope * position` to q·k *before* the 1/sqrt(d) scaling, and rounds the slopes to bfloat16: the
  kernel gets `bf16(slope) / sqrt(d)`. Transformers 5.x eager Falcon adds the ALiBi bias twice (once in the scores,
  once folded into the 4-D mask); its SDPA path and the original Falcon code add it once, as we do.

`model.set_attn_implementation(name)` works for these models too: Transformers refuses to switch class-based models,
so we let it and then swap the attention modules' classes in place (weights untouched).

Transformers >= 5.25 Falcon calls the attention interface and folds ALiBi into a 4-D float mask in
`FalconModel.forward`, which a FlashAttention kernel cannot take. Under our names its `use_alibi` reads False (no
bias tensor is built, the mask stays ours; its attention still skips rotary by `config.alibi`) and the adapter
passes the slopes to the kernel instead (`alibi_slopes_of`).
"""

from __future__ import annotations

import importlib
import logging
import math

import torch

from .models import MODELS

logger = logging.getLogger(__name__)

__all__ = ["register_name", "falcon_alibi_slopes", "alibi_slopes_of"]

_classes: dict[str, type] = {}
_OUR_NAMES: set[str] = set()  # every registered `fastpath*` name


def falcon_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """Falcon's ALiBi slopes (fp32, rounded through bfloat16 exactly as `build_alibi_tensor` does), `[num_heads]`."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float32), torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = torch.arange(1, 1 + 2 * min(closest, num_heads - closest), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(torch.tensor(extra_base, dtype=torch.float32), extra)])
    return slopes.bfloat16().float().to(device)


def _attention_function(config):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[config._attn_implementation]


def _falcon_class():
    if "falcon" in _classes:
        return _classes["falcon"]
    mf = importlib.import_module("transformers.models.falcon.modeling_falcon")

    class FastpathFalconAttention(mf.FalconAttention):
        """Falcon attention on a `fastpath*` kernel (any registered name; chosen by `config._attn_implementation`)."""

        def _split_heads_unrepeated(self, fused_qkv):
            b, s, _ = fused_qkv.shape
            if self.new_decoder_architecture:  # [.., groups, q-per-group + k + v, D]; K/V not broadcast
                qkv = fused_qkv.view(b, s, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
                return qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
            if self.multi_query:  # views (Falcon's own split copies K/V with list indexing)
                qkv = fused_qkv.view(b, s, self.num_heads + 2, self.head_dim)
                return qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
            return self._split_heads(fused_qkv)

        def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                    output_attentions=False, position_embeddings=None, **kwargs):
            q, k, v = (x.transpose(1, 2) for x in self._split_heads_unrepeated(self.query_key_value(hidden_states)))
            b, _, s, _ = q.shape
            if alibi is None:
                cos, sin = position_embeddings
                q, k = mf.apply_rotary_pos_emb(q, k, cos, sin)
            if layer_past is not None:
                k, v = layer_past.update(k, v, self.layer_idx)
            slopes = alibi_slopes_of(self, q.device) if alibi is not None else None
            # Eager Falcon applies attention dropout only with ALiBi; mirror it.
            dropout = self.attention_dropout.p if (self.training and alibi is not None) else 0.0
            out, _ = _attention_function(self.config)(
                self, q, k, v, attention_mask, scaling=self.inv_norm_factor, dropout=dropout,
                position_ids=position_ids, alibi_slopes=slopes, output_attentions=output_attentions, **kwargs)
            return self.dense(out.reshape(b, s, self.num_heads * self.head_dim)), None

    _classes["falcon"] = FastpathFalconAttention
    return FastpathFalconAttention


def _gptj_class():
    if "gptj" in _classes:
        return _classes["gptj"]
    mj = importlib.import_module("transformers.models.gptj.modeling_gptj")

    class FastpathGPTJAttention(mj.GPTJAttention):
        """GPT-J attention (class-based Transformers versions) on a `fastpath*` kernel: only the score/softmax part
        (`_attn`) changes; projections, rotary and cache are GPT-J's own."""

        def forward(self, hidden_states, layer_past=None, attention_mask=None, position_ids=None, use_cache=False,
                    output_attentions=False, **kwargs):
            self._fastpath_position_ids = position_ids
            try:
                out, _ = super().forward(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                         position_ids=position_ids, use_cache=use_cache,
                                         output_attentions=output_attentions, **kwargs)
            finally:
                self._fastpath_position_ids = None
            return out, None

        def _attn(self, query, key, value, attention_mask=None):
            out, _ = _attention_function(self.config)(
                self, query, key, value, attention_mask, scaling=1.0 / self.scale_attn,
                dropout=self.attn_dropout.p if self.training else 0.0,
                position_ids=getattr(self, "_fastpath_position_ids", None))
            return out.transpose(1, 2), None  # GPT-J merges heads from [B, H, S, D]

    _classes["gptj"] = FastpathGPTJAttention
    return FastpathGPTJAttention


def _swap_attention_classes(model, base_cls, classes: dict) -> None:
    """Give every attention module of `model` the class its config's implementation now selects."""
    name = model.config._attn_implementation
    key = name if name in classes else ("flash_attention_2" if "flash" in name else "eager")
    target = classes.get(key, classes["eager"])
    for module in model.modules():
        if isinstance(module, base_cls) and type(module) is not target:
            module.__class__ = target
            if hasattr(target, "__init__") and "FlashAttention2" in target.__name__:
                from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

                module._flash_attn_uses_top_left_mask = flash_attn_supports_top_left_mask()


def _allow_dynamic_switch(pretrained_cls, base_cls, classes: dict) -> None:
    if pretrained_cls.__dict__.get("_fastpath_switch_patched"):
        return
    original = pretrained_cls.set_attn_implementation

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        result = original(self, attn_implementation, *args, **kwargs)
        _swap_attention_classes(self, base_cls, classes)
        return result

    set_attn_implementation.__doc__ = original.__doc__
    pretrained_cls.set_attn_implementation = set_attn_implementation
    # Transformers guesses from the source whether a model can switch; ours can, once the classes are swapped.
    pretrained_cls._can_set_attn_implementation = classmethod(lambda cls: True)
    pretrained_cls._fastpath_switch_patched = True


# model_type -> (our attention class, the model's attention base class, its pretrained-model class)
_CLASS_BUILDERS = {
    "falcon": (_falcon_class, "FalconAttention", "FalconPreTrainedModel"),
    "gptj": (_gptj_class, "GPTJAttention", "GPTJPreTrainedModel"),
}


def alibi_slopes_of(module, device) -> torch.Tensor | None:
    """The ALiBi slopes (scaled as `falcon_alibi_slopes` says) of an ALiBi Falcon attention module on `device`, else
    None; computed once per module and device: made on the CPU, copying them to the GPU on every call would wait for
    the GPU each time (a pageable host-to-device copy syncs its stream first: 0.65x sdpa on a 1k-token prefill)."""
    config = getattr(module, "config", None)
    if not getattr(config, "alibi", False) or getattr(config, "model_type", None) != "falcon":
        return None
    cached = module.__dict__.get("_fastpath_alibi_slopes")
    if cached is None or cached.device != device:
        cached = falcon_alibi_slopes(module.num_heads, device) * module.inv_norm_factor
        module.__dict__["_fastpath_alibi_slopes"] = cached
    return cached


def _falcon_alibi_as_slopes(falcon_model_cls) -> None:
    """`FalconModel.use_alibi` as a property: False under our names (see the module docstring)."""
    if isinstance(falcon_model_cls.__dict__.get("use_alibi"), property):
        return

    def use_alibi(self):
        return self.__dict__.get("_config_alibi", False) and self.config._attn_implementation not in _OUR_NAMES

    def set_use_alibi(self, value):
        self.__dict__["_config_alibi"] = value

    falcon_model_cls.use_alibi = property(use_alibi, set_use_alibi)


def register_name(name: str) -> None:
    """Map attention `name` to our classes in the class tables of the models that pick attention by class
    (`attention_class_table` in `models.MODELS`), where the installed Transformers has such a table."""
    _OUR_NAMES.add(name)
    for model_type, row in MODELS.items():
        if row.attention_class_table is None:
            continue
        module_name, table_name = row.attention_class_table
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        table = getattr(module, table_name, None)
        if table is None:  # this Transformers calls the attention interface instead
            if model_type == "falcon":
                _falcon_alibi_as_slopes(module.FalconModel)
            continue
        build, base, pretrained = _CLASS_BUILDERS[model_type]
        table[name] = build()
        _allow_dynamic_switch(getattr(module, pretrained), getattr(module, base), table)
