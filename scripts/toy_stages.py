"""The toy training curriculum as it runs: which stage is on, and when a stage may run on."""

from __future__ import annotations

import logging

from toy_card import STAGE_GATE_EVERY, StageEnd

log = logging.getLogger("train_toy_model")


class StageWalker:
    """Walks the curriculum ({planned first step: task weights}) during training.

    A stage that teaches one question (see `focus_task`) is there to teach a skill the mix does
    not (see the model card), and whether it takes in its planned steps varies from run to run.
    So such a stage runs on past its planned end, `every` steps at a time and at most
    `max_extra` steps, until that question's held-out monitor accuracy reaches `gate`. Later
    stages start that much later and the run grows by as much (`delay`), so the last stage, the
    mix that brings every answer back, always gets its planned steps. Deterministic.
    """

    def __init__(
        self,
        stages: dict[int, dict[str, float]],
        gate: float,
        max_extra: int,
        every: int = STAGE_GATE_EVERY,
        stretch: float = 1.0,
    ) -> None:
        self.planned = sorted(stages.items())
        self.gate, self.max_extra, self.every = gate, max_extra, every
        self.stretch = stretch  # the last stage runs this many times its planned length
        self.index = -1  # the stage being trained
        self.extra = 0  # steps the current stage has run past its plan
        self.started: dict[int, dict[str, float]] = {}  # as run: {first step: task weights}
        self.ends: list[StageEnd] = []  # how each gated stage ended

    @property
    def delay(self) -> int:
        """Steps the stages have run past their plans so far."""
        return sum(end.extra_steps for end in self.ends) + self.extra

    @property
    def planned_start(self) -> int:
        """The planned first step of the stage being trained."""
        return self.planned[self.index][0]

    def planned_step(self, step: int) -> float:
        """Where `step` falls in the plan: a stage running on stays at its last planned step; the
        last stage, stretched, moves through its planned steps `stretch` times slower."""
        if self.extra:
            return self.planned[self.index + 1][0] - 1
        planned = step - self.delay
        last_start = self.planned[-1][0]
        if planned <= last_start:
            return planned
        return last_start + (planned - last_start) / self.stretch

    def next_mix(self, step: int, accuracy) -> dict[str, float] | None:
        """The task weights of a stage that starts at `step`, or None. `accuracy(task)` is the
        held-out monitor accuracy now; asked only at the end of a stage teaching one question."""
        following = self.index + 1
        # Every stage starts as late as the stages before it ran over their plans.
        if following >= len(self.planned) or step != self.planned[following][0] + self.delay:
            return None
        task = self.index >= 0 and focus_task(self.planned[self.index][1])
        if task and self.gate > 0:
            acc = accuracy(task)
            if acc < self.gate and self.extra < self.max_extra:
                log.info(
                    "step %d: %s held-out %.3f < %.2f, its stage runs on",
                    step,
                    task,
                    acc,
                    self.gate,
                )
                self.extra += self.every
                return None
            self.ends.append(StageEnd(task, step, self.extra, acc))
            log.info(
                "step %d: %s stage ends (held-out %.3f, %d steps over plan)",
                step,
                task,
                acc,
                self.extra,
            )
        self.index, self.extra = following, 0
        self.started[step] = self.planned[following][1]
        return self.started[step]


def focus_task(mix: dict[str, float]) -> str | None:
    """The question a stage is there to teach: the one it draws at least three times in four
    (a few other questions may keep their answers alive meanwhile), if any."""
    total = sum(mix.values())
    task, weight = max(mix.items(), key=lambda item: item[1])
    return task if weight >= 0.75 * total else None
