"""Aggregation maths over tensor dicts (no messaging), and the folds that feed it one update
at a time (:class:`HeldFold`, :class:`MeanFold`).

FedAvg (McMahan et al. 2017): theta = sum_k (n_k / sum n) theta_k. Aggregators fold each
update into a :class:`WeightedSum` as it arrives and drop it, so a role holds one running
sum, not every update. The sum is kept as an unevaluated pair (hi + lo, Knuth's TwoSum):
``hi`` a float64 tensor, ``lo`` the float32 sum of hi's rounding errors. Each product
``n_k * theta_k`` of a float32 tensor and an integer weight below 2**29 is exact in float64,
and the pair carries the sum to about 77 bits, so the mean rounded back to float32 is the
same whatever order the updates arrive in (two orders could differ only where the exact mean
lies within about 2**-70 of a float32 rounding boundary). 12 bytes per element.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shared.errors import EstuaryError
from shared.methods.api import Fold, Update
from shared.wire.codec import SERIAL_CHUNK, MappedViews, serial_copy

#: a model state (or any named tensors) as aggregation sees it
TensorDict = dict[str, torch.Tensor]


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights scaled to sum to one; all-zero or negative weights are an error."""
    if not weights:
        raise EstuaryError("cannot aggregate zero updates")
    if any(w < 0 for w in weights):
        raise EstuaryError(f"negative aggregation weight in {list(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise EstuaryError("aggregation weights sum to zero")
    return [float(w) / total for w in weights]


def weighted_average(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> TensorDict:
    """sum_k w_k * state_k / sum_k w_k, key by key; every state must have the same keys."""
    if len(states) != len(weights):
        raise EstuaryError(f"{len(states)} states but {len(weights)} weights")
    w = normalize(weights)
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys and set(s) != set(keys):
            raise EstuaryError("states to average have different tensor names")
    out: TensorDict = {}
    for k in keys:
        ref = states[0][k]
        if not ref.is_floating_point():
            out[k] = ref.clone()  # integer buffers (e.g. counters) are not averaged
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for wi, s in zip(w, states, strict=True):
            acc.add_(s[k].to(torch.float64), alpha=wi)
        out[k] = acc.to(ref.dtype)
    return out


def fedavg(states: Sequence[Mapping[str, torch.Tensor]], n_samples: Sequence[int]) -> TensorDict:
    """FedAvg: average weighted by local sample counts (a :class:`WeightedSum` of the
    states: the same result in any order, the result of the streaming aggregators)."""
    acc = WeightedSum()
    for i, (state, n) in enumerate(zip(states, n_samples, strict=True)):
        acc.add(state, float(n), key=f"{i:012d}")
    return acc.mean()


class WeightedSum:
    """``sum_k w_k * state_k`` (and the mean, divided by ``sum_k w_k``) folded one state at
    a time, independent of the order the states come in (see the module docstring).

    Floating-point tensors are summed; any other tensor (an integer counter) is taken from
    the state added with the smallest ``key`` (the first in sorted order, as a batch
    aggregation over sorted updates takes it). Holds 12 bytes per summed element, in two
    flat buffers (one allocation each: freed whole, they leave no fragments in the heap);
    the mean of each dtype is one flat buffer too."""

    def __init__(self) -> None:
        self._hi: TensorDict = {}
        self._lo: TensorDict = {}
        self._fixed: dict[str, tuple[str, torch.Tensor]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        #: the two buffers every summed tensor's hi and lo are views of, in ``_shapes`` order
        self._flat: tuple[torch.Tensor, torch.Tensor | None] | None = None
        #: the first state's summed tensors, weight and (views of a mapped blob) the call
        #: that gives a tensor's pages back, until a second state comes
        self._pending: (
            tuple[dict[str, torch.Tensor], float, Callable[[torch.Tensor], None] | None] | None
        ) = None
        self.total = 0.0
        self.count = 0

    def add(self, state: Mapping[str, torch.Tensor], weight: float, key: str = "") -> None:
        """Fold ``weight * state`` into the sum; every state must have the same names.

        The first state is only referenced until a second one comes (a sum of one state
        needs no buffers: its mean is the state): its tensors must not change until then."""
        if not math.isfinite(weight) or weight < 0:
            raise EstuaryError(f"aggregation weight {weight} is not a finite number >= 0")
        if self.count and set(state) != set(self._dtypes):
            raise EstuaryError("states to average have different tensor names")
        if self.count == 1 and self._pending is not None:
            self._materialize()
        summed: dict[str, torch.Tensor] = {}
        # views of a mapped blob give each tensor's pages back once it is folded in
        mapped = state.release if isinstance(state, MappedViews) else None
        release = mapped if self.count else None
        for k, t in state.items():
            if not t.is_floating_point():
                held = self._fixed.get(k)
                if held is None or key < held[0]:
                    self._fixed[k] = (key, t.detach().clone())
                self._dtypes.setdefault(k, t.dtype)
                continue
            if not self.count:
                self._dtypes[k], self._shapes[k] = t.dtype, tuple(t.shape)
                summed[k] = t.detach()
                continue
            if tuple(t.shape) != self._shapes.get(k):
                raise EstuaryError(
                    f"tensor {k!r}: shape {list(t.shape)}, expected {list(self._shapes[k])}"
                )
            _two_sum_into(self._hi[k], self._lo[k], t.detach().reshape(-1), weight)
            if release is not None:
                release(t)
        if not self.count:
            self._pending = (summed, weight, mapped)
        self.total += weight
        self.count += 1

    def _materialize(self) -> None:
        """The buffers, holding the first state times its weight (the referenced state is
        dropped)."""
        if self._pending is None:
            return
        first, weight, release = self._pending
        self._allocate()
        for k, t in first.items():
            hi, x = self._hi[k], t.reshape(-1)
            arrays = _numpy_arrays(hi, self._lo[k], x)
            if arrays is not None:  # NumPy: the same bits, on this thread
                np.multiply(arrays[2], weight, out=arrays[0], dtype=np.float64)
            else:
                for i in range(0, hi.numel(), SERIAL_CHUNK):  # on this thread (see SERIAL_CHUNK)
                    hi[i : i + SERIAL_CHUNK].copy_(x[i : i + SERIAL_CHUNK]).mul_(weight)
            if release is not None:
                release(t)
        self._pending = None

    def _allocate(self) -> None:
        """One float64 and one float32 buffer for every summed tensor, as flat views."""
        n = sum(math.prod(shape) for shape in self._shapes.values())
        with _SPARE_LOCK:
            spare = next((p for p in _SPARE if p[0].numel() == n), None)
            if spare is not None:
                _SPARE.remove(spare)
        if spare is not None:  # the last sum's buffers: no fresh pages to fault in
            hi, kept = spare
            lo = kept.zero_() if kept is not None else torch.zeros(n, dtype=torch.float32)
        else:
            hi = torch.empty(n, dtype=torch.float64)
            lo = torch.zeros(n, dtype=torch.float32)
        self._flat = (hi, lo)
        at = 0
        for k, shape in self._shapes.items():
            size = math.prod(shape)
            self._hi[k], self._lo[k] = hi[at : at + size], lo[at : at + size]
            at += size

    def sum(self) -> TensorDict:
        """``sum_k w_k * state_k`` in float64 (non-float tensors as taken)."""
        self._materialize()
        return {
            k: self._fixed[k][1]
            if k in self._fixed
            else (self._hi[k] + self._lo[k].double()).view(self._shapes[k])
            for k in self._dtypes
        }

    def mean_is_first(self) -> bool:
        """Whether :meth:`mean` is a copy of the one state added, bit for bit: one state of
        one float dtype no wider than float32 (see :meth:`mean`), with a positive weight."""
        dtypes = {self._dtypes[k] for k in self._shapes}
        return (
            self.count == 1
            and self._pending is not None
            and self.total > 0
            and len(dtypes) == 1
            and next(iter(dtypes)) in _NARROW
        )

    def mean(self, *, consume: bool = False) -> TensorDict:
        """The weighted mean, each tensor in its own dtype. With ``consume`` the sum is not
        used again (but recycled): a float32 mean is then written over the sum's float32
        half, which the mean keeps (no third buffer of the model's size at the peak)."""
        if not self.count:
            raise EstuaryError("cannot aggregate zero updates")
        if self.total <= 0:
            raise EstuaryError("aggregation weights sum to zero")
        out: TensorDict = {k: held for k, (_, held) in self._fixed.items()}
        dtypes = {self._dtypes[k] for k in self._shapes}
        if self.mean_is_first():
            # one state: its copy. (w * x) / w in float64 is within 2**-52 of x, which
            # rounds back to x in x's float32 (or narrower): the mean the buffers give
            assert self._pending is not None
            first = self._pending[0]
            flat = torch.empty(sum(math.prod(s) for s in self._shapes.values()), dtype=dtypes.pop())
            at = 0
            for k, shape in self._shapes.items():
                size = math.prod(shape)
                out[k] = serial_copy(flat[at : at + size], first[k].reshape(-1)).view(shape)
                at += size
            return {k: out[k] for k in self._dtypes}
        self._materialize()
        if len(dtypes) == 1 and self._flat is not None:  # the usual case: one flat result
            hi, lo = self._flat
            dtype = dtypes.pop()
            into = lo if consume and lo is not None and dtype == lo.dtype else None
            flat = self._mean_into(hi, lo, dtype, out=into)
            if into is not None:
                self._flat = (hi, None)  # the mean has it now: not recycled
                self._lo = {}
            at = 0
            for k, shape in self._shapes.items():
                size = math.prod(shape)
                out[k] = flat[at : at + size].view(shape)
                at += size
        else:
            for k, shape in self._shapes.items():
                out[k] = self._mean_into(self._hi[k], self._lo[k], self._dtypes[k]).view(shape)
        return {k: out[k] for k in self._dtypes}  # in the first state's order

    def recycle(self) -> None:
        """Hand this sum's buffers to the next sum of the same size (one pair is kept, the
        last one recycled: a role that aggregates every round reuses the same memory
        instead of faulting in fresh pages); the sum is empty afterwards."""
        if self._flat is not None:
            with _SPARE_LOCK:
                _SPARE[:] = [self._flat]
        self._flat, self._hi, self._lo, self._pending = None, {}, {}, None
        self._shapes, self._dtypes, self._fixed = {}, {}, {}
        self.total, self.count = 0.0, 0

    def _mean_into(
        self,
        hi: torch.Tensor,
        lo: torch.Tensor | None,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(hi + lo) / total`` as a flat tensor of ``dtype`` (a new one, or ``out``, which
        may be ``lo`` itself: each chunk is read before it is written), through one reused
        float64 buffer of :data:`MEAN_CHUNK` elements."""
        if lo is None:
            raise EstuaryError("this sum's buffers were consumed by its mean")
        out = torch.empty(hi.numel(), dtype=dtype) if out is None else out
        arrays = _numpy_arrays(hi, lo, out)
        if arrays is not None:  # the same operations by NumPy: the same bits, faster
            h, low, o = arrays
            buf = np.empty(min(MEAN_CHUNK, h.size))
            for i in range(0, h.size, MEAN_CHUNK):
                chunk = buf[: min(MEAN_CHUNK, h.size - i)]
                np.add(h[i : i + MEAN_CHUNK], low[i : i + MEAN_CHUNK], out=chunk)
                np.divide(chunk, self.total, out=chunk)
                o[i : i + MEAN_CHUNK] = chunk
            return out
        tmp = torch.empty(min(MEAN_CHUNK, hi.numel()), dtype=torch.float64)
        for i in range(0, hi.numel(), MEAN_CHUNK):
            n = min(MEAN_CHUNK, hi.numel() - i)
            part = tmp[:n]
            torch.add(hi[i : i + n], lo[i : i + n], out=part)
            out[i : i + n].copy_(part.div_(self.total))
        return out


#: dtypes whose values a float64 ``(w * x) / w`` rounds back to exactly
_NARROW = (torch.float32, torch.float16, torch.bfloat16)

#: the buffers of the last :meth:`WeightedSum.recycle`d sum (one pair at most)
_SPARE: list[tuple[torch.Tensor, torch.Tensor | None]] = []
_SPARE_LOCK = threading.Lock()

#: elements per step of :func:`_two_sum_into`: its temporaries stay in the CPU's cache
FOLD_CHUNK = 1 << 14
#: elements per step of :meth:`WeightedSum.mean`: on the calling thread alone, as every
#: step of a fold (:data:`~shared.wire.codec.SERIAL_CHUNK`)
MEAN_CHUNK = SERIAL_CHUNK


def _two_sum_into(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    """``hi + lo += weight * x`` (flat tensors), keeping ``hi + lo`` exact to ~77 bits:
    Knuth's TwoSum ``s = hi + p``, ``err = (hi - (s - bb)) + (p - bb)`` with ``bb = s - hi``,
    then ``hi = s`` and ``lo += err``; in chunks, so it costs what a plain float64 add does.
    A float32 or float64 ``x`` goes through NumPy (the same IEEE operations in the same
    order, so the same bits; about a third faster than torch's per-chunk calls)."""
    arrays = _numpy_arrays(hi, lo, x)
    if arrays is not None:
        _two_sum_numpy(*arrays, weight)
        return
    for i in range(0, hi.numel(), FOLD_CHUNK):
        h = hi[i : i + FOLD_CHUNK]
        p = x[i : i + FOLD_CHUNK].to(torch.float64).mul_(weight)
        s = h + p
        bb = s - h
        p.sub_(bb)  # p - bb
        bb.neg_().add_(s)  # s - bb
        h.sub_(bb).add_(p)  # the rounding error of s, written over this chunk of hi
        lo[i : i + FOLD_CHUNK].add_(h)
        h.copy_(s)


def _numpy_arrays(
    hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor
) -> tuple[Any, Any, Any] | None:
    """``hi`` (float64), ``lo`` (float32) and ``x`` (float32 or float64) as NumPy arrays of
    their memory, or None where one is of another dtype."""
    if (
        hi.dtype != torch.float64
        or lo.dtype != torch.float32
        or x.dtype not in (torch.float32, torch.float64)
    ):
        return None
    return hi.numpy(), lo.numpy(), x.detach().numpy()


def _two_sum_numpy(hi: Any, lo: Any, x: Any, weight: float) -> None:
    """:func:`_two_sum_into` on NumPy arrays, through three reused float64 buffers of
    :data:`FOLD_CHUNK` elements."""
    n = min(FOLD_CHUNK, hi.size)
    p_buf, s_buf, b_buf = np.empty(n), np.empty(n), np.empty(n)
    for i in range(0, hi.size, FOLD_CHUNK):
        h = hi[i : i + FOLD_CHUNK]
        m = h.size
        p, s, bb = p_buf[:m], s_buf[:m], b_buf[:m]
        np.multiply(x[i : i + FOLD_CHUNK], weight, out=p, dtype=np.float64)
        np.add(h, p, out=s)
        np.subtract(s, h, out=bb)
        np.subtract(p, bb, out=p)  # p - bb
        np.subtract(s, bb, out=bb)  # s - bb
        np.subtract(h, bb, out=h)
        np.add(h, p, out=h)  # the rounding error of s, written over this chunk of hi
        low = lo[i : i + FOLD_CHUNK]
        np.add(low, h, out=low, casting="same_kind")
        h[...] = s


# -- folds: an aggregation fed one update at a time ------------------------------------------
class HeldFold(Fold):
    """An aggregation that cannot stream: it holds every update and hands them, sorted by
    source (an order independent of arrival), to ``combine``."""

    streams = False

    def __init__(self, combine: Callable[[Sequence[Update]], TensorDict]) -> None:
        super().__init__()
        self.combine = combine
        self.updates: list[Update] = []

    def _add(self, update: Update) -> None:
        self.updates.append(update)

    def result(self) -> TensorDict:
        return self.combine(sorted(self.updates, key=lambda u: u.source))


class MeanFold(Fold):
    """FedAvg's aggregation streamed: the sample-weighted mean of the updates' tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.sum = WeightedSum()

    def _add(self, update: Update) -> None:
        self.sum.add(update.tensors, float(update.n_samples), key=update.source)

    def exact_source(self) -> str | None:
        """The one update's source when it is the only one: its mean is its copy."""
        return self.sources[0] if self.sum.mean_is_first() else None

    def result(self) -> TensorDict:
        out = self.sum.mean(consume=True)  # written over the sum's float32 half
        self.sum.recycle()  # its buffers serve the next round's sum
        return out


def fold_all(fold: Fold, updates: Sequence[Update]) -> TensorDict:
    """``fold`` fed every update of ``updates``: its result."""
    for u in updates:
        fold.add(u)
    return fold.result()
