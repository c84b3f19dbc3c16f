"""FP4 KV-cache decode kernel (`_decode_fp4_kernel`, block scales on the MMA rows) and its PTX unpack."""

import re

import pytest
import torch

from hf_fastpath.attention import reference
from hf_fastpath.kernels import lowbit_decode as ld
from hf_fastpath.kernels import lowbit_quant as lq

_MASK = 0xFFFFFFFF


def _run_ptx(program: str, regs: dict) -> dict:
    """Tiny interpreter for the integer PTX the unpack uses (prmt, shl, shr, and, lop3)."""
    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 16) if tok.startswith("0x") else int(tok)

    for line in program.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "prmt.b32":
            pool = [(src[0] >> (8 * i)) & 0xFF for i in range(4)] + [(src[1] >> (8 * i)) & 0xFF for i in range(4)]
            out = 0
            for i in range(4):
                sel = (src[2] >> (4 * i)) & 0xF
                assert sel < 8, "sign-replicate mode is not used"
                out |= pool[sel] << (8 * i)
        elif op == "shl.b32":
            out = (src[0] << src[1]) & _MASK
        elif op == "shr.b32":
            out = src[0] >> src[1]
        elif op == "and.b32":
            out = src[0] & src[1]
        elif op == "lop3.b32":
            a, b, c, lut = src
            out = 0
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                out |= ((lut >> idx) & 1) << bit
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        regs[d] = out
    return regs


def _halves(reg: int) -> list:
    return torch.tensor([reg & 0xFFFF, reg >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16).tolist()


def test_ptx_unpack_gives_every_e2m1_value_exactly():
    """The GPU-only PTX bit trick, run by a Python model of its instructions on every byte in every position."""
    program = ld._E2M1_F16_PTX.value if hasattr(ld._E2M1_F16_PTX, "value") else ld._E2M1_F16_PTX
    assert set(re.findall(r"\$(\d)", program)) == {"0", "1", "2", "3", "4"}
    gen = torch.Generator().manual_seed(0)
    for pos in range(4):
        for byte in range(256):
            word = torch.randint(0, 256, (4,), generator=gen).tolist()
            word[pos] = byte
            regs = _run_ptx(program, {"$4": sum(b << (8 * i) for i, b in enumerate(word))})
            lo = _halves(regs["$0"]) + _halves(regs["$1"])
            hi = _halves(regs["$2"]) + _halves(regs["$3"])
            codes = torch.tensor(word, dtype=torch.uint8)
            want_lo = (lq.e2m1_decode(codes & 0xF) / 16384).tolist()
            want_hi = (lq.e2m1_decode(codes >> 4) / 16384).tolist()
            assert lo == want_lo and hi == want_hi, (word, lo, want_lo, hi, want_hi)


def _case(b, hq, hkv, s, d, fmt, scale_k=1.0, cap_extra=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    k = torch.randn(b, hkv, s + cap_extra, d, generator=g) * scale_k
    v = torch.randn(b, hkv, s + cap_extra, d, generator=g)
    qk, qv = lq.quantize_rows(k, fmt), lq.quantize_rows(v, fmt)
    kc, vc = (qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale)
    ref_o, ref_l = reference.attention_forward(q.float()[:, None], lq.dequantize_rows(qk)[:, :, :s].transpose(1, 2),
                                               lq.dequantize_rows(qv)[:, :, :s].transpose(1, 2), softmax_scale=0.2)
    return q, kc, vc, ref_o[:, 0], ref_l[:, :, 0]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 2, 2, 37, 32), (2, 8, 2, 70, 64), (1, 16, 2, 33, 64), (1, 6, 2, 1, 32)])
def test_rows_kernel_matches_reference(fmt, b, hq, hkv, s, d, monkeypatch):
    """MHA (1 head per KV head), GQA 4 and 8, a non-power-of-two group (3), a single cached token, odd lengths."""
    monkeypatch.setitem(ld.DECODE_CONFIG_OVERRIDE, fmt, {"fp4_kernel": "rows"})
    q, kc, vc, ro, rl = _case(b, hq, hkv, s, d, fmt)
    out, lse = ld.lowbit_decode(q, kc, vc, s, fmt=fmt, softmax_scale=0.2)
    torch.testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), ro, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_rows_and_tile_kernels_agree_on_wide_scale_ranges(fmt, monkeypatch):
    """Tokens from 1e-3 to 1e3 (block scales far apart inside one key tile) and an all-zero token."""
    q = _case(1, 8, 2, 40, 64, fmt, seed=3)[0]
    scales = torch.logspace(-3, 3, 45)
    k = torch.randn(1, 2, 45, 64) * scales[None, None, :, None]
    v = torch.randn(1, 2, 45, 64) * scales.flip(0)[None, None, :, None]
    k[:, :, 7] = 0
    v[:, :, 7] = 0
    qk, qv = lq.quantize_rows(k, fmt), lq.quantize_rows(v, fmt)
    kc, vc = (qk.data, qk.scale, qk.block_scale), (qv.data, qv.scale, qv.block_scale)
    q = (q.float() * 1e-2).bfloat16()  # keep the largest keys' scores moderate
    ref_o, ref_l = reference.attention_forward(q.float()[:, None], lq.dequantize_rows(qk)[:, :, :40].transpose(1, 2),
                                               lq.dequantize_rows(qv)[:, :, :40].transpose(1, 2), softmax_scale=0.2)
    outs = {}
    for kernel in ("rows", "tile"):
        monkeypatch.setitem(ld.DECODE_CONFIG_OVERRIDE, fmt, {"fp4_kernel": kernel})
        outs[kernel] = ld.lowbit_decode(q, kc, vc, 40, fmt=fmt, softmax_scale=0.2)
        torch.testing.assert_close(outs[kernel][1], ref_l[:, :, 0], atol=1e-4, rtol=1e-5)
        scale = ref_o.abs().amax()
        torch.testing.assert_close(outs[kernel][0].float() / scale, ref_o[:, 0] / scale, atol=1e-2, rtol=0)
    torch.testing.assert_close(outs["rows"][0].float(), outs["tile"][0].float(), atol=1e-2 * scale, rtol=1e-2)


