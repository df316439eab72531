-- The outbox consumers' operational state (PostgreSQL). Not the log: losing it loses delivery
-- history, never an event. Safe to apply twice.

-- How far each named consumer has fanned the log out, and who holds its fan-out lease.
CREATE TABLE IF NOT EXISTS consumer_cursors (
    consumer       TEXT    NOT NULL PRIMARY KEY,
    commit_no      BIGINT NOT NULL,
    commit_index   BIGINT NOT NULL,
    lease_owner    TEXT,
    lease_until_ms BIGINT NOT NULL,
    updated_at_ms  BIGINT NOT NULL
);

-- One unit of at-least-once work: a delivery of one event to one receiver.
CREATE TABLE IF NOT EXISTS work_items (
    tenant_id      TEXT    NOT NULL,
    consumer       TEXT    NOT NULL,
    id             TEXT    NOT NULL,
    subject        TEXT    NOT NULL,
    payload        TEXT    NOT NULL,
    state          TEXT    NOT NULL CHECK (state IN ('pending', 'done', 'dead')),
    attempts       BIGINT NOT NULL,
    round_attempts BIGINT NOT NULL,
    next_at_ms     BIGINT NOT NULL,
    lease_owner    TEXT,
    lease_until_ms BIGINT NOT NULL,
    last_error     TEXT,
    created_at_ms  BIGINT NOT NULL,
    updated_at_ms  BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, consumer, id)
);
CREATE INDEX IF NOT EXISTS work_items_due ON work_items (consumer, next_at_ms) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS work_items_by_subject ON work_items (tenant_id, consumer, subject, id);

-- Every attempt, with what the receiver answered and how long it took.
CREATE TABLE IF NOT EXISTS work_attempts (
    tenant_id  TEXT    NOT NULL,
    consumer   TEXT    NOT NULL,
    item_id    TEXT    NOT NULL,
    number     BIGINT NOT NULL,
    at_ms      BIGINT NOT NULL,
    latency_ms BIGINT NOT NULL,
    status     BIGINT,
    error      TEXT,
    next_at_ms BIGINT,
    owner      TEXT    NOT NULL,
    PRIMARY KEY (tenant_id, consumer, item_id, number)
);

-- Write-only secrets (webhook signing keys): never in the log, never in a projection.
CREATE TABLE IF NOT EXISTS secrets (
    tenant_id     TEXT    NOT NULL,
    id            TEXT    NOT NULL,
    value         TEXT    NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, id)
);
