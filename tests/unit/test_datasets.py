"""Datasets as flodl reads them: tensors, torch datasets adapted, and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset, default_collate

from flodl.data.dataset import BatchDataSet, TensorDataSet, as_dataset, read_batch


def test_tensor_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="disagree on length"):
        TensorDataSet(torch.zeros(3, 2), torch.zeros(4))


def test_tensor_dataset_needs_a_field():
    with pytest.raises(ValueError, match="at least one tensor"):
        TensorDataSet()


def test_tensor_dataset_get_batch_gathers_rows():
    x = torch.arange(10).view(5, 2)
    y = torch.arange(5) * 10
    data = TensorDataSet(x, y)
    assert len(data) == 5
    bx, by = data.get_batch(torch.tensor([4, 0, 4]))
    assert bx.tolist() == [[8, 9], [0, 1], [8, 9]]
    assert by.tolist() == [40, 0, 40]


def test_as_dataset_keeps_a_batch_dataset():
    data = TensorDataSet(torch.zeros(2))
    assert isinstance(data, BatchDataSet)
    assert as_dataset(data, "task.train_data") is data


def test_a_torch_dataset_batch_is_what_a_dataloader_gives():
    x = torch.arange(12, dtype=torch.float32).view(6, 2)
    y = torch.arange(6)
    data = as_dataset(TensorDataset(x, y), "task.train_data")
    idx = torch.tensor([5, 1, 1])
    bx, by = read_batch(data, idx, default_collate)
    (lx, ly) = next(iter(DataLoader(Subset(data, idx.tolist()), batch_size=3)))
    assert torch.equal(bx, lx) and torch.equal(by, ly) and torch.equal(bx, x[idx])


def test_as_dataset_rejects_an_empty_dataset():
    with pytest.raises(ValueError, match=r"task\.train_data: the dataset is empty"):
        as_dataset(TensorDataset(torch.empty(0, 2)), "task.train_data")
    with pytest.raises(ValueError, match=r"task\.eval_data: the dataset is empty"):
        as_dataset(TensorDataSet(torch.empty(0)), "task.eval_data")


@pytest.mark.parametrize("data", [42, object(), None])
def test_as_dataset_rejects_a_non_dataset(data):
    with pytest.raises(TypeError) as info:
        as_dataset(data, "task.eval_data")
    message = str(info.value)
    assert message.startswith("task.eval_data: ")
    assert type(data).__name__ in message
