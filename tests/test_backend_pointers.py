"""CPU check of the CUDA backend's pointer helpers (no GPU or library needed): the addresses
handed to the C ABI must be those the indexing ops they replace would give."""

import torch

from megatron_mok.cuda.backend import CudaBackend


def test_row_ptrs_are_the_rows_data_pointers():
    for n in (1, 7, 4096):
        src = torch.empty(2, n, dtype=torch.int64)
        assert CudaBackend._row_ptrs(src) == (src[0].data_ptr(), src[1].data_ptr())


def test_row_ptrs_of_nothing_are_null():
    assert CudaBackend._row_ptrs(None) == (0, 0)
    assert CudaBackend._row_ptrs(torch.empty(2, 0, dtype=torch.int64)) == (0, 0)
    assert CudaBackend._ptr(torch.empty(0)) == 0 and CudaBackend._ptr(None) == 0
