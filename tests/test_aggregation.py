from __future__ import annotations

import pytest
import torch

from shared.errors import EstuaryError
from shared.methods.aggregation import fedavg, normalize, weighted_average


def test_fedavg_hand_computed() -> None:
    s0 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    s1 = {"w": torch.tensor([4.0, 8.0]), "b": torch.tensor(0.0)}
    out = fedavg([s0, s1], [1, 2])  # (1*s0 + 2*s1) / 3
    assert torch.allclose(out["w"], torch.tensor([3.0, 6.0]))
    assert torch.allclose(out["b"], torch.tensor(1.0))


def test_weights_sum_to_one_and_dtype_kept() -> None:
    assert normalize([2, 6]) == [0.25, 0.75]
    s = {"h": torch.ones(2, dtype=torch.float16)}
    out = weighted_average([s, s], [0.3, 0.7])
    assert out["h"].dtype == torch.float16
    assert torch.equal(out["h"], s["h"])


def test_integer_buffers_are_not_averaged() -> None:
    out = fedavg([{"n": torch.tensor(5)}, {"n": torch.tensor(9)}], [1, 1])
    assert out["n"].item() == 5


def test_errors() -> None:
    with pytest.raises(EstuaryError):
        fedavg([], [])
    with pytest.raises(EstuaryError):
        fedavg([{"a": torch.zeros(1)}], [0])
    with pytest.raises(EstuaryError):
        weighted_average([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], [1, 1])
    with pytest.raises(EstuaryError):
        normalize([1, -1])


def test_a_mean_of_one_float32_state_says_it_is_that_state() -> None:
    """:meth:`WeightedSum.mean_is_first` (what lets the cloud serve one edge's bytes as the
    global) holds for one float32 state, whose mean is then its copy bit for bit, and not
    for two states, a float64 state or a zero weight."""
    from shared.methods.aggregation import MeanFold, WeightedSum
    from shared.methods.api import Update

    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(1000, generator=g) * 1e3, "n": torch.tensor(7)}
    one = WeightedSum()
    one.add(x, 37.0)
    assert one.mean_is_first()
    mean = one.mean()
    assert torch.equal(mean["w"], x["w"]) and mean["n"].item() == 7
    two = WeightedSum()
    two.add(x, 1.0)
    two.add(x, 3.0)
    assert not two.mean_is_first()
    wide = WeightedSum()
    wide.add({"w": x["w"].double()}, 1.0)
    assert not wide.mean_is_first()
    zero = WeightedSum()
    zero.add(x, 0.0)
    assert not zero.mean_is_first()
    fold = MeanFold()
    fold.add(Update("edge0", x, 5, (5,) + (0,) * 9))
    assert fold.exact_source() == "edge0"
    fold.add(Update("edge1", x, 5, (5,) + (0,) * 9))
    assert fold.exact_source() is None


def test_the_numpy_fold_gives_the_bits_of_the_torch_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    # WeightedSum folds, materializes and divides float32/float64 states with NumPy; the
    # torch code (kept for other dtypes) is the reference: the same operations in the same
    # order, so the same bits, over several chunks and a short last one
    from shared.methods import aggregation

    n = 3 * aggregation.FOLD_CHUNK + 11
    gen = torch.Generator().manual_seed(0)
    states = [
        {"w": torch.randn(n, generator=gen) * 10**k, "d": torch.randn(5, generator=gen).double()}
        for k in range(4)
    ]
    weights = [3.0, 0.25, 7.5, 1e-3]

    def mean() -> dict[str, torch.Tensor]:
        s = aggregation.WeightedSum()
        for state, w in zip(states, weights, strict=True):
            s.add(state, w)
        out = s.mean()
        s.recycle()
        return out

    fast = mean()
    monkeypatch.setattr(aggregation, "_numpy_arrays", lambda *a: None)
    monkeypatch.setattr(aggregation, "np", None)  # no NumPy call left anywhere
    reference = mean()
    for k in fast:
        assert fast[k].dtype == reference[k].dtype and torch.equal(fast[k], reference[k]), k
