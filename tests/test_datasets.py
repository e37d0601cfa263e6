"""Datasets as flodl reads them: tensors, torch datasets adapted, and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from flodl.data.dataset import BatchDataSet, MapDataSet, TensorDataSet, as_batch_dataset


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


def test_as_batch_dataset_keeps_a_batch_dataset():
    data = TensorDataSet(torch.zeros(2))
    assert isinstance(data, BatchDataSet)
    assert as_batch_dataset(data, "task.train_data") is data


def test_as_batch_dataset_adapts_a_torch_dataset():
    x = torch.arange(12, dtype=torch.float32).view(6, 2)
    y = torch.arange(6)
    data = as_batch_dataset(TensorDataset(x, y), "task.train_data")
    assert isinstance(data, MapDataSet)
    assert len(data) == 6
    idx = torch.tensor([5, 1, 1])
    bx, by = data.get_batch(idx)
    assert torch.equal(bx, x[idx])
    assert torch.equal(by, y[idx])


def test_as_batch_dataset_adapts_single_field_items():
    data = as_batch_dataset([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], "task.eval_data")
    (batch,) = data.get_batch(torch.tensor([1, 0]))
    assert batch.tolist() == [[3.0, 4.0], [1.0, 2.0]]


def test_as_batch_dataset_rejects_an_empty_dataset():
    with pytest.raises(ValueError, match=r"task\.train_data: the dataset is empty"):
        as_batch_dataset(TensorDataset(torch.empty(0, 2)), "task.train_data")
    with pytest.raises(ValueError, match=r"task\.eval_data: the dataset is empty"):
        as_batch_dataset(TensorDataSet(torch.empty(0)), "task.eval_data")


@pytest.mark.parametrize("data", [42, object(), None])
def test_as_batch_dataset_rejects_a_non_dataset(data):
    with pytest.raises(TypeError) as info:
        as_batch_dataset(data, "task.eval_data")
    message = str(info.value)
    assert message.startswith("task.eval_data: ")
    assert type(data).__name__ in message
