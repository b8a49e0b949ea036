import math
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import on_ranks

from relayrl.algorithms.normalization import Welford, global_normalize


def close(actual, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=0.0)


def test_global_normalize_by_hand_ignores_padding():
    # valid [1, 2, 3, 6]: mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5, std 1.870829
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 6.0, math.nan]])
    mask = torch.tensor([[True, True, False], [True, True, False]])

    out = global_normalize(x, mask)

    std = math.sqrt(3.5)
    close(out, [[-2 / std, -1 / std, 0.0], [0.0, 3 / std, 0.0]])
    assert out.dtype == x.dtype


def test_global_normalize_constant_and_empty_inputs_give_zeros():
    close(global_normalize(torch.full((2, 2), 5.0), torch.ones(2, 2)), [[0.0, 0.0], [0.0, 0.0]])
    close(global_normalize(torch.randn(2, 2), torch.zeros(2, 2)), [[0.0, 0.0], [0.0, 0.0]])


def test_global_normalize_gradient_treats_the_statistics_as_constants():
    x = torch.tensor([1.0, 3.0], requires_grad=True)  # mean 2, std 1
    global_normalize(x, torch.ones(2), eps=1e-8).sum().backward()
    close(x.grad, [1.0, 1.0])


def test_global_normalize_rejects_bad_input():
    with pytest.raises(ValueError, match="share one shape"):
        global_normalize(torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="eps=0"):
        global_normalize(torch.zeros(2), torch.ones(2), eps=0)
    with pytest.raises(ValueError, match="not initialised"):
        global_normalize(torch.zeros(2), torch.ones(2), group=object())


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different sizes and masks per rank, so a per-rank normalisation would differ."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(rank + 2, 5, generator=generator) * (rank + 1) + 3 * rank
    mask = torch.rand(rank + 2, 5, generator=generator) < 0.7
    return x, mask


def normalize_on_rank(rank: int, world_size: int, store_path: str) -> dict:
    """This rank's normalised data and the sizes of the all-reduces it took."""
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        x, mask = rank_data(rank)
        return {"out": global_normalize(x, mask), "calls": calls}
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()


def test_global_normalize_over_two_gloo_ranks_equals_normalising_the_concatenation(
    ray_session, tmp_path
):
    world_size = 2
    results = on_ranks(normalize_on_rank, str(tmp_path / "store"), world=world_size)

    data = [rank_data(rank) for rank in range(world_size)]
    flat_x = torch.cat([x.flatten() for x, _ in data])
    flat_mask = torch.cat([mask.flatten() for _, mask in data])
    expected = global_normalize(flat_x, flat_mask).split([x.numel() for x, _ in data])
    valid = flat_x[flat_mask]
    # the local reference itself is the textbook formula
    torch.testing.assert_close(
        torch.cat(expected)[flat_mask], (valid - valid.mean()) / (valid.std(correction=0) + 1e-8)
    )
    for rank, (x, _) in enumerate(data):
        torch.testing.assert_close(results[rank]["out"], expected[rank].reshape(x.shape))
        assert results[rank]["calls"] == [3]  # one all-reduce of (sum, sum of squares, count)


def random_batches(shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [1, 0, 7, 64, 3, 200]
    return [rng.normal(5.0, 3.0, size=(n, *shape)) for n in sizes]


@pytest.mark.parametrize("shape", [(), (3,)])
def test_welford_matches_numpy(shape):
    batches = random_batches(shape, seed=0)
    stats = Welford(shape)
    for batch in batches:
        stats.update(torch.from_numpy(batch).float())

    everything = np.concatenate([b.astype(np.float32) for b in batches]).astype(np.float64)
    assert stats.count == everything.shape[0]
    np.testing.assert_allclose(stats.mean.numpy(), everything.mean(axis=0), rtol=1e-10)
    np.testing.assert_allclose(stats.var.numpy(), everything.var(axis=0), rtol=1e-10)
    np.testing.assert_allclose(stats.std.numpy(), everything.std(axis=0), rtol=1e-10)


def test_welford_scalar_stream_takes_every_entry_as_a_sample():
    stats = Welford()
    stats.update(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    assert stats.count == 4
    assert stats.mean.item() == pytest.approx(3.0)
    assert stats.var.item() == pytest.approx(3.5)


def test_welford_merge_matches_one_pass_over_all_samples():
    batches = random_batches((3,), seed=1)
    one_pass, left, right = Welford((3,)), Welford((3,)), Welford((3,))
    for i, batch in enumerate(batches):
        one_pass.update(torch.from_numpy(batch))
        (left if i % 2 else right).update(torch.from_numpy(batch))

    left.merge(right)
    left.merge(Welford((3,)))  # merging nothing changes nothing

    assert left.count == one_pass.count
    torch.testing.assert_close(left.mean, one_pass.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(left.var, one_pass.var, rtol=1e-12, atol=1e-12)

    empty = Welford((3,))
    empty.merge(one_pass)
    torch.testing.assert_close(empty.var, one_pass.var, rtol=0, atol=0)


def test_welford_stays_accurate_far_from_zero():
    # E[x^2] - E[x]^2 would lose every digit here even in float64.
    x = torch.tensor([1e9 + 1, 1e9 + 2, 1e9 + 3], dtype=torch.float64)
    stats = Welford()
    for value in x:
        stats.update(value)
    assert stats.var.item() == pytest.approx(2 / 3, rel=1e-9)


def test_welford_empty_and_state_dict_round_trip():
    stats = Welford((2,))
    assert stats.count == 0
    close(stats.mean.float(), [0.0, 0.0])
    close(stats.var.float(), [0.0, 0.0])

    stats.update(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    restored = Welford((2,))
    restored.load_state_dict(stats.state_dict())
    restored.update(torch.tensor([[5.0, 6.0]]))
    stats.update(torch.tensor([[5.0, 6.0]]))
    assert restored.count == 3
    torch.testing.assert_close(restored.mean, stats.mean)
    torch.testing.assert_close(restored.var, stats.var)


def test_welford_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 3\]"):
        Welford((3,)).update(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="cannot merge"):
        Welford((3,)).merge(Welford())
    with pytest.raises(ValueError, match="state has shape"):
        Welford((3,)).load_state_dict(Welford((2,)).state_dict())
