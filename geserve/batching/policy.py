"""Scheduling rules of one model version, read once from its config."""

from __future__ import annotations

from dataclasses import dataclass, field

from geserve._generated import model_config_pb2 as mc
from geserve.repository import ragged


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One priority level's queue rules (ModelQueuePolicy)."""

    max_queue_size: int = 0  # 0: unbounded
    default_timeout_ns: int = 0  # 0: no timeout
    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)
    allow_timeout_override: bool = False

    @classmethod
    def from_config(cls, policy: mc.ModelQueuePolicy) -> QueuePolicy:
        return cls(
            max_queue_size=policy.max_queue_size,
            default_timeout_ns=policy.default_timeout_microseconds * 1000,
            delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
            allow_timeout_override=policy.allow_timeout_override,
        )

    def timeout_ns(self, requested_us: int | None) -> int:
        """The timeout a request gets: the default, lowered by the request where that is allowed."""
        if requested_us is None or not self.allow_timeout_override or requested_us <= 0:
            return self.default_timeout_ns
        requested_ns = requested_us * 1000
        return min(requested_ns, self.default_timeout_ns) if self.default_timeout_ns else requested_ns


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    """How requests become batches: merged by the dynamic batcher, or run one by one."""

    dynamic: bool = False
    max_batch_size: int = 0  # rows per batch; 0: the model has no batch dimension
    preferred_sizes: tuple[int, ...] = ()
    max_delay_ns: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 1
    default_priority: int = 1
    queue_policies: tuple[QueuePolicy, ...] = field(default_factory=lambda: (QueuePolicy(),))
    # Inputs whose dims may differ within a batch (allow_ragged_batch; loads only where the backend takes them).
    ragged_inputs: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> BatchingPolicy:
        if not config.HasField("dynamic_batching"):
            return cls(max_batch_size=config.max_batch_size)
        batching = config.dynamic_batching
        levels = max(int(batching.priority_levels), 1)
        default_level = int(batching.default_priority_level) or 1
        default_policy = QueuePolicy.from_config(batching.default_queue_policy)
        policies = tuple(
            QueuePolicy.from_config(batching.priority_queue_policy[level])
            if level in batching.priority_queue_policy
            else default_policy
            for level in range(1, levels + 1)
        )
        return cls(
            ragged_inputs=ragged.ragged_inputs(config),
            dynamic=config.max_batch_size > 0,
            max_batch_size=config.max_batch_size,
            preferred_sizes=tuple(sorted(set(batching.preferred_batch_size))),
            max_delay_ns=batching.max_queue_delay_microseconds * 1000,
            preserve_ordering=batching.preserve_ordering,
            priority_levels=levels,
            default_priority=min(max(default_level, 1), levels),
            queue_policies=policies,
        )

    def level(self, priority: int | None) -> int:
        """The priority level of a request: 0, absent or out of range means the default (1 = highest)."""
        if priority is None or priority < 1 or priority > self.priority_levels:
            return self.default_priority
        return priority
