"""Dynamic loss scaling for fp16 training (framework neutral).

The loss is multiplied by :attr:`LossScaler.scale` before backward; gradients are
divided by it before the optimizer step. A step whose gradients hold inf/NaN on
any rank is skipped and the scale shrinks; after ``window`` clean steps it grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    """DeepSpeed/Megatron-style dynamic loss scaler (``dynamic=False``: a constant scale)."""

    #: Starting scale is ``2 ** initial_scale_power``.
    initial_scale_power: int = 16
    #: Clean steps before the scale doubles.
    window: int = 1000
    #: Overflowing steps tolerated before the scale halves.
    hysteresis: int = 2
    #: The scale never drops below this.
    min_scale: float = 1.0
    #: When False the scale stays at ``static_scale``.
    dynamic: bool = True
    static_scale: float = 1.0
    scale: float = field(init=False)
    skipped_steps: int = field(init=False, default=0)
    _clean: int = field(init=False, default=0, repr=False)
    _hysteresis_left: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"loss scale window must be >= 1, got {self.window}")
        if self.hysteresis < 1:
            raise ConfigError(f"loss scale hysteresis must be >= 1, got {self.hysteresis}")
        if self.min_scale <= 0 or self.static_scale <= 0:
            raise ConfigError("loss scales must be positive")
        self.scale = float(2 ** self.initial_scale_power) if self.dynamic else float(self.static_scale)
        self._hysteresis_left = self.hysteresis

    def update(self, found_overflow: bool) -> bool:
        """Record one step; return True when the optimizer step should be applied."""
        if not self.dynamic:
            if found_overflow:
                self.skipped_steps += 1
            return not found_overflow
        if found_overflow:
            self.skipped_steps += 1
            self._clean = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return False
        self._clean += 1
        if self._clean >= self.window:
            self.scale *= 2.0
            self._clean = 0
            self._hysteresis_left = self.hysteresis
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "clean": self._clean,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])
        self._clean = int(state["clean"])
        self._hysteresis_left = int(state["hysteresis_left"])
