"""`W4A16Config`: quantize a float model to low-bit weights while `from_pretrained` loads it.

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=hf_fastpath.W4A16Config(method="gptq"))
    model.save_pretrained(out)   # writes a standard GPTQ (or AWQ) checkpoint: any GPTQ/AWQ tool reads it

Registered with Transformers under the quant method "fastpath_w4a16". The saved config.json carries a plain `gptq`
(method "gptq" or "rtn") or `awq` (method "awq") quantization_config, so the file is not tied to hf_fastpath.
"""

from __future__ import annotations

from typing import Any

from transformers.utils.quantization_config import AwqConfig, GPTQConfig, QuantizationConfigMixin

QUANT_METHOD = "fastpath_w4a16"
METHODS = ("gptq", "awq", "rtn")


class W4A16Config(QuantizationConfigMixin):
    """Weight-only quantization settings.

    Args:
        method: "gptq" (Hessian-based error feedback), "awq" (activation-aware scaling) or "rtn" (round to nearest).
        bits: 4 (the kernels' format); 2, 3 and 8 quantize and save too but run through dequantize + matmul.
        group_size: input features sharing one scale and zero point; -1 for one group per output row.
        sym: symmetric grid (zero point 2**(bits-1)); AWQ is asymmetric by nature and defaults to sym=False.
        desc_act: GPTQ act-order (quantize columns by decreasing Hessian diagonal; stored with a g_idx).
        dataset: calibration text: a list of strings, or a name the calibration module knows.
        num_samples, seq_len: number and length of calibration sequences.
        modules_to_not_convert: module names (or name suffixes) kept in full precision; lm_head never converts.
        checkpoint_format: GPTQ storage, "gptq" (v1, read by every tool) or "gptq_v2". v1 cannot store a zero
            point of 0: if asymmetric quantization produces one, the model is saved as "gptq_v2" (with a warning).
        true_sequential, static_groups, damp_percent: GPTQ options.
        gptaq: GPTQ fits each linear to the float model's output computed from the float model's own inputs (GPTAQ,
            "asymmetric calibration"), so it corrects the error of the layers quantized before it instead of
            inheriting it. On by default for GPTQ (on SmolLM2, 4-bit act-order: perplexity x1.34 -> x1.19 of float,
            3-bit x3.59 -> x1.99; benchmarks/results/quant_quality_cpu.json); it carries a float copy of each block
            and its hidden states through calibration, which about doubles GPTQ's calibration time.
            gptaq=False is classic GPTQ.
        gptaq_alpha: how far (0-1] GPTAQ moves the target toward its least-squares optimum.
        tokenizer: tokenizer (or its path) for the calibration text; default: the model's own path.
        batch_size: calibration sequences per forward (default: ~8192 tokens a batch).
        awq_duo_scaling, awq_search_tokens: AWQ options (scales from activations and weights; tokens per search).
    AWQ at other than 4 bits is stored GPTQ-style (AWQ GEMM checkpoints hold 4-bit weights only).
    This is the one settings object: calibration (`quantization.calibrate.quantize_model`) reads it directly.
    """

    def __init__(
        self,
        method: str = "gptq",
        bits: int = 4,
        group_size: int = 128,
        sym: bool | None = None,
        desc_act: bool = False,
        dataset: Any = None,
        num_samples: int | None = None,
        seq_len: int | None = None,
        modules_to_not_convert: list[str] | None = None,
        checkpoint_format: str = "gptq",
        true_sequential: bool = True,
        static_groups: bool = False,
        damp_percent: float = 0.01,
        gptaq: bool | None = None,
        gptaq_alpha: float = 0.25,
        tokenizer: Any = None,
        batch_size: int | None = None,
        awq_duo_scaling: bool = True,
        awq_search_tokens: int | None = None,
        **kwargs,
    ):
        self.quant_method = QUANT_METHOD
        self.method = method
        self.bits = bits
        self.group_size = group_size
        self.sym = (method != "awq") if sym is None else sym
        self.desc_act = desc_act
        self.dataset = dataset
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.modules_to_not_convert = modules_to_not_convert
        self.checkpoint_format = checkpoint_format
        self.true_sequential = true_sequential
        self.static_groups = static_groups
        self.damp_percent = damp_percent
        self.gptaq = (method == "gptq") if gptaq is None else gptaq
        self.gptaq_alpha = gptaq_alpha
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.awq_duo_scaling = awq_duo_scaling
        self.awq_search_tokens = awq_search_tokens
        for key, value in kwargs.items():  # keep unknown keys (forward compatibility of saved configs)
            setattr(self, key, value)
        self.post_init()

    def post_init(self):
        if self.method not in METHODS:
            raise ValueError(f"W4A16Config(method={self.method!r}): choose one of {METHODS}")
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"W4A16Config(bits={self.bits}): choose 2, 3, 4 or 8 (4 runs on the Triton kernels)")
        if self.group_size is None or (self.group_size != -1 and self.group_size <= 0):
            raise ValueError(f"W4A16Config(group_size={self.group_size}): use a positive size or -1")
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"W4A16Config(checkpoint_format={self.checkpoint_format!r}): use 'gptq' or 'gptq_v2'")
        if self.desc_act and self.method != "gptq":
            raise ValueError("desc_act (act-order) applies to method='gptq' only")
        if self.gptaq and self.method != "gptq":
            raise ValueError("gptaq applies to method='gptq' only")
        if not 0 < self.gptaq_alpha <= 1:
            raise ValueError(f"W4A16Config(gptaq_alpha={self.gptaq_alpha}): must lie in (0, 1]")
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"W4A16Config(damp_percent={self.damp_percent}): must lie in (0, 1)")

    @property
    def saved_format(self) -> str:
        """The format `W4A16Linear` layers write: "awq" for 4-bit AWQ, else the GPTQ checkpoint_format."""
        return "awq" if self.method == "awq" and self.bits == 4 else self.checkpoint_format

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not isinstance(out.get("tokenizer"), (str, type(None))):
            out["tokenizer"] = None  # a tokenizer object is not JSON
        return out

    def standard_config(self, checkpoint_format: str | None = None, kept_in_float=()) -> QuantizationConfigMixin:
        """The plain Transformers `GPTQConfig` / `AwqConfig` a model quantized with this config is saved with.
        `kept_in_float`: names of linears calibration left in 16 bits (routers...), listed for AWQ loaders (GPTQ's
        config has no such field: loaders find the quantized layers by their `qweight` tensors)."""
        from .. import __version__

        if self.saved_format == "awq":
            # zero_point=True: qzeros are always stored (a symmetric grid just has zero 8 everywhere)
            not_converted = list(dict.fromkeys([*(self.modules_to_not_convert or ()), *kept_in_float])) or None
            return AwqConfig(bits=4, group_size=self.group_size, zero_point=True, version="gemm",
                             modules_to_not_convert=not_converted)
        return GPTQConfig(bits=self.bits, group_size=self.group_size, damp_percent=self.damp_percent,
                          desc_act=self.desc_act, act_group_aware=False, sym=self.sym,
                          true_sequential=self.true_sequential,
                          format=checkpoint_format or self.checkpoint_format,
                          meta={"quantizer": [f"hf_fastpath:{__version__}"], "method": self.method,
                                "static_groups": self.static_groups,
                                "gptaq_alpha": self.gptaq_alpha if self.gptaq else 0.0})
