"""One pool-wide fairness across active-active EPP replicas.

Each replica's flow controller orders tenants by the service they received (kvgate.epp.flow_control,
virtual token counters). Each replica sees only the requests that reach it, so without this a
tenant served heavily through replica A would still look idle to replica B. The engines already
announce every admission of a request a kvgate replica picked to all replicas
(kvgate.api.contracts.admissions); the picking replica adds the tenant (the
``x-gateway-inference-fairness-id`` header) and the service it charged at dispatch
(``x-kvgate-service-tokens``), and here every other replica counts that service as if it had
given it (`FlowController.note_remote_service`).

Only the charge made at dispatch travels: the correction a replica makes when a request ends
(its real output against the estimate) stays local. Announcements are not replayed, so one lost
while a replica restarts or reconnects is service it never counts (a tenant there is owed a
little more than its share until the counters, lifted to the backlogged floor, catch up).
"""

from __future__ import annotations

from typing import Protocol

from kvgate.api.contracts.admissions import Admission
from kvgate.epp.datastore import Datastore


class RemoteService(Protocol):
    def note_remote_service(self, tenant: str, tokens: float) -> None: ...


def share_service(controller: RemoteService, datastore: Datastore) -> None:
    """Count the service other replicas give (announced by the engines) in `controller`. The
    datastore delivers only other replicas' picks at endpoints it knows (its own were charged
    when it made them)."""

    def on_admission(address: str, admission: Admission) -> None:
        if admission.fairness_id is None or not admission.service_tokens > 0:
            return  # a plain announcement (an EPP that does not tell the service)
        if admission.picked_by == datastore.replica_id:
            return  # our own (the datastore already skips them; cheap to be sure)
        controller.note_remote_service(admission.fairness_id, admission.service_tokens)

    datastore.subscribe_admissions(on_admission)
