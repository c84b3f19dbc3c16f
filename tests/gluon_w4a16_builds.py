"""Compiles the Gluon W4A16 GEMM (`hf_fastpath.kernels.gluon_w4a16`) for sm_90 without a GPU and prints one JSON
line per variant: `{"name", "shared", "spills", "setmaxnreg", "wgmma_wait_1", ...}` or `{"name", "error"}`. Run with
TRITON_INTERPRET unset or 0 (Gluon has no interpreter); `tests/test_gluon_w4a16_builds.py` starts it in a
subprocess. GLUON_BUILDS_DUMP=dir writes each variant's ttgir / ptx there."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from hf_fastpath.kernels import gluon_w4a16 as gw  # noqa: E402


def _descriptor_type(dtype, block, gl_dtype):
    """The signature string the launcher derives from a host TensorDescriptor (a CPU tensor stands in)."""
    from triton.runtime.jit import mangle_type

    base = torch.empty(block[0] * 2, block[1], dtype=dtype)
    desc = gw.TensorDescriptor(base, list(base.shape), list(base.stride()), block,
                               gw.gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
    return mangle_type(desc)


def build(block_m, stages, plane_groups, dtype=torch.bfloat16, ptx=True, split=False):
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gw._w4a16_kernel
    elem = gw.gl.bfloat16 if dtype == torch.bfloat16 else gw.gl.float16
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name == "x_desc":
            sig[p.name] = _descriptor_type(dtype, [block_m, gw.BLOCK_K], elem)
        elif p.name == "w_desc":
            sig[p.name] = _descriptor_type(torch.int32, [gw.BLOCK_N, 16], gw.gl.int32)
        elif p.name == "y_ptr" and split:  # split-K: fp32 partial sums
            sig[p.name] = "*fp32"
        elif p.name.endswith("_ptr"):
            sig[p.name] = ptr
        else:
            sig[p.name] = "i32"
    constexprs = dict(STAGES=stages, PLANE_GROUPS=plane_groups, PTX=ptx, GROUP_M=gw.GROUP_M)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if p.name.endswith("_ptr")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=gw.MAXNREG))


def _ptxas_report(kernel):
    """Run the bundled ptxas -v / cuobjdump on the build: registers, spills, and whether ptxas serialized the
    wgmmas (its C7514/C7515 notes; in the SASS a `WARPGROUP.DEPBAR.LE gsb0, 0x0` right after each HGMMA), which
    would mean the dequantization never overlaps the MMA."""
    import re
    import subprocess
    import tempfile

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    try:  # the ptxas Triton itself uses for sm_90 (3.9 picks its CUDA 13 `ptxas-blackwell`, 3.6 CUDA 12.8's)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:  # noqa: BLE001 - older / newer Triton: the bundled default
        ptxas = os.path.join(bindir, "ptxas")
    out = {"ptxas": os.path.basename(ptxas)}
    with tempfile.TemporaryDirectory() as d:
        ptx, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        try:
            log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", obj],
                                 capture_output=True, text=True, timeout=300).stderr
            sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", obj], capture_output=True, text=True,
                                  timeout=300).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return dict(ptxas_error=str(exc)[-300:])
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out["ptxas_regs"] = int(regs.group(1)) if regs else None
    out["ptxas_spill_bytes"] = sum(map(int, spill.groups())) if spill else None
    out["ptxas_notes"] = sorted(set(re.findall(r"\((C75\d\d)\)", log)))
    ops = [ln.split()[1] if ln.split()[0].startswith("/*") else ln.split()[0]
           for ln in (x.strip() for x in sass.splitlines()) if "HGMMA" in ln or "DEPBAR" in ln]
    hgmma = sum(1 for o in ops if o.startswith("HGMMA"))
    waited = sum(1 for a, b in zip(ops, ops[1:]) if a.startswith("HGMMA") and b.startswith("WARPGROUP.DEPBAR"))
    out["hgmma"], out["hgmma_then_wait"] = hgmma, waited
    out["serialized"] = bool(hgmma) and waited * 2 > hgmma  # most HGMMAs waited on at once
    return out


def cases():
    """Every launch configuration `gluon_w4a16_matmul` can pick (config(m) for each M bucket), both group modes,
    both unpack paths, split-K's fp32 output: (name, block_m, stages, plane_groups, dtype, ptx, split)."""
    seen = set()
    for m in (1, 4096):
        block_m, stages = gw.config(m)
        if block_m in seen:
            continue
        seen.add(block_m)
        for ptx in (True, False):
            tag = "" if ptx else " plain"
            yield f"m{block_m} s{stages} g128 bf16{tag}", block_m, stages, False, torch.bfloat16, ptx, False
            yield f"m{block_m} s{stages} g32 bf16{tag}", block_m, stages, True, torch.bfloat16, ptx, False
        yield f"m{block_m} s{stages} g128 bf16 split", block_m, stages, False, torch.bfloat16, True, True
    block_m, stages = gw.config(4096)
    for ptx in (True, False):
        tag = "" if ptx else " plain"
        yield f"m{block_m} s{stages} g128 fp16{tag}", block_m, stages, False, torch.float16, ptx, False
        yield f"m{block_m} s{stages} g64 fp16{tag}", block_m, stages, True, torch.float16, ptx, False


def main():
    only = sys.argv[1:]
    for name, block_m, stages, plane_groups, dtype, ptx, split in cases():
        if only and not any(o in name for o in only):
            continue
        try:
            kernel = build(block_m, stages, plane_groups, dtype, ptx, split)
            ptx = kernel.asm.get("ptx", "")
            print(json.dumps(dict(name=name, shared=kernel.metadata.shared, spills=ptx.count("local.") > 0,
                                  setmaxnreg=ptx.count("setmaxnreg"), n_regs=getattr(kernel, "n_regs", None),
                                  wgmma=ptx.count("wgmma.mma_async"),
                                  wgmma_wait_1=ptx.count("wgmma.wait_group.sync.aligned 1"),
                                  triton=triton.__version__, **_ptxas_report(kernel))), flush=True)
            if os.environ.get("GLUON_BUILDS_DUMP"):
                d = os.environ["GLUON_BUILDS_DUMP"]
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(d, name.replace(" ", "_") + "." + ext), "w") as f:
                        f.write(kernel.asm[ext])
                if "cubin" in kernel.asm:
                    with open(os.path.join(d, name.replace(" ", "_") + ".cubin"), "wb") as f:
                        f.write(kernel.asm["cubin"])
        except Exception as exc:  # noqa: BLE001 - report every build
            root = exc  # Triton wraps the real error in one CompilationError per call level: report the innermost
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            msg = f"{type(exc).__name__}: {str(exc)[-1500:]}"
            if root is not exc:
                msg = f"{type(root).__name__}: {str(root)[-1500:]} | in {msg[:600]}"
            print(json.dumps(dict(name=name, error=msg)), flush=True)


if __name__ == "__main__":
    main()
