"""Learning-rate schedules: the rate of step k (1-based) as a pure function of k.

A resumed run needs nothing but its step count to continue the schedule, and
every rank of a multi-process run computes the same rate.

  constant     the base rate at every step (the default).
  warmup_poly  the schedule of facebookresearch/dlrm's LRPolicyScheduler, which
               the MLPerf DLRM and DLRM-DCNv2 references train with: the rate
               rises linearly, base * k / W for k < W (warmup_steps W); stays
               at base; from step D (decay_start_step) it decays as
               base * ((N - (k - D)) / N) ** power over N steps (decay_steps),
               never below min_lr; after the decay it keeps its last value.
               The reference's defaults: power 2, min_lr 1e-7. (Between warmup
               and decay the reference holds the last warmup rate,
               base * (W - 1) / W, a quirk not reproduced here.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    base: float
    kind: str = "constant"
    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0
    power: float = 2.0
    min_lr: float = 1e-7

    @classmethod
    def from_config(cls, opt, total_steps: int) -> "LRSchedule":
        """optimizer config -> schedule; an unset decay start is the end of the
        warmup, an unset decay length runs the decay to the run's last step."""
        start = opt.warmup_steps if opt.decay_start_step is None else opt.decay_start_step
        steps = max(total_steps - start + 1, 0) if opt.decay_steps is None else opt.decay_steps
        return cls(opt.lr, opt.schedule, opt.warmup_steps, start, steps, opt.decay_power, opt.min_lr)

    def lr(self, step: int) -> float:
        """The rate of the step-th update (step = 1 for the first)."""
        if self.kind == "constant":
            return self.base
        if step < self.warmup_steps:
            return self.base * step / self.warmup_steps
        if self.decay_steps > 0 and step >= self.decay_start:
            done = min(step - self.decay_start, self.decay_steps - 1)
            return max(self.min_lr, self.base * ((self.decay_steps - done) / self.decay_steps) ** self.power)
        return self.base
