"""Acceptance statistics of speculative decoding, per request and summed over an engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts over verify rounds.

    num_rounds: verify steps; num_draft_tokens: drafts proposed; num_accepted_tokens: drafts
    accepted; accepted_per_position[j]: rounds whose draft j+1 was accepted;
    drafted_per_position[j]: rounds that proposed a draft j+1.
    """

    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"num_accepted={num_accepted} must be in [0, num_drafts={num_drafts}]")
        self.num_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def merge(self, other: "SpecStats") -> None:
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        grow = len(other.drafted_per_position) - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j, (d, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            self.drafted_per_position[j] += d
            self.accepted_per_position[j] += a

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens emitted per verify round (accepted drafts + the bonus token)."""
        return None if not self.num_rounds else 1.0 + self.num_accepted_tokens / self.num_rounds

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over proposed drafts."""
        return None if not self.num_draft_tokens else self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_rates(self) -> list[float]:
        """Fraction of rounds that proposed draft j+1 in which it was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def summary(self) -> str:
        if not self.num_rounds:
            return "no verify rounds"
        rates = " / ".join(f"{r:.2f}" for r in self.per_position_rates)
        return (f"{self.num_rounds} rounds, acceptance length {self.acceptance_length:.2f}, "
                f"acceptance rate {self.acceptance_rate or 0.0:.2f}, per position {rates}")
