"""The positive control of `offline_builds.barrier_overlaps`: a tiny Gluon kernel that initializes an mbarrier and
then converts a layout through shared memory, built for sm_90 twice, with the barrier left unused after its
initialization (Triton may then put the conversion's scratch on it: the hd256 backward's NaN of session 32) and
with the barrier waited on at the end (live throughout: no overlap). One JSON line per build. Run with
TRITON_INTERPRET unset or 0; `tests/test_gluon_bwd_builds.py` starts it in a subprocess."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

from offline_builds import barrier_overlaps, build_error  # noqa: E402


@gluon.jit
def _convert_after_barrier(x_ptr, y_ptr, USE_BARRIER: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pairs: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])  # across warps: through shared memory
    x = gl.load(x_ptr + gl.arange(0, 256, layout=rows))
    y = gl.convert_layout(x * 2.0, pairs)
    gl.store(y_ptr + gl.arange(0, 256, layout=pairs), y)
    if USE_BARRIER:
        mbarrier.arrive(bar, count=1)
        mbarrier.wait(bar, 0)


def main():
    from triton.experimental.gluon._runtime import GluonASTSource

    for use in (False, True):
        name = f"control barrier {'used' if use else 'unused'}"
        try:
            src = GluonASTSource(_convert_after_barrier, {"x_ptr": "*fp32", "y_ptr": "*fp32",
                                                          "USE_BARRIER": "constexpr"}, {"USE_BARRIER": use})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
            print(json.dumps(dict(name=name, barrier_overlaps=barrier_overlaps(kernel))), flush=True)
        except Exception as exc:  # noqa: BLE001 - report the build
            print(json.dumps(dict(name=name, error=build_error(exc))), flush=True)


if __name__ == "__main__":
    main()
