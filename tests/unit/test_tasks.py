"""The benchmark tasks: model sizes of the configs, the stdlib corpus split, deterministic datasets, and a
GPT that learns."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flodl.tasks.digits import SPLIT_SEED, TEST_FRACTION, digits_dataset
from flodl.tasks.gpt import GPT, next_token_loss, next_token_sums, stdlib_files, stdlib_text, synthetic_tokens
from flodl.tasks.resnet import ResNet20, synthetic_images
from tests.helpers.corpus import fake_library

CONF = Path(__file__).resolve().parents[2] / "conf" / "task"


def params_of(task: str) -> int:
    cfg = OmegaConf.load(CONF / f"{task}.yaml")
    with torch.device("meta"):  # sizes only: no memory, no init time
        model = instantiate(cfg.task.model)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("task", "low", "high"),
    [
        ("gpt_nano", 10.6e6, 11.0e6),
        ("charlm", 10.6e6, 11.0e6),
        ("gpt_85m", 84e6, 87e6),
        ("gpt_large", 100e6, 130e6),
        ("gpt2_small", 85e6, 87e6),
        ("resnet20", 0.26e6, 0.29e6),
    ],
)
def test_config_model_sizes(task: str, low: float, high: float) -> None:
    assert low <= params_of(task) <= high


def test_output_head_is_the_token_embedding() -> None:
    model = GPT(layers=1, dim=32, heads=2, context=16)
    assert model.head.weight is model.tokens.weight


def test_a_gpt_without_biases_has_none_and_computes_what_its_weights_say() -> None:
    torch.manual_seed(0)
    biased = GPT(layers=2, dim=32, heads=2, context=16)
    plain = GPT(layers=2, dim=32, heads=2, context=16, bias=False)
    assert not [n for n, _ in plain.named_parameters() if n.endswith("bias")]
    # Every bias of the biased model is zero at init: with the same weights, the same logits.
    names = dict(plain.named_parameters())
    assert {n for n, _ in biased.named_parameters() if not n.endswith("bias")} == set(names)
    with torch.no_grad():
        for name, param in biased.named_parameters():
            if name in names:
                names[name].copy_(param)
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(plain(idx), biased(idx))


def test_stdlib_split_is_by_file_disjoint_and_deterministic() -> None:
    train, held_out = stdlib_files("train"), stdlib_files("eval")
    assert train and held_out
    assert not set(train) & set(held_out)
    assert len(held_out) < len(train) / 5
    assert stdlib_files("train") == train
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in train + held_out)


def test_stdlib_text_concatenates_whole_files_of_its_split_only(tmp_path: Path) -> None:
    fake_library(tmp_path, 60)
    train, held_out = stdlib_files("train", str(tmp_path)), stdlib_files("eval", str(tmp_path))
    assert len(train) + len(held_out) == 60  # site-packages is not part of the corpus
    expected = b"".join(p.read_bytes() + b"\n\n" for p in held_out)
    data = stdlib_text("eval", context=8, max_bytes=10**9, root=str(tmp_path))
    assert bytes(data.tokens.tolist()) == expected
    capped = stdlib_text("train", context=8, max_bytes=100, root=str(tmp_path))
    assert capped.tokens.numel() == 100


def test_token_windows_are_shifted_pairs_and_deterministic() -> None:
    data = synthetic_tokens(samples=10, context=16, seed=3)
    assert len(data) == 10
    indices = torch.tensor([0, 7, 9])
    inputs, targets = data.get_batch(indices)
    assert inputs.shape == targets.shape == (3, 16) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs[1], data.tokens[7 * 16 : 8 * 16].long())
    again = synthetic_tokens(samples=10, context=16, seed=3).get_batch(indices)
    assert torch.equal(again[0], inputs)
    assert not torch.equal(synthetic_tokens(samples=10, context=16, seed=4).get_batch(indices)[0], inputs)


def test_synthetic_images_are_deterministic() -> None:
    a, b = synthetic_images(20, seed=1), synthetic_images(20, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.fields, b.fields, strict=True))
    images, labels = a.get_batch(torch.arange(4))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8
    assert int(labels.max()) < 10
    assert ResNet20()(images).shape == (4, 10)


def test_gpt_learns_the_stdlib_on_cpu() -> None:
    torch.manual_seed(0)
    model = GPT(layers=1, dim=64, heads=2, context=32)
    data = stdlib_text("eval", context=32, max_bytes=50_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        loss = next_token_loss(model, data.get_batch(torch.randint(len(data), (16,), generator=generator)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    sums = next_token_sums(model, data.get_batch(torch.arange(4)))
    assert set(sums) == {"loss", "accuracy"}
    assert 0 <= float(sums["accuracy"]) <= 4


def test_warmup_cosine_rises_linearly_then_decays_to_its_floor():
    from flodl.tasks.schedules import warmup_cosine

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = warmup_cosine(optimizer, warmup_steps=4, total_steps=14, final_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lrs[14:] == pytest.approx([0.1] * 6)
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine(optimizer, warmup_steps=5, total_steps=5)


def test_digits_are_scikit_learn_s_split_as_before() -> None:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(labels) * TEST_FRACTION)
    for split, chosen in (("test", order[:n_test]), ("train", order[n_test:])):
        data = digits_dataset(split)
        assert torch.equal(data.fields[0], torch.as_tensor(images, dtype=torch.float32)[chosen] / 16.0)
        assert torch.equal(data.fields[1], torch.as_tensor(labels)[chosen])