def test_explicit_splits_and_integer_unpack(monkeypatch):
    """More key splits than needed (the launcher trims them) and the Triton-ops unpack (UNPACK=0)."""
    monkeypatch.setitem(ld.DECODE_CONFIG_OVERRIDE, "mxfp4", {"fp4_kernel": "rows", "unpack": 0})
    q, kc, vc, ro, rl = _case(1, 4, 1, 90, 64, "mxfp4", seed=5)
    out, lse = ld.lowbit_decode(q, kc, vc, 90, fmt="mxfp4", softmax_scale=0.2, num_splits=7, block_n=16)
    torch.testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), ro, atol=1e-2, rtol=1e-2)


def test_decode_byte_layout_is_a_bijection_keeping_both_codes():
    b = torch.arange(256, dtype=torch.uint8)
    rec = lq.recode_for_decode(b)
    assert torch.equal(lq.recode_from_decode(rec), b) and len(set(rec.tolist())) == 256
    # even element: magnitude bits 0-2, sign bit 6; odd element: bits 3-5, sign bit 7
    even, odd = b & 0xF, b >> 4
    r = rec.int()
    assert torch.equal((r & 7) | ((r >> 3) & 8), even.int()) and torch.equal(((r >> 3) & 7) | ((r >> 4) & 8), odd.int())


def test_ptx_unpack_of_decode_layout_gives_every_e2m1_value_exactly():
    program = ld._E2M1_F16_RECODED_PTX.value if hasattr(ld._E2M1_F16_RECODED_PTX, "value") \
        else ld._E2M1_F16_RECODED_PTX
    gen = torch.Generator().manual_seed(1)
    for pos in range(4):
        for byte in range(256):
            word = torch.randint(0, 256, (4,), generator=gen).tolist()
            word[pos] = byte
            rec = lq.recode_for_decode(torch.tensor(word, dtype=torch.uint8)).tolist()
            regs = _run_ptx(program, {"$4": sum(b << (8 * i) for i, b in enumerate(rec))})
            even = _halves(regs["$0"]) + _halves(regs["$1"])
            odd = _halves(regs["$2"]) + _halves(regs["$3"])
            codes = torch.tensor(word, dtype=torch.uint8)
            assert even == (lq.e2m1_decode(codes & 0xF) / 16384).tolist()
            assert odd == (lq.e2m1_decode(codes >> 4) / 16384).tolist()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("kernel", ["rows", "tile"])
def test_decode_layout_cache_matches_reference(fmt, kernel, monkeypatch):
    """Recoded bytes through the rows kernel (integer-op unpack under the interpreter), and through the tile kernel's
    fallback that converts back to nibbles."""
    monkeypatch.setitem(ld.DECODE_CONFIG_OVERRIDE, fmt, {"fp4_kernel": kernel})
    q, kc, vc, ro, rl = _case(2, 8, 2, 45, 64, fmt, seed=7)
    kc = (lq.recode_for_decode(kc[0]),) + kc[1:]
    vc = (lq.recode_for_decode(vc[0]),) + vc[1:]
    out, lse = ld.lowbit_decode(q, kc, vc, 45, fmt=fmt, softmax_scale=0.2, code_layout="decode")
    torch.testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), ro, atol=1e-2, rtol=1e-2)


def test_bad_code_layout():
    q, kc, vc, _, _ = _case(1, 2, 2, 4, 32, "mxfp4")
    with pytest.raises(ValueError, match="code_layout"):
        ld.lowbit_decode(q, kc, vc, 4, fmt="mxfp4", code_layout="packed")


def test_packed_cache_stores_decode_layout_and_reads_the_same_values():
    from hf_fastpath.integrations.lowbit_cache import LowBitCache

    x = torch.randn(1, 2, 11, 32)
    plain, packed = LowBitCache("nvfp4"), LowBitCache("nvfp4", packed_decode=True)
    k_plain, _ = plain.update(x, x, 0)
    packed.update(x, x, 0)
    store = packed.layers[0].k_store
    assert store.code_layout == "decode"
    assert torch.equal(store.data[:, :, :11], lq.recode_for_decode(plain.layers[0].k_store.data[:, :, :11]))
    torch.testing.assert_close(store.dequantize(torch.float32), k_plain, rtol=0, atol=0)
