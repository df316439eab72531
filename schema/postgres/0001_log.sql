-- The signed, hash-chained event log (PostgreSQL). Safe to apply twice.

-- One row: the number of the newest append transaction. Every append transaction updates it
-- first, which serialises appends and makes commit numbers gap-free and in commit order.
CREATE TABLE IF NOT EXISTS log_counter (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    last_commit BIGINT  NOT NULL
);
INSERT INTO log_counter (id, last_commit) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;

CREATE TABLE IF NOT EXISTS events (
    tenant_id    TEXT    NOT NULL,
    seq          BIGINT  NOT NULL,
    id           TEXT    NOT NULL,
    stream       TEXT    NOT NULL,
    version      BIGINT  NOT NULL,
    type         TEXT    NOT NULL,
    at_ms        BIGINT  NOT NULL,
    commit_no    BIGINT  NOT NULL,
    commit_index INTEGER NOT NULL,
    canonical    BYTEA   NOT NULL,
    hash         BYTEA   NOT NULL,
    sig          BYTEA   NOT NULL,
    key_id       TEXT    NOT NULL,
    PRIMARY KEY (tenant_id, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_id ON events (tenant_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_stream ON events (tenant_id, stream, version);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_position ON events (commit_no, commit_index);

CREATE TABLE IF NOT EXISTS chain_heads (
    tenant_id TEXT    NOT NULL PRIMARY KEY,
    seq       BIGINT  NOT NULL,
    hash      BYTEA   NOT NULL
);

CREATE TABLE IF NOT EXISTS idempotency (
    tenant_id    TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    request_hash BYTEA   NOT NULL,
    first_seq    BIGINT  NOT NULL,
    last_seq     BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, key)
);

CREATE TABLE IF NOT EXISTS signing_keys (
    key_id        TEXT    NOT NULL PRIMARY KEY,
    public_key    BYTEA   NOT NULL,
    created_at_ms BIGINT  NOT NULL
);

-- Every read model: JSON documents keyed by (tenant, kind, id), written in the append
-- transaction and rebuildable from the log.
CREATE TABLE IF NOT EXISTS projections (
    tenant_id TEXT NOT NULL,
    kind      TEXT NOT NULL,
    id        TEXT NOT NULL,
    doc       TEXT NOT NULL,
    PRIMARY KEY (tenant_id, kind, id)
);
CREATE INDEX IF NOT EXISTS projections_by_id ON projections (kind, id);
