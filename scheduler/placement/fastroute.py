"""The route a placement publishes for the fast path (scheduler/store/routes.py): which
runner a client may send jobs shaped like the one just placed straight to."""

from __future__ import annotations

from scheduler.cluster import Snapshot
from scheduler.placement.commit import Assigned
from scheduler.protocol import JobRequest, Placement
from scheduler.store.routes import Route


def route_for(
    req: JobRequest,
    assigned: Assigned,
    placement: Placement,
    snap: Snapshot,
    config_key: str,
    warning: str | None,
) -> Route | None:
    """The route for jobs shaped as ``req``: the runner it went to, when that is the one
    runner of its model and configuration and spans one device (else None), with the
    num_ctx ``warning`` its jobs share. Called after the job is sent, so it must not
    raise (the job would be placed again)."""
    devices = assigned.device_ids or [assigned.device_id]
    for runner in snap.all_live_by_model.get(req.model, ()):  # a lapsed replica counts
        if runner.id == assigned.runner_id:
            devices = list(runner.devices)
        elif runner.config_key == config_key:
            return None  # replicas: placement chooses among them
    device = snap.device_by_id.get(devices[0])
    worker = device.worker if device is not None else None
    if len(devices) != 1 or worker is None:
        return None
    return Route(
        runner_id=assigned.runner_id,
        device_id=devices[0],
        worker=worker,
        config=placement.config,
        warnings=[warning] if warning else [],
    )
