"""Adaptive verification length: pick ``k`` (drafts to verify) that maximises expected tokens/s.

The draft's confidence head scores each drafted position; ``sigmoid(confidence[b, i])`` is read as
the probability that draft ``i`` is accepted given the ones before it were. With ``c`` those
probabilities, a row that verifies ``k`` drafts gains ``1 + sum_{i<=k} prod_{j<=i} c_j`` tokens in
expectation (the target always adds one). A round costs the verify step of ``k + 1`` tokens per
row plus the draft (``k = 0``: a plain decode step, no draft needed); costs come from a
:class:`CostCurve`, relative to a plain decode step at the same batch size. The chosen ``k``
maximises ``sum_b E_b(k) / cost(k)`` over ``0 .. K``.

On a multi-device model every rank scores the same confidence (the draft layers are replicated and
read the all-reduced hidden states), yet one rank choosing another ``k`` would feed verify chunks
of different lengths into the layers' collectives; :func:`agreed` makes rank 0's choice everyone's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt import distributed

# used where the device profile has no measured table: a verify step costs a plain step plus a
# share per extra token, the draft a fixed share of a plain step
DEFAULT_EXTRA_PER_TOKEN = 0.1
DEFAULT_DRAFT = 0.2


@dataclass(frozen=True)
class CostCurve:
    """Per batch size (``batches``, ascending): ``verify[i][k]`` the time of a verify step with ``k``
    drafts (``k + 1`` tokens per row; ``k = 0`` a plain decode step) and ``draft[i]`` the draft's
    time, both relative to a plain decode step at that batch size."""

    batches: tuple
    verify: tuple
    draft: tuple

    def __post_init__(self):
        if not self.batches or len(self.verify) != len(self.batches) or len(self.draft) != len(self.batches):
            raise ValueError(f"speculative costs: expected one verify row and one draft cost per batch size "
                             f"{list(self.batches)}, got {len(self.verify)} and {len(self.draft)}")
        if list(self.batches) != sorted(self.batches) or any(len(v) < 2 for v in self.verify):
            raise ValueError("speculative costs: batch sizes ascending, each verify row with k = 0 and k = 1 at least")

    def at(self, batch: int, block: int) -> tuple[list[float], float]:
        """(verify costs for ``k = 0 .. block``, draft cost) at the smallest tabled batch >= ``batch``
        (the largest past the table); a row shorter than ``block + 1`` is extended by its last step."""
        i = next((j for j, b in enumerate(self.batches) if b >= batch), len(self.batches) - 1)
        row = [float(c) for c in self.verify[i]][:block + 1]
        while len(row) < block + 1:
            row.append(row[-1] + (row[-1] - row[-2]))
        return row, float(self.draft[i])

    @classmethod
    def default(cls) -> "CostCurve":
        return cls((1,), (tuple(1.0 + DEFAULT_EXTRA_PER_TOKEN * k for k in range(2)),), (DEFAULT_DRAFT,))

    @classmethod
    def from_table(cls, table: dict) -> "CostCurve":
        """From a profile's ``speculative_costs`` mapping: ``{batch: {"verify": [...], "draft": x}}``."""
        items = sorted((int(b), v) for b, v in table.items())
        return cls(tuple(b for b, _ in items), tuple(tuple(v["verify"]) for _, v in items),
                   tuple(float(v["draft"]) for _, v in items))

    @classmethod
    def for_model(cls, model) -> "CostCurve":
        """The model's device profile's table (``speculative_costs``), else :meth:`default`."""
        table = getattr(getattr(model, "profile", None), "speculative_costs", None)
        return cls.from_table(table) if table else cls.default()


def expected_tokens(confidence: torch.Tensor) -> torch.Tensor:
    """fp32 [K + 1]: summed over rows of ``confidence`` [B, K], the expected tokens a round gains
    with ``k = 0 .. K`` drafts verified."""
    c = torch.sigmoid(confidence.to(torch.float32))
    reach = torch.cumprod(c, dim=1).sum(dim=0)  # [K]: expected rows accepting draft i
    return confidence.shape[0] + torch.cat([reach.new_zeros(1), torch.cumsum(reach, dim=0)])


def choose_k(confidence: torch.Tensor, costs: CostCurve, batch: int) -> int:
    """The ``k`` in ``0 .. K`` (``K = confidence.shape[1]``) with the most expected tokens per unit
    of cost (the smallest such ``k`` on a tie)."""
    K = confidence.shape[1]
    verify, draft = costs.at(batch, K)
    gain = expected_tokens(confidence).tolist()
    rate = [gain[k] / (verify[k] + (draft if k else 0.0)) for k in range(K + 1)]
    return max(range(K + 1), key=lambda k: (rate[k], -k))


def agreed(model, k: int) -> int:
    """``k`` as rank 0 chose it, on every rank of a multi-device model (one small broadcast per
    round); ``k`` itself on one device."""
    if model.parallel is None or distributed.world_size() == 1:
        return k
    box = torch.tensor([k], dtype=torch.long, device=distributed.collective_device())
    return int(distributed.broadcast(box, 0).item())
