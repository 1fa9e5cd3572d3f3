"""Lease timing is checked where it is built: no LeaseTiming breaks its invariant."""

from __future__ import annotations

import dataclasses

import pytest

from jobrun.exitcodes import UsageError
from jobrun.locks.lease import LeaseTiming, safety_margin, timing


class TestLeaseTiming:
    """TTL, kill-after, heartbeat and margin, validated in one constructor."""

    def test_derived_heartbeat_and_lifetime(self):
        """30s TTL, 10s kill-after: lifetime 30 - 10 - 3 = 17s, heartbeat a third of it."""
        checked = LeaseTiming.from_options(ttl=30, kill_after=10, heartbeat=None)
        assert checked.lifetime == 30 - 10 - safety_margin(30)
        assert checked.heartbeat == pytest.approx(checked.lifetime / 3)
        assert timing(30, 10, None) == (checked.heartbeat, checked.lifetime)

    @pytest.mark.parametrize(
        ("ttl", "kill_after", "heartbeat"),
        [(0, 1, None), (5, 10, None), (30, 10, 9), (10, 2, 4)],
    )
    def test_invalid_combinations_are_refused(self, ttl, kill_after, heartbeat):
        """The child could outlive the lease: a usage error that says what to change."""
        with pytest.raises(UsageError, match="--ttl"):
            LeaseTiming.from_options(ttl=ttl, kill_after=kill_after, heartbeat=heartbeat)

    def test_direct_construction_is_checked_too(self):
        """Not only from_options: the dataclass itself refuses a heartbeat that cannot fit."""
        valid = LeaseTiming.from_options(ttl=30, kill_after=10, heartbeat=None)
        with pytest.raises(UsageError):
            dataclasses.replace(valid, heartbeat=20.0)

    def test_frozen(self):
        """A checked timing cannot be changed afterwards."""
        valid = LeaseTiming.from_options(ttl=30, kill_after=10, heartbeat=None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            valid.heartbeat = 100.0  # type: ignore[misc]
