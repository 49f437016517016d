"""Where the run is in the prompt stream: epoch by epoch, reshuffled each epoch, a prompt at most
once per step.

Each epoch serves every prompt once, in the epoch's order. When a step's prompts run past the
end of an epoch, the step is completed from the next epoch's order without the prompts it already
holds: such a prompt is deferred (its turn in the new epoch passed while it was in this step) and
served first in the next step, still within the new epoch. So a step never holds a prompt twice
(the engine refuses a request that appears twice in one rollout) and each epoch still serves every
prompt exactly once. The state (epoch, position, deferred) makes a resume continue the very same
stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class DataCursor:
    num_prompts: int
    seed: int
    shuffle: bool
    epoch: int = 0
    position: int = 0  # next index into order(epoch)
    # prompts of the current epoch whose turn came while the step already held them
    deferred: list[int] = field(default_factory=list)

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of the prompt indices 0..num_prompts-1 (same on every rank)."""
        idx = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def check(self, n: int) -> None:
        """Steps of `n` prompts can be served without repeats (checked at set-up)."""
        if n > self.num_prompts:
            raise ValueError(f"trainer.prompts_per_step={n} is more than the {self.num_prompts} "
                             "prompts of the data set, so a step would repeat a prompt; set "
                             f"trainer.prompts_per_step <= {self.num_prompts} or add prompts")

    def next(self, n: int) -> list[int]:
        """The next `n` prompt indices, all different."""
        self.check(n)
        # deferred prompts come first: the step is empty, so none of them is in it; with
        # n <= num_prompts a step scans at most one epoch boundary, so none stays behind
        out, held = list(self.deferred), set(self.deferred)
        self.deferred = []
        order = self.order(self.epoch)
        while len(out) < n:
            if self.position >= self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
                order = self.order(self.epoch)
            idx = order[self.position]
            self.position += 1
            if idx in held:
                self.deferred.append(idx)
            else:
                out.append(idx)
                held.add(idx)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "deferred": list(self.deferred)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.deferred = list(state.get("deferred", []))  # checkpoints before deferral had none
