"""The one data type between stages: conversions and validation."""

import pytest
import torch

import sparsecomm as sc
from sparsecomm import SparseGradient


def test_dense_round_trip_keeps_shape_and_values():
    dense = torch.tensor([[0.0, 1.5, 0.0], [-2.0, 0.0, 0.25]])
    grad = SparseGradient.from_dense(dense)
    assert grad.nnz == 3 and grad.numel == 6 and grad.shape == dense.shape
    assert grad.indices.tolist() == [1, 3, 5]
    assert torch.equal(grad.to_dense(), dense)


def test_sparse_coo_round_trip():
    dense = torch.zeros(4, 5)
    dense[1, 2], dense[3, 0] = 7.0, -1.0
    grad = SparseGradient.from_sparse_coo(dense.to_sparse())
    assert torch.equal(grad.to_dense(), dense)
    assert torch.equal(grad.to_sparse_coo().to_dense(), dense)


def test_hybrid_coo_from_sparse_embedding_is_flattened_row_major():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([2, 7, 2])).sum().backward()
    grad = SparseGradient.from_sparse_coo(embedding.weight.grad)
    assert grad.shape == (10, 3)
    assert sorted(grad.indices.tolist()) == [6, 7, 8, 21, 22, 23]
    assert torch.equal(grad.to_dense(), embedding.weight.grad.to_dense())  # duplicates summed


def test_validate_rejects_duplicates_and_out_of_range():
    with pytest.raises(sc.SparseCommError, match="duplicate index 3"):
        SparseGradient(torch.tensor([3, 1, 3]), torch.ones(3), torch.Size([5])).validate()
    with pytest.raises(sc.SparseCommError, match="out of range"):
        SparseGradient(torch.tensor([5]), torch.ones(1), torch.Size([5])).validate()


def test_mismatched_lengths_are_rejected_at_construction():
    with pytest.raises(sc.SparseCommError, match="2 indices but 1 values"):
        SparseGradient(torch.tensor([0, 1]), torch.ones(1), torch.Size([4]))


def test_empty_gradient():
    grad = SparseGradient.from_dense(torch.zeros(0))
    assert grad.nnz == 0 and grad.numel == 0 and grad.density == 0.0
    assert grad.to_dense().shape == (0,)


def test_sorted_orders_indices_and_keeps_each_value_with_its_index():
    unsorted = sc.SparseGradient(torch.tensor([9, 2, 5]), torch.tensor([0.9, 0.2, 0.5]), (10,))
    ordered = unsorted.sorted()
    assert ordered.indices.tolist() == [2, 5, 9] and ordered.values.tolist() == pytest.approx([0.2, 0.5, 0.9])
    assert ordered.sorted() is ordered  # already ascending: nothing to do
    assert torch.equal(ordered.to_dense(), unsorted.to_dense())


@pytest.mark.parametrize("nnz, numel, dtype", [
    (1000, 3_000_000, torch.float32),  # two 16-bit radix passes: the high digit decides most pairs
    (1000, 40_000, torch.float16),  # every index below 2**16: the high digit is 0 throughout
    ((1 << 15) - 1, 1 << 32, torch.float64),  # the last size and range of the 16-bit digits
    (1 << 15, 16_000_000, torch.float64),  # torch's radix sort of 32-bit keys
    (2000, (1 << 32) + 5, torch.float32),  # indices past 32 bits: torch sorts 64-bit keys
    (1000, 3_000_000, torch.bfloat16),  # values numpy lacks: gathered by torch
    (1 << 15, 16_000_000, torch.bfloat16),
])
def test_every_sort_path_orders_indices_and_keeps_values_paired(nnz, numel, dtype):
    generator = torch.Generator().manual_seed(nnz)
    indices = torch.randint(0, numel, (3 * nnz,), generator=generator).unique()[:nnz]
    indices = indices[torch.randperm(len(indices), generator=generator)]
    values = (indices % 1021).to(dtype)  # each value names its index
    ordered = sc.SparseGradient(indices, values, (numel,)).sorted()
    assert torch.equal(ordered.indices, indices.sort().values)
    assert torch.equal(ordered.values, (ordered.indices % 1021).to(dtype))


def test_sorting_values_that_require_grad_keeps_them_in_the_graph():
    values = torch.tensor([0.9, 0.2, 0.5], requires_grad=True)
    ordered = sc.SparseGradient(torch.tensor([9, 2, 5]), values, (10,)).sorted()
    ordered.values.sum().backward()
    assert ordered.values.tolist() == pytest.approx([0.2, 0.5, 0.9]) and values.grad.tolist() == [1.0, 1.0, 1.0]
