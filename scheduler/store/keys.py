"""Every Redis key and channel name of ggufq, in one place."""

from __future__ import annotations

PREFIX = "ggufq"

DEVICES = f"{PREFIX}:devices"  # set of device ids
HEARTBEATS = f"{PREFIX}:heartbeats"  # sorted set: device id → time of its last heartbeat
PLACEMENT_ALIVE = f"{PREFIX}:placement:alive"  # sorted set: placement service → last beat
PLACEMENT_FAILING = f"{PREFIX}:placement:failing"  # hash: placement service → failing loops
RUNNERS = f"{PREFIX}:runners"  # set of runner ids
PARKED = f"{PREFIX}:parked"  # sorted set: job id → order (interactive first, then FIFO)
# the parked jobs by model (lua/_hands.lua keeps them with ggufq:parked): hash model → how
# many of its jobs are parked, and one sorted set per model as ggufq:parked
PARKED_MODELS = f"{PREFIX}:parked:models"
DEMAND = f"{PREFIX}:demand"  # hash: model → "decayed request count:time" (eviction order)
CHANGES = f"{PREFIX}:changes"  # stream: n, k = a changed key (lua/_changes.lua); trimmed
CHANGES_N = f"{PREFIX}:changes:n"  # counter: number of the last change logged
CANCELS = f"{PREFIX}:cancels"  # pub/sub channel: ids of jobs asked to cancel
RUNNING = f"{PREFIX}:running"  # hash: job id → time its worker started it
STATS = f"{PREFIX}:stats"  # hash: "<counter>|<model>" → total (scheduler/placement/metrics.py)
# hash: "<timing>|<bucket's upper bound>|<labels…>" → count, "<timing>|sum|<labels…>" → total
# (scheduler/store/stats.py): the cluster's histograms of job timings
TIMINGS = f"{PREFIX}:timings"
ORPHANS = f"{PREFIX}:orphans"  # hash: job id → in-flight record of a device that was dropped
# hash: "<placement>|<job id>" → JSON token, what, at, record, ending: a job a
# placement process has in hand (scheduler/store/hands.py)
IN_HAND = f"{PREFIX}:in_hand"
# custody deadlines (lua/_due.lua, scheduler/store/due.py): sorted sets a liveness look
# reads only below its cutoff. "<job>|<placement>|<device>" → when its send counts from
# (recorded as sent, not started); "<runner id>|<placement>" → when the runner counted a
# job whose in-flight record is not written yet
DUE_SENT = f"{PREFIX}:due:sent"
DUE_COUNTED = f"{PREFIX}:due:counted"
DUE_FINAL = f"{PREFIX}:due:final"  # final chunks owed to streams' own Redis
# the custody records' set of jobs not ended, and the count of moves the custody table
# refused ("<from> -> <to>" → count): lua/_custody.lua
CUSTODY_LIVE = f"{PREFIX}:custody:live"
CUSTODY_REFUSED = f"{PREFIX}:custody:refused"
EVENTS = f"{PREFIX}:events"  # pub/sub channel: capacity freed, device joined
PLACEMENT_QUEUE = f"{PREFIX}.placement"  # Celery queue of the placement service
BATCH_SUFFIX = ".batch"  # batch jobs go to a sibling queue that workers drain second

UNACKED = "unacked"  # kombu's hash: delivery tag → message a consumer took, not yet acked
TASK_PLACE = "ggufq.place"
TASK_RUN = "ggufq.run"
CONTROL_UNLOAD = "ggufq_unload"  # a remote-control command: it never waits behind jobs


def device(device_id: str) -> str:
    return f"{PREFIX}:device:{device_id}"  # hash: id, host, worker, queue, kind, total, free, ...


def reservations(device_id: str) -> str:
    return f"{PREFIX}:resv:{device_id}"  # hash: runner id → bytes reserved on this device


def runner(runner_id: str) -> str:
    return f"{PREFIX}:runner:{runner_id}"  # hash: model, config_key, devices, state, in_flight...


def runner_jobs(runner_id: str) -> str:
    # hash: placement id -> when the runner was given it (Redis's clock), for each job it
    # was given and has not ended; its hash's in_flight is the count, kept in the same step
    # (lua/_jobs.lua)
    return f"{PREFIX}:runner:{runner_id}:jobs"


