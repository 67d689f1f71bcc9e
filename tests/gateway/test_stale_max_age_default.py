"""The default age after which held-back stale groups are dropped (issue 36's chaos leftovers).

At 600 s, a trainer outage filled the admission budget for up to ten minutes: the trainer came back, stepped
twice, and every group generated before was held back as too stale (staleness bound 1) while still counted
against the budget ("staleness budget full (62 of 16 sessions admitted)", 0 ready, 0 open): agents got 429s
until the held groups were dropped. A held group can only be leased again if a trainer registers a larger
staleness bound (the trainer never registers a lower version: it continues above the gateway's), so holding
it long only blocks admission. The default is 60 s, the same in the gateway's flags and in the lifecycle's
own settings (which read the flag by name, and their own default otherwise)."""

from __future__ import annotations

from agentrl.settings import load
from gateway.lifecycle.settings import ExportSettings
from gateway.settings import GatewaySettings


def test_held_stale_groups_are_dropped_after_a_minute_by_default() -> None:
    flags = load(GatewaySettings, env={}, engine_url="http://127.0.0.1:9", admin_key="k")
    assert flags.stale_max_age_s == 60.0
    assert ExportSettings().stale_max_age_s == 60.0
    assert ExportSettings.from_settings(flags, environ={}).stale_max_age_s == 60.0
    # an operator's value still wins
    assert ExportSettings.from_settings(object(), environ={"AGENTRL_GATEWAY_STALE_MAX_AGE_S": "600"}).stale_max_age_s == 600.0
