-- The outbox consumers' operational state (SQLite). Not the log: losing it loses delivery
-- history, never an event. Safe to apply twice.

-- How far each named consumer has fanned the log out, and who holds its fan-out lease.
CREATE TABLE IF NOT EXISTS consumer_cursors (
    consumer       TEXT    NOT NULL PRIMARY KEY,
    commit_no      INTEGER NOT NULL,
    commit_index   INTEGER NOT NULL,
    lease_owner    TEXT,
    lease_until_ms INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL
);

-- One unit of at-least-once work: a delivery of one event to one receiver.
CREATE TABLE IF NOT EXISTS work_items (
    tenant_id      TEXT    NOT NULL,
    consumer       TEXT    NOT NULL,
    id             TEXT    NOT NULL,
    subject        TEXT    NOT NULL,
    payload        TEXT    NOT NULL,
    state          TEXT    NOT NULL CHECK (state IN ('pending', 'done', 'dead')),
    attempts       INTEGER NOT NULL,
    round_attempts INTEGER NOT NULL,
    next_at_ms     INTEGER NOT NULL,
    lease_owner    TEXT,
    lease_until_ms INTEGER NOT NULL,
    last_error     TEXT,
    created_at_ms  INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, consumer, id)
);
CREATE INDEX IF NOT EXISTS work_items_due ON work_items (consumer, next_at_ms) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS work_items_by_subject ON work_items (tenant_id, consumer, subject, id);

-- Every attempt, with what the receiver answered and how long it took.
CREATE TABLE IF NOT EXISTS work_attempts (
    tenant_id  TEXT    NOT NULL,
    consumer   TEXT    NOT NULL,
    item_id    TEXT    NOT NULL,
    number     INTEGER NOT NULL,
    at_ms      INTEGER NOT NULL,
    latency_ms INTEGER NOT NULL,
    status     INTEGER,
    error      TEXT,
    next_at_ms INTEGER,
    owner      TEXT    NOT NULL,
    PRIMARY KEY (tenant_id, consumer, item_id, number)
);

-- Write-only secrets (webhook signing keys): never in the log, never in a projection.
CREATE TABLE IF NOT EXISTS secrets (
    tenant_id     TEXT    NOT NULL,
    id            TEXT    NOT NULL,
    value         TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, id)
);