def job_chunks(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:chunks"  # stream of chunks, entry id 0-<seq>, with an expiry


def job_channel(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"  # pub/sub channel: each chunk as it is produced


def inflight(device_id: str) -> str:
    return f"{PREFIX}:inflight:{device_id}"  # hash: job id → {job, placement} sent there


def job_submitted(job_id: str) -> str:
    # string: set once, when the job is submitted (a second submission of the id is refused)
    return f"{PREFIX}:job:{job_id}:submitted"


def route(shape: str) -> str:
    # string: the one runner that serves jobs of this shape (scheduler/store/routes.py)
    return f"{PREFIX}:route:{shape}"


def job_custody(job_id: str) -> str:
    # hash: state, holder, epoch, at, device ("<epoch>|<device>"): the job's custody record
    # (lua/_custody.lua)
    return f"{PREFIX}:job:{job_id}:custody"


def job_hops(job_id: str) -> str:
    # hash: hop name → wall-clock time the job passed it (scheduler/store/hops.py)
    return f"{PREFIX}:job:{job_id}:hops"


def job_placed(job_id: str) -> str:
    # string: set by the placement process that takes the job's submission message
    return f"{PREFIX}:job:{job_id}:placed"


def job_reader(job_id: str) -> str:
    # string with a short expiry, renewed by a reader that cancels the job if it goes away;
    # "gone" once renewed and then expired (the reader process died)
    return f"{PREFIX}:job:{job_id}:reader"


def job_reader_wanted(job_id: str) -> str:
    # string: some reader asked for the job to end with it (set with the first lease)
    return f"{PREFIX}:job:{job_id}:reader:wanted"


def job_http(job_id: str) -> str:
    # hash: the HTTP request that made a resumable stream (its path, body, tenant, submitted
    # at), kept with the job's chunks so that any gateway can pick the stream up again
    # (api_client/gateway/resume.py)
    return f"{PREFIX}:job:{job_id}:http"


def conversation(tenant: str, name: str) -> str:
    # string: the job id of the tenant's latest stream under its X-Conversation-Id
    return f"{PREFIX}:conversation:{tenant}:{name}"


def cancel_flag(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:cancel"  # string: set when the job is asked to cancel


def parked_of(model: str) -> str:
    return f"{PREFIX}:parked:model:{model}"  # sorted set: its parked jobs, as ggufq:parked


def parked_job(job_id: str) -> str:
    return f"{PREFIX}:parked:{job_id}"  # string: the parked job's JSON


def device_queue(device_id: str, priority: str = "interactive") -> str:
    """The Celery queue of a device: ``gpu:host:0`` → ``ggufq.gpu.host.0`` (+ ``.batch``)."""
    base = f"{PREFIX}." + device_id.replace(":", ".")
    return base + BATCH_SUFFIX if priority == "batch" else base


def placement_queue(priority: str = "interactive") -> str:
    return PLACEMENT_QUEUE + BATCH_SUFFIX if priority == "batch" else PLACEMENT_QUEUE


# the gateway's API keys (api_client/gateway/keys.py): only hashes of tokens are stored,
# in a keyspace of their own that only the gateway's Redis user may touch
# (scheduler/store/acl.py); before it they were under ggufq:apikey (OLD_API_KEYS)
AUTH_PREFIX = f"{PREFIX}-auth"
API_KEYS = f"{AUTH_PREFIX}:keys"  # hash: key id → digest of its token
OLD_API_KEYS = f"{PREFIX}:apikeys"


def api_key(digest: str) -> str:
    return f"{AUTH_PREFIX}:key:{digest}"  # string: the key's record (JSON), by its token's digest


def old_api_key(digest: str) -> str:
    return f"{PREFIX}:apikey:{digest}"


def api_key_in_flight(key_id: str) -> str:
    return f"{AUTH_PREFIX}:key:{key_id}:inflight"  # sorted set: request ticket → start time


def api_key_minute(key_id: str, minute: int) -> str:
    return f"{AUTH_PREFIX}:key:{key_id}:rpm:{minute}"  # counter: the key's requests that minute


def gateway_beat(gateway_id: str) -> str:
    return f"{PREFIX}:gateway:{gateway_id}"  # string with a TTL: that gateway process is alive


# prefix of the counters (one a second) of bytes admitted lately (scheduler/store/headroom.py)
MEMORY_ADMITTED = f"{PREFIX}:memory:admitted"

# server-side batches (api_client/batches): each batch's record, the lease of the process
# driving it, the job sent for each line and each line's end (until its files are written)
BATCHES = f"{PREFIX}:batches"  # sorted set: batch id → when it was created
BATCHES_ACTIVE = f"{PREFIX}:batches:active"  # set: batches not ended (drivers look here)


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"  # hash: state, counts, times, file ids, its doc


def batch_lease(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:lease"  # string with a TTL: the driving process


def batch_sent(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:sent"  # hash: line → "attempt:submitted_at"


def batch_out(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:out"  # hash: line → its output or error line
