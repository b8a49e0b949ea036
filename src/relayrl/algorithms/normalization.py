"""Statistics for normalising advantages and other signals: across ranks, and over a stream.

``global_normalize`` standardises one batch of advantages with the mean and std of every valid entry
on every data-parallel rank, so all ranks scale their gradients alike. ``Welford`` keeps running
statistics over many batches, for example of returns or observations.
"""

import torch
import torch.distributed as dist
from torch import Tensor


def global_normalize(
    x: Tensor, mask: Tensor, *, group: dist.ProcessGroup | None = None, eps: float = 1e-8
) -> Tensor:
    """Standardise ``x`` to zero mean and unit std over the valid entries of all ranks.

    x_hat = (x - mean) / (std + eps),   mean = S1 / n,   std = sqrt(max(S2 / n - mean^2, 0))

    where S1, S2 and n are the sum, the sum of squares and the count of valid entries, summed over
    the ranks of ``group`` by ONE all-reduce of a 3-element tensor when torch.distributed is
    initialised, and over the local batch otherwise. As in AcceRL (arXiv:2603.18464), which
    normalises advantages over the whole super-batch rather than per micro-batch. std is the
    population std (divide by n); the sums are taken in float64 so that S2 / n - mean^2 does not
    cancel badly. The statistics are constants: advantages carry no gradient.

    Every rank must call this together (it is a collective); a rank with no valid entries still
    contributes (0, 0, 0).

    Args:
        x: any shape, float; the values to normalise.
        mask: same shape as x, bool or 0/1; true on entries that count.
        group: process group to reduce over; None means the default group when torch.distributed
            is initialised. Passing a group without an initialised torch.distributed is an error.
        eps: added to the std, > 0, so constant inputs give 0 rather than nan.

    Returns:
        Normalised x, same shape and dtype; 0 where mask is false or nothing is valid anywhere.
    """
    if mask.shape != x.shape:
        raise ValueError(
            f"x and mask must share one shape, got {tuple(x.shape)} and {tuple(mask.shape)}"
        )
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got eps={eps}")
    distributed = dist.is_available() and dist.is_initialized()
    if group is not None and not distributed:
        raise ValueError(f"group={group} was given, but torch.distributed is not initialised")
    mask = mask.bool()
    with torch.no_grad():
        valid = torch.where(mask, x.detach(), 0.0).to(torch.float64)
        stats = torch.stack([valid.sum(), valid.square().sum(), mask.sum().to(torch.float64)])
        if distributed:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        total, total_sq, count = stats.unbind()
        mean = total / count.clamp(min=1.0)
        std = (total_sq / count.clamp(min=1.0) - mean.square()).clamp(min=0.0).sqrt()
    normalized = (x - mean.to(x.dtype)) / (std.to(x.dtype) + eps)
    return torch.where(mask, normalized, 0.0)


class Welford:
    """Running mean and population variance of a stream of batches, mergeable across workers.

    Each batch is folded in with the parallel update of Chan, Golub and LeVeque (1979), the batch
    form of Welford's (1962) algorithm: for counts n_a, n_b, means m_a, m_b and sums of squared
    deviations M2_a, M2_b, with delta = m_b - m_a and n = n_a + n_b,

        mean = m_a + delta * n_b / n,   M2 = M2_a + M2_b + delta^2 * n_a * n_b / n,   var = M2 / n

    which stays accurate where the naive E[x^2] - E[x]^2 cancels. Statistics are per element of
    ``shape`` (``()`` for one scalar stream) and kept in float64 on the CPU.
    """

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        self.shape = tuple(shape)
        self._count = 0
        self._mean = torch.zeros(self.shape, dtype=torch.float64)
        self._m2 = torch.zeros(self.shape, dtype=torch.float64)

    def update(self, x: Tensor) -> None:
        """Add every sample of ``x`` [..., *shape]: each index of the leading dims is one sample."""
        if tuple(x.shape[max(x.dim() - len(self.shape), 0) :]) != self.shape:
            raise ValueError(
                f"x must have shape [..., {', '.join(map(str, self.shape))}] to match "
                f"shape={self.shape}, got {tuple(x.shape)}"
            )
        samples = x.detach().to("cpu", torch.float64).reshape(-1, *self.shape)
        if samples.shape[0] == 0:
            return
        mean = samples.mean(dim=0)
        self._combine(samples.shape[0], mean, (samples - mean).square().sum(dim=0))

    def merge(self, other: "Welford") -> None:
        """Fold in ``other``'s statistics, as if its samples had been passed to ``update``."""
        if other.shape != self.shape:
            raise ValueError(f"cannot merge a Welford of shape {other.shape} into {self.shape}")
        self._combine(other._count, other._mean, other._m2)

    @property
    def count(self) -> int:
        """Number of samples seen."""
        return self._count

    @property
    def mean(self) -> Tensor:
        """Mean of the samples seen, float64 [*shape]; 0 before the first sample."""
        return self._mean.clone()

    @property
    def var(self) -> Tensor:
        """Population variance (divide by count), float64 [*shape]; 0 before the first sample."""
        return self._m2 / max(self._count, 1)

    @property
    def std(self) -> Tensor:
        """Population standard deviation, float64 [*shape]."""
        return self.var.sqrt()

    def state_dict(self) -> dict[str, object]:
        """The statistics, for a checkpoint."""
        return {"count": self._count, "mean": self._mean.clone(), "m2": self._m2.clone()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore statistics written by ``state_dict``."""
        mean = torch.as_tensor(state["mean"], dtype=torch.float64)
        if tuple(mean.shape) != self.shape:
            raise ValueError(f"state has shape {tuple(mean.shape)}, this Welford {self.shape}")
        self._count = int(state["count"])
        self._mean = mean.clone()
        self._m2 = torch.as_tensor(state["m2"], dtype=torch.float64).clone()

    def _combine(self, count: int, mean: Tensor, m2: Tensor) -> None:
        if count == 0:
            return
        total = self._count + count
        delta = mean - self._mean
        self._mean = self._mean + delta * (count / total)
        self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
        self._count = total
