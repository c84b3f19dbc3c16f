"""What the offline sm_90 build scripts (`sm90_builds.py`, `gluon*_builds.py`: compile without a GPU, one JSON line
per build) and their tests share."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import torch
import triton

HOPPER_SHARED_BYTES = 232448  # per block, opt-in (227 KB)


def run_build_script(name: str, timeout: int = 900) -> list[dict]:
    """Run tests/<name> in a subprocess with the compiler (not the interpreter: its `triton.jit` cannot be
    compiled) and return its JSON lines."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    builds = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert builds, proc.stderr[-3000:]
    return builds


def descriptor_type(dtype: torch.dtype, block: list, gl_dtype=None, layout=None) -> str:
    """The signature string the launcher derives from a host TensorDescriptor (a CPU tensor stands in); layout:
    its shared layout (default: NVMMASharedLayout.get_default_for the block)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    if gl_dtype is None:
        gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    base = torch.empty([2 * n for n in block], dtype=dtype)
    desc = TensorDescriptor(base, list(base.shape), list(base.stride()), block,
                            layout or gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
    return mangle_type(desc)


def dump_asm(kernel, name: str) -> None:
    """With GLUON_BUILDS_DUMP=dir, write the build's ttgir, PTX (and cubin) there."""
    d = os.environ.get("GLUON_BUILDS_DUMP")
    if not d:
        return
    stem = os.path.join(d, name.replace(" ", "_"))
    for ext in ("ttgir", "ptx"):
        with open(f"{stem}.{ext}", "w") as f:
            f.write(kernel.asm[ext])
    if "cubin" in kernel.asm:
        with open(f"{stem}.cubin", "wb") as f:
            f.write(kernel.asm["cubin"])


def build_error(exc: Exception) -> str:
    """Triton wraps the real error in one CompilationError per call level: name the innermost too."""
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    msg = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    if root is not exc:
        msg = f"{type(root).__name__}: {str(root)[-1500:]} | in {msg[:600]}"
    return msg


_ALLOC = re.compile(r"(?:(%[\w.]+) = )?([a-z_]+\.[\w.]+)[ (].*?\{[^}]*allocation\.offset = (\d+) : i32"
                    r"(?:, allocation\.size = (\d+) : i32)?")
_SHAPE = re.compile(r"(?:memdesc|tensor)<((?:\d+x)+)(\w+)")
_BYTES = {"i64": 8, "f32": 4, "i32": 4, "bf16": 2, "f16": 2, "i16": 2, "i8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "i1": 1}


def shared_allocations(kernel) -> list[dict]:
    """Triton's shared-memory allocation of a build: {"name", "op", "offset", "size", "barrier"} per buffer and
    per scratch (layout conversions, ...). The allocation passes of the backend's `make_llir` are re-run on the
    build's TTGIR, as `kernel.asm` keeps no allocated IR. Sizes: Triton 3.9 prints scratch sizes; under 3.6 a
    conversion's scratch is taken as its whole tensor (an upper bound), and other scratch as a single byte."""
    import tempfile

    from triton._C.libtriton import ir, nvidia, passes

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttgir")
        with open(path, "w") as f:
            f.write(kernel.asm["ttgir"])
        mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 87)
    pm.run(mod, "shared_allocations")
    found = {}
    for line in str(mod).splitlines():
        m = _ALLOC.search(line)
        if not m:
            continue
        name, op, offset, size = m.group(1) or m.group(2), m.group(2), int(m.group(3)), m.group(4)
        shapes = _SHAPE.findall(line.split("->")[-1])
        barrier = op == "ttg.local_alloc" and bool(shapes) and shapes[0][1] == "i64"
        if size is None:
            size = 1
            if shapes and (op == "ttg.local_alloc" or op == "ttg.convert_layout"):
                dims, elem = shapes[0]
                size = math.prod(int(x) for x in dims.strip("x").split("x")) * _BYTES.get(elem, 4)
        found[(name, op, offset)] = dict(name=name, op=op, offset=offset, size=int(size), barrier=barrier)
    return list(found.values())


def barrier_overlaps(kernel) -> list[str]:
    """Allocations that share bytes with an mbarrier. Triton reuses the memory of values it sees as dead, but plain
    stores to an initialized mbarrier's memory are undefined until `mbarrier.inval` (PTX): an mbarrier initialized
    and then never used became a layout conversion's scratch in the hd256 backward and read back NaN now and then
    (session 32). Initialize only the barriers a kernel uses."""
    allocs = shared_allocations(kernel)
    bars = [a for a in allocs if a["barrier"]]
    return sorted({f"{a['op']} {a['name']} [{a['offset']}, +{a['size']}) on barrier {b['name']} at {b['offset']}"
                   for b in bars for a in allocs if a is not b
                   and a["offset"] < b["offset"] + b["size"] and b["offset"] < a["offset"] + a["size"]})


def ptxas_report(kernel):
    """Run the bundled ptxas -v / cuobjdump on the build: registers, spills, and whether ptxas serialized the
    wgmmas (its C7514/C7515 notes; in the SASS a `WARPGROUP.DEPBAR.LE gsb0, 0x0` right after each HGMMA), which
    would mean the dequantization never overlaps the MMA."""
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


def assert_sm90_builds_sound(builds: list[dict], spill_allowance: dict) -> None:
    """What every offline Gluon build must satisfy: it built, fits Hopper's shared memory (and the launcher's
    estimate does not undercount it), spills nothing at the Triton level, ptxas ran, and its wgmmas stay
    asynchronous. ptxas spills: none under Triton 3.6 (the GPU's), a few bytes of loop scalars under 3.9, more only
    for builds whose name contains a key of `spill_allowance` (bytes), or whose report's `tags` do."""
    assert not [b for b in builds if "error" in b], builds
    assert not [b for b in builds if b["shared"] > HOPPER_SHARED_BYTES], builds
    assert not [b for b in builds if b["shared"] > b["shared_estimate"]], builds
    assert not [b for b in builds if b["spills"]], builds  # Triton-level (PTX local memory)
    # Triton's wheel ships ptxas: without its report nothing below would be checked
    assert not [b for b in builds if "ptxas_error" in b], builds

    def allowed(b):
        extra = [n for part, n in spill_allowance.items() if part in b["name"] or part in b.get("tags", ())]
        return max(extra) if extra else (0 if b["triton"].startswith("3.6") else 32)

    assert not [b for b in builds if b["ptxas_spill_bytes"] > allowed(b)], builds
    assert not [b for b in builds if b["serialized"] or b["ptxas_notes"]], builds  # a wait after every HGMMA
    assert not [b for b in builds if b["barrier_overlaps"]], builds  # no allocation on an mbarrier's bytes
