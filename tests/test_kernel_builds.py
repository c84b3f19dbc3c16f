"""The Triton attention kernels and the W4A16 decode kernel compile for Hopper (sm_90) and fit its shared memory,
checked without a GPU.

The interpreter that the rest of the suite uses never compiles a kernel, so a kernel that no longer builds (or
needs more than 227 KB of shared memory at some head dim, as the hd-256 decode tiles once did) would pass CI and
fail on the first GPU. `sm90_builds.py` compiles each kernel variant with Triton's own compiler in a subprocess.
"""

from __future__ import annotations

from tests.offline_builds import HOPPER_SHARED_BYTES, run_build_script


def test_triton_kernels_build_for_sm90():
    builds = run_build_script("sm90_builds.py")
    failed = [b for b in builds if "error" in b]
    assert not failed, failed
    too_big = [b for b in builds if b["shared"] > HOPPER_SHARED_BYTES]
    assert not too_big, too_big
    names = {b["name"] for b in builds}
    assert {"fwd decode hd256 bf16", "fwd hd128 mask2 bf16", "dkdv hd128 mask2 bf16", "dq hd256 mask1 fp32",
            "w4a16 decode m16 4096x14336 g128 segmented experts",
            "w4a16 decode m1 4096x4096 g32 split experts", "fill outside sequences bf16"} <= names
