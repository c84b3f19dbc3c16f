"""`kernels.varlen_gaps.fill_outside_sequences` (interpreted on the CPU): exactly the rows outside every sequence
change, along either token dim, for offsets that leave gaps at both ends, none, or hold no sequence."""

import os

import pytest
import torch

from hf_fastpath.kernels.varlen_gaps import fill_outside_sequences

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests run interpreted")


@pytest.mark.parametrize("offsets", [[3, 10, 10, 37], [0, 40], [0, 0, 0], [40, 40], [5], [0, 17, 21]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_rows_outside_change(offsets, dtype):
    cu = torch.tensor(offsets, dtype=torch.int32)
    x = torch.randn(40, 3, 50).to(dtype)  # 150 columns: several column blocks and a partial one
    lse = torch.randn(3, 40)
    want_x, want_lse = x.clone(), lse.clone()
    outside = torch.ones(40, dtype=torch.bool)
    outside[offsets[0]:offsets[-1]] = False
    want_x[outside] = 0
    want_lse[:, outside] = float("-inf")
    fill_outside_sequences(cu, (x, 0.0, 0), (lse, float("-inf"), 1))
    assert torch.equal(x, want_x) and torch.equal(lse, want_lse)
    one = torch.randn(40, 7)  # one target alone
    want_one = one.clone()
    want_one[outside] = 0
    fill_outside_sequences(cu, (one, 0.0, 0))
    assert torch.equal(one, want_one)


def test_refuses_a_tensor_it_would_copy():
    x = torch.zeros(8, 4, 6).transpose(1, 2)  # the non-token dims do not flatten to one stride
    with pytest.raises(ValueError, match="one stride"):
        fill_outside_sequences(torch.tensor([2, 5], dtype=torch.int32), (x, 0.0, 0))
    with pytest.raises(ValueError, match="as many tokens"):
        fill_outside_sequences(torch.tensor([2, 5], dtype=torch.int32), (torch.zeros(8, 3), 0.0, 0),
                               (torch.zeros(9, 3), 0.0, 0))
